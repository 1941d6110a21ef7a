"""z-lab DFlash checkpoints (`DFlashDraftModel`, a Qwen3 config with `dflash_config`), in.

`dflash_config` holds `mask_token_id` and `target_layer_ids` (the output of layer i, as dspark's
taps; missing: z-lab's default spread over the target's depth); `block_size` sits at the top
level or in `dflash_config`. The block is `[anchor, mask x (block_size-1)]`; the anchor's slot
predicts nothing and slot k predicts x_k, so a block drafts block_size-1 tokens. The checkpoint
has no embedding nor LM head: both are the target's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dspark.config import ModelConfig
from dspark.drafters.base import DrafterConfig
from dspark.drafters.formats import deepspec
from dspark.drafters.formats.common import fit_target, layer_fields, mismatch, rename, taps


def detect(raw: dict[str, Any]) -> bool:
    return "dflash_config" in raw or "DFlashDraftModel" in (raw.get("architectures") or [])


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: one layer in the middle, or a spread from layer 1 to layer L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def read(path: Path, raw: dict[str, Any], target: ModelConfig | None, state: dict[str, torch.Tensor]):
    fields = layer_fields(raw)
    fit_target("hidden_size", "vocab_size", fields["hidden_size"], fields["vocab_size"], target)
    inner = raw.get("dflash_config") or {}
    slots = raw.get("block_size") or inner.get("block_size")
    if not slots or int(slots) < 2:
        raise mismatch("block_size", f"{slots!r}: a DFlash block needs the anchor and at least one mask")
    if inner.get("mask_token_id") is None:
        raise mismatch("dflash_config.mask_token_id", "missing: the block's mask slots need it")
    mask = int(inner["mask_token_id"])
    if not 0 <= mask < fields["vocab_size"]:
        raise mismatch("dflash_config.mask_token_id", f"{mask} outside the vocabulary of {fields['vocab_size']}")
    layer_ids = inner.get("target_layer_ids")
    if layer_ids is None:
        total = raw.get("num_target_layers") or (target.num_hidden_layers if target else None)
        if total is None:
            raise mismatch("dflash_config.target_layer_ids", "missing, and no num_target_layers to derive them from")
        layer_ids = default_layer_ids(int(total), fields["num_layers"])
    cfg = DrafterConfig(kind="dflash", gamma=int(slots) - 1, block_size=int(slots), anchor_slot=False, head="none", confidence=False,
                        mask_token_id=mask, taps=taps(layer_ids, 0, "dflash_config.target_layer_ids", target), **fields)
    return cfg, rename(state, deepspec.RULES, drop=deepspec.SHARED)
