"""The soak (`dspark bench soak`, bench/soak.py) in a short run: a `dspark serve` child process
under streamed and non-streamed requests, clients that leave, bad bodies and a KV pool small
enough to preempt; no errors besides the deliberate ones, every block free afterwards.

    OMP_NUM_THREADS=1 python -m pytest tests/test_soak.py -m slow -s
    dspark bench soak --duration 1200        # the real run: 20 minutes, docs/results/soak/
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("psutil")

from dspark.bench.soak import KINDS, SoakSettings, run  # noqa: E402


@pytest.mark.slow
def test_short_soak_has_no_errors_and_frees_the_pool(qwen3_dir, tmp_path):
    s = SoakSettings(model=str(qwen3_dir), device="cpu", duration_s=20.0, clients=8, max_tokens=32,
                     num_kv_blocks=12, sample_every_s=2.0)
    data = run(s, tmp_path)
    print(json.dumps({k: data[k] for k in ("requests", "rss_mib", "kv_blocks_used")}, indent=1))
    assert data["errors"] == 0, data["problems"]
    assert data["server"]["alive_after_load"] and data["server"]["step_errors"] == 0
    assert data["server"]["kv_blocks_used_after_load"] == 0
    assert all(data["requests"][k]["sent"] > 0 for k in KINDS)  # client c starts at kind c: all ran
    assert data["requests"]["bad"]["ok"] == data["requests"]["bad"]["sent"]
    assert len(data["samples"]) >= 2 and all(x["rss_mib"] > 0 for x in data["samples"])
    assert max(x["kv_blocks_used"] for x in data["samples"]) <= s.num_kv_blocks
    saved = json.loads((tmp_path / "soak.json").read_text())
    assert saved["errors"] == 0 and "RSS" in (tmp_path / "soak.md").read_text()
