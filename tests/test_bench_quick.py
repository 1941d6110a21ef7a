"""The `--quick` benchmark presets as CI smoke tests on the shipped dspark-tiny model (named explicitly;
the default model is the deeper dspark-small): each runs
through the real command line, end to end, and writes well-formed results. Never a speed
assertion (CI machines vary); only that every configuration produced tokens and a report.

    python -m pytest -m slow tests/test_bench_quick.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def bench(*args: str, out: Path) -> dict:
    model = [] if "--model" in args else ["--model", "dspark-tiny"]  # the smallest shipped model: a smoke test
    cmd = [sys.executable, "-m", "dspark", "bench", *args, *model, "--quick", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    name = args[0] if args[0] != "online" or "hostile" not in args else "online-hostile"
    return json.loads((out / f"{name}.json").read_text())


def test_offline_quick(tmp_path):
    res = bench("offline", out=tmp_path)
    drafters = {r["drafter"] for r in res["rows"]}
    assert {"dspark", "eagle3", "ngram"} <= drafters
    assert all(r["tau"] >= 1.0 and r["completion_tokens"] > 0 for r in res["rows"])
    assert (tmp_path / "offline.md").read_text().count("|") > 20
    assert (tmp_path / "acceptance.png").stat().st_size > 0


@pytest.mark.parametrize("workload", ["mixed", "hostile"])
def test_online_quick(tmp_path, workload):
    res = bench("online", "--workload", workload, out=tmp_path)
    configs = {r["config"] for r in res["rows"]}
    assert "none" in configs and "dspark:dspark" in configs
    assert all(r["completion_tokens"] > 0 and r["throughput_tok_s"] > 0 for r in res["rows"])
    suffix = "" if workload == "mixed" else "-hostile"
    assert (tmp_path / f"frontier{suffix}.png").stat().st_size > 0


def test_peers_quick(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_DTYPE", "float32")  # exact greedy agreement with transformers needs float32:
    # in bfloat16 two implementations round differently and a near tie can go either way
    res = bench("peers", "--assistant", "dspark-tiny", out=tmp_path)  # the target as its own assistant: same tokens
    systems = {r["system"] for r in res["rows"]}
    assert "transformers generate" in systems and len(systems) >= 4
    assert "transformers assisted (dspark-tiny)" in systems
    assert "dspark ngram:dspark" in systems  # the engine's prompt lookup beside transformers'
    assert "dspark auto:dspark" in systems  # and its router between the DSpark and the suffix drafter
    assert all(r["tokens"] > 0 for r in res["rows"])
    greedy = [r for r in res["rows"] if r.get("greedy_match_fraction") is not None and "lookup" not in r["system"]]
    assert greedy and all(r["greedy_match_fraction"] == 1.0 for r in greedy)  # lossless against transformers


def test_steps_quick(tmp_path):
    res = bench("steps", "--model", "dspark-tiny", "--configs", "none;dspark:static:3;ngram:static:3@0",
                "--concurrency", "2", out=tmp_path)
    rows = res["results"]
    assert res["settings"]["concurrency"] == 2 and rows["none"]["tokens"] % 2 == 0  # whole batches of two
    assert rows["none"]["plain"]["n"] > 0 and "drafted" not in rows["none"]
    assert rows["dspark:static:3"]["drafted"]["n"] > 0 and rows["dspark:static:3"]["drafted_over_plain"] > 0
    assert "proposal / plain" in (tmp_path / "steps.md").read_text()


def test_steps_config_errors():
    from dspark.bench.steps import StepsSettings, parse_config, run

    assert parse_config("none") == (None, "none", 0)
    assert parse_config("dspark:static:7@2048") == ("dspark", "static:7", 2048)
    for bad in ("dspark", "dspark:static:7@many", ":static:3"):
        with pytest.raises(ValueError, match="config"):
            parse_config(bad)
    with pytest.raises(ValueError, match="include none"):
        run(StepsSettings(configs=("dspark:static:7",)), "/tmp/unused")


def test_exact_quick(tmp_path):
    res = bench("exact", "--configs", "dspark:static:3;ngram:dspark", out=tmp_path)
    assert res["alone_exact"] and res["settings"]["concurrency"] == [1, 2]
    assert [(r["config"], r["together"]) for r in res["rows"]] == [
        ("none", 2), ("dspark:static:3", 1), ("dspark:static:3", 2), ("ngram:dspark", 1), ("ngram:dspark", 2)]
    assert "= plain alone" in (tmp_path / "exact.md").read_text()
