"""Original (SafeAILab) and SpecForge EAGLE-3 checkpoints, in.

A Llama-style config (`architectures` such as `LlamaForCausalLMEagle3`, `draft_vocab_size`;
SpecForge may add `eagle_config.eagle_aux_hidden_state_layer_ids`) and weights `midlayer.*`
(one decoder layer whose q/k/v read [norm(emb); norm(g)] and whose `hidden_norm` norms g),
`fc`, `norm`, `lm_head` over the draft vocabulary, `d2t` offsets and the `t2d` mask, sometimes
`embed_tokens` (the target's; dspark reads the target's own). Without explicit ids the target
layers are EAGLE-3's low / middle / high choice, hidden-state indices 2, L/2, L-3 (dspark taps
1, L/2-1, L-4). Served by `drafters/eagle.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dspark.config import ModelConfig
from dspark.drafters.base import DrafterConfig
from dspark.drafters.formats.common import fit_target, layer_fields, mismatch, rename, taps, vocab_map


def detect(raw: dict[str, Any]) -> bool:
    return any("Eagle3" in a or "EAGLE3" in a for a in raw.get("architectures") or []) and "speculators_model_type" not in raw


def detect_dir(path: Path, raw: dict[str, Any]) -> bool:
    """Configs without an EAGLE-3 architecture name: look for `midlayer.*` weights."""
    if "draft_vocab_size" not in raw:
        return False
    from safetensors import safe_open

    file = path / "model.safetensors"
    if not file.is_file():
        return (path / "pytorch_model.bin").is_file()
    with safe_open(str(file), "pt") as f:
        return any(k.startswith("midlayer.") for k in f.keys())


def read(path: Path, raw: dict[str, Any], target: ModelConfig | None, state: dict[str, torch.Tensor]):
    fields = layer_fields({**raw, "model_type": "llama", "num_hidden_layers": 1})  # midlayer: a Llama layer
    vocab = int(raw.get("target_vocab_size") or fields["vocab_size"])
    if "t2d" in state:
        vocab = state["t2d"].numel()
    fields["vocab_size"] = vocab
    fit_target("hidden_size", "vocab_size", fields["hidden_size"], vocab, target)
    size = int(raw.get("draft_vocab_size") or vocab)
    ids = vocab_map(state.get("d2t"), state.get("t2d"), size, vocab) if size != vocab else ()
    key = "eagle_config.eagle_aux_hidden_state_layer_ids"
    layer_ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if layer_ids is None:
        if target is None:
            raise mismatch(key, "missing, and no target to take EAGLE-3's default layers from")
        n = target.num_hidden_layers
        layer_ids = [2, n // 2, n - 3]
    if "midlayer.self_attn.q_proj.weight" not in state:
        raise mismatch("midlayer", "no midlayer.* weights: not an EAGLE-3 checkpoint")
    cfg = DrafterConfig(kind="eagle3", gamma=int(raw.get("speculative_tokens", 7)), split_entry=True,
                        taps=taps(layer_ids, 1, key, target), head="none", confidence=False,
                        draft_vocab=ids, own_lm_head=True, **fields)
    rules = (("midlayer.", "layer."), ("lm_head.", "own_head."))
    return cfg, rename(state, rules, drop=("embed_tokens.", "d2t", "t2d"))
