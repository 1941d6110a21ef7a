"""What every checkpoint format shares: reading its files, mapping its names onto dspark's, and
refusing a drafter that does not fit its target with an error that names the config key.

A format module (`deepspec`, `speculators`, `dflash`, `eagle`) offers `detect(raw) -> bool`
on the parsed config.json and `read(path, raw, target) -> (DrafterConfig, state dict in dspark
names)`; those with an export also offer `write(drafter, out_dir, target)`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dspark.config import ModelConfig

# transformers' defaults for keys a diff-only layer config (`to_diff_dict`) leaves out
LAYER_DEFAULTS = {
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6),
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, rms_norm_eps=1e-6),
}


def mismatch(key: str, detail: str) -> ValueError:
    return ValueError(f"drafter config `{key}`: {detail}")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, its sharded index, or pytorch_model.bin (older EAGLE releases)."""
    from dspark.models.loader import read_state_dict

    if (path / "pytorch_model.bin").is_file() and not (path / "model.safetensors").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return read_state_dict(path)


def layer_fields(raw: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """DrafterConfig fields of the decoder layers described by an HF-style config dict."""
    layer_type = raw.get("model_type", "qwen3")
    if layer_type not in LAYER_DEFAULTS:
        raise mismatch(f"{where}model_type", f"{layer_type!r}: dspark runs qwen3 or llama drafter layers")
    full = {**LAYER_DEFAULTS[layer_type], **raw}
    for key in ("attention_bias", "mlp_bias"):
        if full.get(key):
            raise mismatch(where + key, "biased projections are not supported")
    heads = full["num_attention_heads"]
    rope = ModelConfig.from_hf({**full, "model_type": layer_type})  # one reader of rope keys for all
    return dict(
        layer_type=layer_type, hidden_size=full["hidden_size"], intermediate_size=full["intermediate_size"],
        num_layers=full["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=full.get("num_key_value_heads") or heads,
        head_dim=full.get("head_dim") or full["hidden_size"] // heads, rms_norm_eps=full["rms_norm_eps"],
        rope_theta=rope.rope_theta, rope_scaling=rope.rope_scaling, vocab_size=full["vocab_size"],
    )


def taps(ids: Sequence[int], shift: int, key: str, target: ModelConfig | None, top: int | None = None) -> tuple[int, ...]:
    """A format's target layer ids -> dspark taps (the output of layer i; -1 the embeddings). shift:
    what to subtract (DeepSpec and DFlash count as dspark does, 0; speculators/vLLM count
    hidden-state indices, 1: id i is the residual stream after i layers, 0 the embeddings)."""
    if not ids:
        raise mismatch(key, "no target layers")
    out = tuple(int(i) - shift for i in ids)
    if any(t < -1 for t in out):
        raise mismatch(key, f"{list(ids)}: negative layer ids")
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise mismatch(key, f"{list(ids)}: the layer ids must increase (the target concatenates taps in layer order)")
    if target is not None:
        limit = target.num_hidden_layers if top is None else top
        bad = [i for i, t in zip(ids, out, strict=True) if t >= limit]
        if bad:
            raise mismatch(key, f"layer ids {bad} out of range for a target with {target.num_hidden_layers} layers")
    return out


def fit_target(key_hidden: str, key_vocab: str, hidden: int, vocab: int, target: ModelConfig | None) -> None:
    if target is None:
        return
    if hidden != target.hidden_size:
        raise mismatch(key_hidden, f"{hidden} != the target's hidden_size {target.hidden_size}")
    if vocab != target.vocab_size:
        raise mismatch(key_vocab, f"{vocab} != the target's vocab_size {target.vocab_size}")


def vocab_map(d2t: torch.Tensor | None, t2d: torch.Tensor | None, size: int, vocab: int) -> tuple[int, ...]:
    """EAGLE-3 / speculators d2t offsets (token = draft index + d2t[index]) and t2d mask -> token ids
    of the draft vocabulary, checked against the verifier vocabulary of `vocab` tokens."""
    if d2t is None:
        raise mismatch("d2t", f"a draft vocabulary of {size} tokens needs its d2t map")
    if d2t.ndim != 1 or d2t.numel() != size:
        raise mismatch("d2t", f"shape {list(d2t.shape)} does not fit draft_vocab_size {size}")
    ids = (d2t.long() + torch.arange(size)).tolist()
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise mismatch("d2t", f"maps to token ids {bad[:5]} outside the target vocabulary of {vocab}")
    if len(set(ids)) != len(ids):
        raise mismatch("d2t", "maps two draft tokens to one target token")
    if t2d is not None:
        if t2d.numel() != vocab:
            raise mismatch("t2d", f"{t2d.numel()} entries != the target vocabulary of {vocab}")
        if sorted(torch.nonzero(t2d.bool()).flatten().tolist()) != sorted(ids):
            raise mismatch("t2d", "does not mark the same tokens as d2t")
    return tuple(ids)


def rename(state: Mapping[str, torch.Tensor], rules: Sequence[tuple[str, str]],
           drop: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """Rename keys by the first matching prefix rule; drop keys starting with any of `drop`."""
    out = {}
    for key, value in state.items():
        if any(key.startswith(d) for d in drop):
            continue
        for old, new in rules:
            if key.startswith(old):
                out[new + key[len(old):]] = value
                break
        else:
            out[key] = value
    return out


def load_weights(module: torch.nn.Module, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Load every weight exactly, or say which are missing, unexpected or of another shape."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match its config: missing {missing[:6]}, unexpected {unexpected[:6]}")
    wrong = [f"{k} {list(v.shape)} (config says {list(own[k].shape)})" for k, v in state.items() if v.shape != own[k].shape]
    if wrong:
        raise ValueError(f"{path}: weights of another shape than its config gives: {wrong[:4]}")
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})


def read_json(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())
