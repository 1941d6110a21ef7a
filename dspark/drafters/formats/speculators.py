"""vLLM speculators checkpoints (`speculators_model_type`: `dspark`, `dflash` or `eagle3`), in;
`dspark` and `eagle3` out (what vLLM serves; `eagle3` for EAGLE-3 drafters in the published layout).

Layer shapes come from `transformer_layer_config` (a diff against transformers' defaults). Target
layer ids (`aux_hidden_state_layer_ids`, `eagle_aux_hidden_state_layer_ids`) count hidden-state
indices as vLLM captures them: id i is the residual stream after i layers, dspark's tap i-1.
`draft_vocab_size` below the verifier's vocabulary means a draft vocabulary: `d2t` offsets
(token = index + d2t[index]) and the `t2d` mask, an LM head over those rows and, for DSpark, a
Markov W2 over them (held here as the full vocabulary's W2, zero elsewhere, restricted to them).
DFlash-family blocks: `block_size` slots; `sample_from_anchor` says whether the anchor's slot
predicts x_1 (DSpark's default) or nothing (DFlash's: slot k predicts x_k).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dspark.config import ModelConfig
from dspark.drafters.base import DrafterConfig
from dspark.drafters.formats import deepspec
from dspark.drafters.formats.common import fit_target, layer_fields, mismatch, rename, taps, vocab_map

KINDS = ("dspark", "dflash", "eagle3")
VERIFIER_OWNED = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.", "t2d", "d2t")
TLC = "transformer_layer_config."


def detect(raw: dict[str, Any]) -> bool:
    return "speculators_model_type" in raw


def speculative_tokens(raw: dict[str, Any], default: int) -> int:
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens") or default)


def read(path: Path, raw: dict[str, Any], target: ModelConfig | None, state: dict[str, torch.Tensor]):
    kind = raw["speculators_model_type"]
    if kind not in KINDS:
        raise mismatch("speculators_model_type", f"{kind!r}: dspark reads {KINDS}")
    fields = layer_fields(raw.get("transformer_layer_config") or {}, TLC)
    fit_target(TLC + "hidden_size", TLC + "vocab_size", fields["hidden_size"], fields["vocab_size"], target)
    if raw.get("target_hidden_size") not in (None, fields["hidden_size"]):
        raise mismatch("target_hidden_size", f"{raw['target_hidden_size']} != hidden_size {fields['hidden_size']}")
    vocab = fields["vocab_size"]
    size = int(raw.get("draft_vocab_size") or vocab)
    ids = vocab_map(state.get("d2t"), state.get("t2d"), size, vocab) if size != vocab else ()
    if kind == "eagle3":
        return read_eagle3(raw, target, state, fields, ids)
    return read_block(raw, target, state, fields, ids, kind)


def read_block(raw, target, state, fields, ids, kind):
    """DFlash-family (dspark, dflash): the KV-injected parallel backbone."""
    slots = int(raw.get("block_size", 8))
    anchor = bool(raw.get("sample_from_anchor", kind == "dspark"))
    gamma = speculative_tokens(raw, slots if anchor else slots - 1)
    if raw.get("mask_token_id") is None:
        raise mismatch("mask_token_id", "missing: the block's mask slots need it")
    if kind == "dspark":
        heads = deepspec.head_fields(raw, fields["vocab_size"])
    else:
        heads = dict(head="none", confidence=False, mask_token_id=int(raw["mask_token_id"]))
    layer_ids = raw.get("aux_hidden_state_layer_ids")
    cfg = DrafterConfig(kind="dspark" if kind == "dspark" else "dflash", gamma=gamma,
                        taps=taps(layer_ids or [], 1, "aux_hidden_state_layer_ids", target),
                        block_size=slots, anchor_slot=anchor,
                        draft_vocab=ids, own_lm_head=bool(ids), **heads, **fields)
    drop = VERIFIER_OWNED + (() if ids else ("lm_head.",))
    out = rename(state, deepspec.RULES, drop=drop)
    if ids:
        out["own_head.weight"] = out.pop("lm_head.weight")
        if "head.w2.weight" in out:  # W2 over the draft vocabulary -> the full vocabulary's W2, zero elsewhere
            w2 = out["head.w2.weight"]
            full = w2.new_zeros(fields["vocab_size"], w2.shape[1])
            full[torch.tensor(ids)] = w2
            out["head.w2.weight"] = full
    return cfg, out


def read_eagle3(raw, target, state, fields, ids):
    for key in ("norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad"):
        if raw.get(key):
            raise mismatch(key, "this EAGLE-3 variant is not supported (only the published layout)")
    if fields["num_layers"] != 1:
        raise mismatch(TLC + "num_hidden_layers", f"{fields['num_layers']}: dspark serves one-layer EAGLE-3")
    layer_ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if layer_ids is None:
        if target is None:
            raise mismatch("eagle_aux_hidden_state_layer_ids", "missing, and no target to take the default from")
        n = target.num_hidden_layers
        layer_ids = [2, n // 2, n - 3]
    cfg = DrafterConfig(kind="eagle3", gamma=speculative_tokens(raw, 3), split_entry=True,
                        norm_before_residual=bool(raw.get("norm_before_residual", False)),
                        taps=taps(layer_ids, 1, "eagle_aux_hidden_state_layer_ids", target),
                        head="none", confidence=False, draft_vocab=ids, own_lm_head=True, **fields)
    rules = (("layers.0.", "layer."), ("lm_head.", "own_head."))
    return cfg, rename(state, rules, drop=VERIFIER_OWNED)


def layer_config(cfg: DrafterConfig, t: ModelConfig) -> dict[str, Any]:
    """`transformer_layer_config` of the drafter's decoder layers."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling_dict or {})}
    return {"model_type": cfg.layer_type, "vocab_size": t.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": t.max_position_embeddings,
            "rope_parameters": rope, "tie_word_embeddings": False}


