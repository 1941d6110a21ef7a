"""`dspark bench exact` counts prompts whose greedy tokens equal plain decoding's, and fails where one alone differs."""

from __future__ import annotations

import argparse

import pytest

from dspark.bench import commands, exact


def test_copy_drafters_alone_equal_plain_decoding_on_a_tiny_model(qwen3_dir, tmp_path):
    settings = exact.ExactSettings(model=str(qwen3_dir), configs=("ngram:static:3", "suffix:dspark"), num_prompts=1,
                                   max_tokens=12, concurrency=(1, 3), device="cpu")
    data = exact.run(settings, str(tmp_path))
    assert [(r["config"], r["together"]) for r in data["rows"]] == [
        ("none", 3), ("ngram:static:3", 1), ("ngram:static:3", 3), ("suffix:dspark", 1), ("suffix:dspark", 3)]
    alone = [r for r in data["rows"] if r["together"] == 1]
    assert data["alone_exact"] and all(r["equal_same"] == r["prompts"] == 3 and r["first_difference"] is None
                                       for r in alone)
    assert "every configuration equalled plain decoding" in (tmp_path / "exact.md").read_text()


def test_the_first_difference_is_named_by_prompt_and_token():
    assert exact.first_difference([[1, 2], [5, 6, 7]], [[1, 2], [5, 6, 8]]) == (1, 2)
    assert exact.first_difference([[1, 2, 3]], [[1, 2]]) == (0, 2)
    assert exact.first_difference([[4]], [[4]]) is None
    got = exact.row("ngram:dspark", 1, [[1, 2], [3, 9]], [[1, 2], [3, 4]], [[1, 2], [3, 4]])
    assert (got["equal_same"], got["equal_alone"], got["first_difference"]) == (1, 1, (1, 1))


def test_a_difference_alone_fails_the_command(monkeypatch, tmp_path):
    rows = [exact.row("ngram:dspark", 1, [[1, 9]], [[1, 2]], [[1, 2]])]
    payload = {"settings": {"max_tokens": 2, "num_prompts": 1}, "model": "m", "dtype": "bfloat16", "prompts": 1,
               "rows": rows, "alone_exact": False}
    assert "not lossless on this machine" in exact.markdown(payload)
    monkeypatch.setattr(exact, "run", lambda settings, out: payload)
    args = argparse.Namespace(quick=False, out=str(tmp_path), model=None, device=None, num_prompts=None,
                              max_tokens=None, concurrency=None, configs=None)
    assert commands.run_exact(args) == 1


@pytest.mark.parametrize("bad", ["ngram", ":dspark", "ngram:", "none:static:3"])
def test_a_config_is_a_drafter_and_a_policy(bad):
    with pytest.raises(ValueError, match="DRAFTER:POLICY"):
        exact.parse_config(bad)
