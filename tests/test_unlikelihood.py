"""Token-level unlikelihood for target training: the candidate mask is exactly "seen in the
last `window` context tokens and not the true next token", the loss pushes those tokens'
probabilities down, and a training run with it enabled trains and exports."""

from __future__ import annotations

import torch

from dspark.train.target import TargetTrainConfig, repeat_candidates, train, unlikelihood_loss
from tests.test_train_resume import tiny_run


def brute_force(inputs: torch.Tensor, targets: torch.Tensor, vocab: int, window: int) -> torch.Tensor:
    b, t = inputs.shape
    mask = torch.zeros(b, t, vocab, dtype=torch.bool)
    for r in range(b):
        for i in range(t):
            for j in range(max(0, i - window + 1), i + 1):
                mask[r, i, inputs[r, j]] = True
            mask[r, i, targets[r, i]] = False
    return mask


def test_candidates_are_the_recent_context_minus_the_target():
    g = torch.Generator().manual_seed(0)
    for window in (1, 3, 8):
        inputs = torch.randint(0, 11, (2, 9), generator=g)
        targets = torch.randint(0, 11, (2, 9), generator=g)
        assert torch.equal(repeat_candidates(inputs, targets, 11, window), brute_force(inputs, targets, 11, window))


def test_unlikelihood_lowers_the_candidates_probability():
    logits = torch.randn(1, 4, 6, requires_grad=True)
    mask = torch.zeros(1, 4, 6, dtype=torch.bool)
    assert unlikelihood_loss(logits, mask).item() == 0.0
    mask[0, :, 2] = True
    before = logits.softmax(-1)[0, :, 2].detach()
    unlikelihood_loss(logits, mask).backward()
    with torch.no_grad():
        after = (logits - 1.0 * logits.grad).softmax(-1)[0, :, 2]
    assert (after < before).all()


def test_a_run_with_unlikelihood_trains_and_exports(tmp_path):
    cfg_path = tiny_run(tmp_path, "ul")
    cfg_path.write_text(cfg_path.read_text().replace("max_steps = 40", "max_steps = 3")
                        + f'unlikelihood = 1.0\nunlikelihood_window = 8\nexport_dir = "{tmp_path / "out"}"\n')
    cfg = TargetTrainConfig.from_file(cfg_path)
    assert cfg.unlikelihood == 1.0 and cfg.unlikelihood_window == 8
    torch.set_num_threads(1)
    train(cfg)
    assert (tmp_path / "out" / "model.safetensors").is_file()
    log = (tmp_path / "ul" / "log.jsonl").read_text().splitlines()
    assert len(log) == 3
