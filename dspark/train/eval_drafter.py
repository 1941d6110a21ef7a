"""`dspark train eval-drafter`: held-out teacher-forced acceptance of saved drafters, side by side.

Training logs its held-out evaluation per run, on batches drawn with that run's `anchors_per_seq`,
so two runs with different anchor densities are measured on different anchor positions (on
dspark-small, two draws of the same 32 sequences moved expected τ by 5%). This command measures
any number of drafter directories on one set of held-out batches, taken from a drafter training
config (its `model`, `heldout`, `seq_len`, `batch_size`, `eval_batches`, `seed`; `--anchors`
overrides its `anchors_per_seq`):

    dspark train eval-drafter --config configs/drafter-small-dspark-stage4.toml \
        --drafter dspark/assets/dspark-small/drafters/dspark --drafter ~/.cache/dspark/export/x/dspark
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dspark.train.drafter import DrafterTrainConfig, evaluate, load_frozen_target, read_rows, train_device


def evaluate_drafters(cfg: DrafterTrainConfig, drafters: Sequence[str], anchors: int = 0) -> dict:
    """{drafter dir: held-out acceptance per position, expected τ (and confidence error)}."""
    from dspark.drafters.neural import check_compatible
    from dspark.drafters.registry import load_drafter

    if not drafters:
        raise ValueError("name at least one drafter directory (--drafter DIR)")
    if anchors:
        cfg = dataclasses.replace(cfg, anchors_per_seq=anchors)
    target, tok = load_frozen_target(cfg)
    held = read_rows(cfg.heldout)
    pad = tok.pad_id
    out = {}
    for path in drafters:
        drafter = load_drafter(path).float().to(train_device(cfg))
        check_compatible(drafter.config, target)
        drafter._target = [target]  # type: ignore[attr-defined]
        out[path] = evaluate(drafter, target, held, cfg, drafter.config.gamma, pad)
    return {"settings": {k: getattr(cfg, k) for k in ("model", "heldout", "seq_len", "batch_size", "eval_batches",
                                                       "anchors_per_seq", "seed")}, "drafters": out}
