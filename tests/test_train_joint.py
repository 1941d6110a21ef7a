"""Joint drafter training (`dspark train drafters`): one target pass per batch feeds every drafter,
and each drafter ends exactly where training it alone on the same config would have; configs
that disagree on the shared data or schedule are refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.drafters.registry import load_drafter
from dspark.train.drafter import DrafterTrainConfig, train
from dspark.train.joint import train_joint


def write_rows(path, vocab: int, n: int = 6) -> None:
    import json
    import random

    rng = random.Random(0)
    rows = [{"prompt_ids": [rng.randrange(4, vocab) for _ in range(8)],
             "response_ids": [rng.randrange(4, vocab) for _ in range(24)]} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def configs(qwen3_dir, root, tag: str) -> list[DrafterTrainConfig]:
    rows = str(root / "rows.jsonl")
    shared = dict(model=str(qwen3_dir), data=rows, heldout=rows, seq_len=32, batch_size=2, anchors_per_seq=2,
                  max_steps=3, warmup_steps=1, eval_every=2, eval_batches=1, seed=5)
    return [DrafterTrainConfig(kind=k, run_dir=str(root / tag / k), export_dir=str(root / tag / f"out-{k}"),
                               taps=taps, **shared)
            for k, taps in (("dspark", (0, 1)), ("mtp", ()), ("eagle3", (1,)))]


def test_joint_run_equals_each_drafter_trained_alone(qwen3_dir, tmp_path):
    write_rows(tmp_path / "rows.jsonl", 300)
    cfgs = configs(qwen3_dir, tmp_path, "joint")
    reports = train_joint(cfgs)
    assert set(reports) == {c.run_dir for c in cfgs}
    for cfg in configs(qwen3_dir, tmp_path, "alone"):
        train(cfg)
    for kind in ("dspark", "mtp", "eagle3"):
        joint = load_drafter(str(tmp_path / "joint" / f"out-{kind}")).state_dict()
        alone = load_drafter(str(tmp_path / "alone" / f"out-{kind}")).state_dict()
        assert joint.keys() == alone.keys()
        for name, tensor in joint.items():
            assert torch.allclose(tensor, alone[name], atol=1e-5), (kind, name)


def test_joint_run_refuses_configs_that_disagree(qwen3_dir, tmp_path):
    cfgs = configs(qwen3_dir, tmp_path, "joint")
    with pytest.raises(ValueError, match="'max_steps'"):
        train_joint([cfgs[0], dataclasses.replace(cfgs[1], max_steps=9)])
    with pytest.raises(ValueError, match="own run_dir"):
        train_joint([cfgs[0], dataclasses.replace(cfgs[1], run_dir=cfgs[0].run_dir)])
