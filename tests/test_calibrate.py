"""Sequential Temperature Scaling: recovers known miscalibration, is monotone and
order-preserving, and runs end to end on real rollouts of a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.drafters.base import save_drafter
from dspark.drafters.registry import new_config, new_drafter
from dspark.models.loader import load_model
from dspark.spec.sts import auroc, brier, ece, fit_sts, survival


def synthetic(n: int = 20000, g: int = 4, scale: float = 2.5, seed: int = 0):
    """True conditional acceptance c_k; the head reports logits scaled by `scale`
    (overconfident); outcomes are sampled from the true chain."""
    gen = torch.Generator().manual_seed(seed)
    true_logits = torch.randn(n, g, generator=gen) * 1.2 + 0.8
    c = torch.sigmoid(true_logits)
    passed = torch.rand(n, g, generator=gen) < c
    accepted = passed.long().cumprod(1).sum(1)
    return true_logits * scale, accepted


def test_sts_recovers_the_temperature_and_lowers_ece():
    logits, accepted = synthetic()
    cal = fit_sts(logits, accepted)
    for k, t in enumerate(cal.temperatures):
        assert 2.0 < t < 3.1, (k, t)
    for before, after in zip(cal.before, cal.after, strict=True):
        assert after["ece"] < before["ece"]
        assert after["ece"] < 0.03
        assert after["brier"] <= before["brier"] + 1e-9


def test_sts_metrics_on_held_out_rounds():
    logits, accepted = synthetic()
    held = synthetic(seed=1)
    cal = fit_sts(logits, accepted, held)
    assert cal.temperatures == fit_sts(logits, accepted).temperatures  # the fit uses the first set only
    observed = (held[1][:, None] >= torch.arange(1, logits.shape[1] + 1)[None]).float().mean(0)
    for k, after in enumerate(cal.after):
        assert abs(after["observed"] - float(observed[k])) < 1e-9  # metrics are on the held-out set
        assert after["ece"] < 0.03


def test_temperature_scaling_is_monotone_and_order_preserving():
    logits, accepted = synthetic(n=2000)
    cal = fit_sts(logits, accepted)
    for k in range(logits.shape[1]):
        scaled = torch.sigmoid(logits[:, k].double() / cal.temperatures[k])
        order = logits[:, k].argsort()
        assert bool((scaled[order][1:] >= scaled[order][:-1]).all())
    a = survival(logits.double(), cal.temperatures)
    assert bool((a[:, 1:] <= a[:, :-1] + 1e-12).all())  # survival is non-increasing in k


def test_metrics_on_known_cases():
    y = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auroc(torch.tensor([0.1, 0.2, 0.8, 0.9]), y) == 1.0
    assert auroc(torch.tensor([0.9, 0.8, 0.2, 0.1]), y) == 0.0
    assert auroc(torch.tensor([0.5, 0.5, 0.5, 0.5]), y) == 0.5
    assert brier(torch.tensor([0.0, 0.0, 1.0, 1.0]), y) == 0.0
    assert ece(torch.tensor([0.25, 0.25, 0.75, 0.75]), torch.tensor([0.0, 1.0, 1.0, 0.0])) == 0.25


def test_calibrate_end_to_end_on_rollouts(qwen3_dir, tmp_path):
    from dspark.train.calibrate import calibrate

    net, tok = load_model(qwen3_dir)
    torch.manual_seed(0)
    d = new_drafter(new_config("dspark", net.config, tok.token_id("<|mask|>") or 0, gamma=3))
    save_drafter(d, d.config, tmp_path / "drafter")
    cal = calibrate(str(qwen3_dir), str(tmp_path / "drafter"), ["The quick brown fox", "def add(a, b):"],
                    str(tmp_path / "out"), max_tokens=12, temperature=1.0)
    assert len(cal.temperatures) == 3
    saved = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert len(saved["sts_temperatures"]) == 3
    assert (tmp_path / "out" / "reliability.png").is_file() and (tmp_path / "out" / "calibration.json").is_file()


def test_temperatures_that_do_not_help_out_of_sample_are_not_written():
    from dspark.spec.sts import Calibration
    from dspark.train.calibrate import shipped_temperatures

    def cal(before, after):
        return Calibration([0.5, 2.0], [{"ece": e} for e in before], [{"ece": e} for e in after])

    assert shipped_temperatures(cal([0.04, 0.02], [0.03, 0.01]))[0] == [0.5, 2.0]
    temps, why = shipped_temperatures(cal([0.03, 0.01], [0.04, 0.01]))
    assert temps == [1.0, 1.0] and "did not lower" in why


def test_greedy_rollouts_calibrate_the_greedy_temperatures_only(qwen3_dir, tmp_path):
    """At temperature 0 the fit goes to `sts_greedy` and loads back; `sts_temperatures` is left alone."""
    from dspark.drafters.registry import load_drafter
    from dspark.train.calibrate import calibrate

    net, tok = load_model(qwen3_dir)
    torch.manual_seed(0)
    d = new_drafter(new_config("dspark", net.config, tok.token_id("<|mask|>") or 0, gamma=3))
    save_drafter(d, d.config, tmp_path / "drafter")
    calibrate(str(qwen3_dir), str(tmp_path / "drafter"), ["The quick brown fox", "def add(a, b):"],
              str(tmp_path / "out"), max_tokens=12, temperature=0.0)
    saved = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert not saved["sts_temperatures"] and len(saved["sts_greedy"]) == 3
    assert load_drafter(str(tmp_path / "drafter")).config.sts_greedy == tuple(saved["sts_greedy"])
    assert json.loads((tmp_path / "out" / "calibration.json").read_text())["key"] == "sts_greedy"


def test_calibrate_without_writing_says_so_and_leaves_the_config(qwen3_dir, tmp_path):
    """`--no-write` reports the choice it would make, marks nothing as written and leaves config.json as it was."""
    from dspark.train.calibrate import calibrate

    net, tok = load_model(qwen3_dir)
    torch.manual_seed(0)
    d = new_drafter(new_config("dspark", net.config, tok.token_id("<|mask|>") or 0, gamma=3))
    save_drafter(d, d.config, tmp_path / "drafter")
    before = (tmp_path / "drafter" / "config.json").read_text()
    calibrate(str(qwen3_dir), str(tmp_path / "drafter"), ["The quick brown fox", "def add(a, b):"],
              str(tmp_path / "out"), max_tokens=12, write=False)
    assert (tmp_path / "drafter" / "config.json").read_text() == before
    report = (tmp_path / "out" / "calibration.md").read_text()
    assert "Not written (--no-write); the choice: Written:" in report
    assert json.loads((tmp_path / "out" / "calibration.json").read_text())["written"] is None


def test_calibrate_refuses_what_is_not_a_drafter_directory_before_any_rollout(qwen3_dir, tmp_path):
    """A pair, a routed name or a missing path: a clear error first, no engine built, nothing written."""
    from dspark.train.calibrate import calibrate

    for name in ("dspark+mtp", "auto", str(tmp_path / "missing")):
        with pytest.raises(ValueError, match="not a drafter directory"):
            calibrate(str(qwen3_dir), name, ["The quick brown fox", "def add(a, b):"], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_temperatures_in_use_that_score_best_are_kept():
    from dspark.spec.sts import Calibration
    from dspark.train.calibrate import shipped_temperatures

    cal = Calibration([0.5, 2.0], [{"ece": 0.04}, {"ece": 0.02}], [{"ece": 0.03}, {"ece": 0.01}])
    temps, why = shipped_temperatures(cal, ([0.8, 0.9], [{"ece": 0.01}, {"ece": 0.01}]))
    assert temps is None and why.startswith("Kept")
    assert shipped_temperatures(cal, ([0.8, 0.9], [{"ece": 0.05}, {"ece": 0.01}]))[0] == [0.5, 2.0]


def test_each_row_reads_the_temperatures_of_its_own_sampling():
    from dspark.drafters.heads import calibrated

    logits = torch.tensor([[1.0, -1.0], [1.0, -1.0], [2.0, 0.5]])
    sampled, greedy = (2.0, 2.0), (0.5, 0.25)
    mixed = calibrated(logits, (True, False, True), sampled, greedy)
    assert torch.allclose(mixed[0], torch.sigmoid(logits[0] / torch.tensor(greedy)))
    assert torch.allclose(mixed[1], torch.sigmoid(logits[1] / torch.tensor(sampled)))
    assert torch.allclose(mixed[2], torch.sigmoid(logits[2] / torch.tensor(greedy)))
    assert torch.equal(calibrated(logits, (True, True, True), sampled, ()), calibrated(logits, (False,) * 3, sampled, ()))


def test_calibrate_without_a_corpus_says_how_to_build_one(tmp_path, capsys):
    from dspark.cli import main

    missing = tmp_path / "corpus"
    assert main(["calibrate", "--drafter", str(tmp_path / "d"), "--corpus", str(missing)]) == 2
    assert f"dspark train corpus --out {missing}" in capsys.readouterr().err
