"""DeepSpec's DSpark checkpoints (`architectures: ["Qwen3DSparkModel"]`), in and out.

The config is the target's Qwen3 config with the draft's layer count and DSpark's keys:
`block_size` (slots; the anchor's slot predicts x_1), `target_layer_ids` (the output of layer i,
as dspark's taps), `mask_token_id`, `markov_rank` / `markov_head_type` (vanilla | gated | rnn),
`enable_confidence_head`, `confidence_head_with_markov`. Weights: `fc`, `hidden_norm`,
`layers.N.*`, `norm`, `markov_head.markov_w1/w2` (+ `gate_proj` / `joint_proj`),
`confidence_head.proj`, and copies of the target's `embed_tokens` / `lm_head`, which dspark
reads from the target itself. The `sts_temperatures` and `sts_greedy` lists (written by `dspark
calibrate` at temperature 1 and 0) are read back; without them the confidences are raw.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dspark.config import ModelConfig
from dspark.drafters.base import DrafterConfig
from dspark.drafters.formats.common import fit_target, layer_fields, mismatch, rename, taps
from dspark.models.fused import owned

HEADS = {"vanilla": "markov", "gated": "gated", "rnn": "rnn"}
RULES = (("fc.", "backbone.fc."), ("hidden_norm.", "backbone.ctx_norm."), ("layers.", "backbone.layers."),
         ("norm.", "backbone.norm."), ("markov_head.markov_w1.", "head.w1."), ("markov_head.markov_w2.", "head.w2."),
         ("markov_head.gate_proj.", "head.gate."), ("markov_head.joint_proj.", "head.cell."),
         ("confidence_head.", "conf."))
SHARED = ("embed_tokens.", "lm_head.", "rotary_emb.")  # the target's own copies


def detect(raw: dict[str, Any]) -> bool:
    return "Qwen3DSparkModel" in (raw.get("architectures") or [])


def head_fields(raw: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Sequential and confidence head fields from DSpark's keys (shared with speculators' dspark)."""
    rank = int(raw.get("markov_rank", 0))
    kind = str(raw.get("markov_head_type", "vanilla")).lower()
    if rank and kind not in HEADS:
        raise mismatch("markov_head_type", f"{kind!r}: expected one of {sorted(HEADS)}")
    confidence = bool(raw.get("enable_confidence_head", False))
    with_markov = confidence and bool(raw.get("confidence_head_with_markov", rank > 0))
    if with_markov and not rank:
        raise mismatch("confidence_head_with_markov", "needs markov_rank > 0")
    mask = int(raw["mask_token_id"])
    if not 0 <= mask < vocab:
        raise mismatch("mask_token_id", f"{mask} outside the vocabulary of {vocab}")
    return dict(head=HEADS[kind] if rank else "none", rank=rank or 1, confidence=confidence,
                confidence_markov=with_markov, mask_token_id=mask,
                sts_temperatures=tuple(raw.get("sts_temperatures") or ()), sts_greedy=tuple(raw.get("sts_greedy") or ()))


def sts_keys(cfg: DrafterConfig) -> dict[str, list[float]]:
    """The calibration a config carries, as the keys dspark reads back (the reference code ignores them)."""
    return {name: list(getattr(cfg, name)) for name in ("sts_temperatures", "sts_greedy") if getattr(cfg, name)}


def read(path: Path, raw: dict[str, Any], target: ModelConfig | None, state: dict[str, torch.Tensor]):
    fields = layer_fields(raw)
    fit_target("hidden_size", "vocab_size", fields["hidden_size"], fields["vocab_size"], target)
    slots = int(raw["block_size"])  # kept when --gamma drafts fewer: the block always runs whole, as trained
    cfg = DrafterConfig(kind="dspark", gamma=slots, block_size=slots,
                        taps=taps(raw["target_layer_ids"], 0, "target_layer_ids", target),
                        **head_fields(raw, fields["vocab_size"]), **fields)
    return cfg, rename(state, RULES, drop=SHARED)


def dspark_names(drafter) -> dict[str, torch.Tensor]:
    """The drafter's weights under DeepSpec's names (the inverse of RULES)."""
    out = {}
    for key, value in drafter.state_dict().items():
        for theirs, ours in RULES:
            if key.startswith(ours):
                out[theirs + key[len(ours):]] = value.detach().contiguous()
                break
        else:
            raise ValueError(f"weight {key} has no DeepSpec name")
    return out


def check_exportable(cfg: DrafterConfig) -> None:
    if cfg.kind != "dspark" or cfg.layer_type != "qwen3" or not cfg.anchor_slot or cfg.draft_vocab:
        raise ValueError("DeepSpec's format holds DSpark drafters with Qwen3 layers, an anchor slot that "
                         "predicts x_1 and the full vocabulary")
    if cfg.head == "none":
        raise ValueError("DeepSpec's DSpark requires a sequential head (markov_rank > 0)")
    if cfg.head not in HEADS.values():
        raise ValueError(f"DeepSpec's DSpark has no {cfg.head!r} sequential head (its kinds: vanilla, gated, rnn): "
                         "this drafter's head reads weights that format (and the servers reading it) cannot hold")
    if cfg.causal_block:
        raise ValueError("DeepSpec's DSpark block is bidirectional: this drafter was trained with a causal block "
                         "(causal_block), which that format (and the servers reading it) cannot express")
    if cfg.context_residual:
        raise ValueError("DeepSpec's DSpark has no context_residual projection: this drafter reads the feature "
                         "before the anchor into its block, which that format (and the servers reading it) cannot")
    if cfg.anchor_mlp:
        raise ValueError("DeepSpec's DSpark has no anchor-slot MLP (anchor_mlp): this drafter's first proposal runs "
                         "weights that format (and the servers reading it) cannot hold")
    if cfg.slot_mlp:
        raise ValueError("DeepSpec's DSpark has no per-slot MLPs (slot_mlp): every slot of its block runs the same "
                         "weights, which this drafter's do not")


def write(drafter, target, out_dir: Path) -> Path:
    """DeepSpec's config.json + model.safetensors for a dspark DSpark drafter of `target` (CausalLM)."""
    cfg = drafter.config
    check_exportable(cfg)
    t = target.config
    raw = {**t.to_hf("float32"), "architectures": ["Qwen3DSparkModel"], "num_target_layers": t.num_hidden_layers,
           "num_hidden_layers": cfg.num_layers, "intermediate_size": cfg.intermediate_size,
           "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
           "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
           "block_size": cfg.slots, "tie_word_embeddings": False, "layer_types": ["full_attention"] * cfg.num_layers,
           "mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.taps), "num_anchors": 512,
           "markov_rank": cfg.rank, "markov_head_type": {v: k for k, v in HEADS.items()}[cfg.head],
           "enable_confidence_head": cfg.confidence}
    raw["rope_parameters"] = {**raw["rope_parameters"], "rope_theta": cfg.rope_theta}
    if cfg.confidence:
        raw["confidence_head_with_markov"] = cfg.confidence_markov
    raw.update(sts_keys(cfg))
    state = dspark_names(drafter)
    state["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().contiguous()
    state["lm_head.weight"] = target.lm_head.weight.detach().clone().contiguous()
    return save(out_dir, raw, state)


def save(out_dir: Path, raw: dict[str, Any], state: dict[str, torch.Tensor]) -> Path:
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    save_file({k: owned(v.float() if v.is_floating_point() else v) for k, v in state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