def proposal(algorithm: str, cfg: DrafterConfig, t: ModelConfig) -> dict[str, Any]:
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.gamma}],
            "verifier": {"name_or_path": None, "architectures": [f"{t.model_type.capitalize()}ForCausalLM"]}}


def write(drafter, target, out_dir: Path) -> Path:
    """speculators `dspark` (or, for an EAGLE-3 drafter in the published layout, `eagle3`)
    config.json + model.safetensors for a drafter of `target`."""
    if drafter.config.split_entry:
        return write_eagle3(drafter, target, out_dir)
    cfg = drafter.config
    deepspec.check_exportable(cfg)
    t = target.config
    layer = layer_config(cfg, t)
    raw = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
           "transformer_layer_config": layer, "draft_vocab_size": t.vocab_size, "block_size": cfg.slots,
           "aux_hidden_state_layer_ids": [i + 1 for i in cfg.taps], "mask_token_id": cfg.mask_token_id,
           "sample_from_anchor": True, "markov_rank": cfg.rank,
           "markov_head_type": {v: k for k, v in deepspec.HEADS.items()}[cfg.head],
           "enable_confidence_head": cfg.confidence, "confidence_head_with_markov": cfg.confidence_markov,
           "speculators_version": "0.9.0", "speculators_config": proposal("dspark", cfg, t)}
    raw.update(deepspec.sts_keys(cfg))
    return deepspec.save(out_dir, raw, deepspec.dspark_names(drafter))


def write_eagle3(drafter, target, out_dir: Path) -> Path:
    """speculators `eagle3` for an EAGLE-3 drafter in the published layout (read from any EAGLE-3
    format: this converts original / SpecForge checkpoints for vLLM)."""
    cfg, t = drafter.config, target.config
    raw = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
           "transformer_layer_config": layer_config(cfg, t), "draft_vocab_size": len(cfg.draft_vocab) or t.vocab_size,
           "norm_before_residual": cfg.norm_before_residual, "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.taps],
           "speculators_version": "0.9.0", "speculators_config": proposal("eagle3", cfg, t)}
    rules = {"layer.": "layers.0.", "own_head.": "lm_head."}
    state = {}
    for key, value in drafter.state_dict().items():
        prefix = next((p for p in rules if key.startswith(p)), "")
        state[rules.get(prefix, "") + key[len(prefix):]] = value.detach()
    # speculators' eagle3 keeps the embedding in the checkpoint (from_pretrained does not refill it from the verifier)
    state["embed_tokens.weight"] = target.model.embed_tokens.weight.detach()
    if cfg.draft_vocab:
        ids = torch.tensor(cfg.draft_vocab)
        state["d2t"] = ids - torch.arange(len(ids))
        state["t2d"] = torch.zeros(t.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    return deepspec.save(out_dir, raw, state)


def verifier(out_dir: Path, name_or_path: str) -> None:
    """Point an exported config at the verifier directory the reference loads embeddings from."""
    path = Path(out_dir) / "config.json"
    raw = json.loads(path.read_text())
    raw["speculators_config"]["verifier"]["name_or_path"] = name_or_path
    path.write_text(json.dumps(raw, indent=2))
