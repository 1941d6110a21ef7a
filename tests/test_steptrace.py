"""The step trace of `dspark bench online --trace`: each step's kind, the buckets of requests per step, and the
table by load, on hand-made records (the in-process run is in test_bench.py)."""

from dspark.bench import steptrace


def rec(config, requests, drafted, verified, forward, emitted, seconds, c=16, **times):
    return {"config": config, "concurrency": c, "requests": requests, "drafted": drafted, "verified": verified,
            "accepted": 0, "forward": forward, "emitted": emitted, "seconds": seconds, "times": times}


def test_kinds_tell_plain_drafted_partial_and_prefill_steps():
    assert steptrace.kind(rec("a", 16, 0, 0, 16, 16, 0.02)) == "plain"
    assert steptrace.kind(rec("a", 16, 16, 24, 40, 27, 0.04)) == "drafted"
    assert steptrace.kind(rec("a", 16, 2, 2, 18, 17, 0.03)) == "partial"  # a probe for two requests
    assert steptrace.kind(rec("a", 16, 16, 0, 16, 16, 0.02)) == "drafted"  # drafted, the policy verified none
    assert steptrace.kind(rec("a", 15, 0, 0, 61, 16, 0.035)) == "prefill"  # a 47-token chunk beside 14 decodes
    assert steptrace.kind(rec("a", 15, 14, 20, 81, 30, 0.05)) == "prefill"


def test_buckets_are_powers_of_two():
    assert [steptrace.bucket(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 63, 64)] == \
        ["1", "2-3", "2-3", "4-7", "4-7", "8-15", "8-15", "16-31", "32-63", "64-127"]


def test_summary_groups_by_config_load_and_kind_in_order():
    recs = [rec("none", 16, 0, 0, 16, 16, 0.020), rec("none", 16, 0, 0, 16, 16, 0.022),
            rec("dspark:dspark", 16, 16, 24, 40, 27, 0.045, verify=0.034, draft=0.006, catch_up=0.002),
            rec("dspark:dspark", 17, 17, 20, 37, 25, 0.043, verify=0.032, draft=0.006, catch_up=0.001),
            rec("dspark:dspark", 16, 0, 0, 16, 16, 0.021, verify=0.020),
            rec("dspark:dspark", 3, 3, 9, 12, 7, 0.025, verify=0.018, draft=0.003),
            rec("none", 4, 0, 0, 4, 4, 0.016, c=4)]
    rows = steptrace.summarize(recs)
    keys = [(r["config"], r["concurrency"], r["kind"], r["requests"]) for r in rows]
    assert keys == [("none", 4, "plain", "4-7"), ("none", 16, "plain", "16-31"),
                    ("dspark:dspark", 16, "plain", "16-31"), ("dspark:dspark", 16, "drafted", "2-3"),
                    ("dspark:dspark", 16, "drafted", "16-31")]
    drafted16 = rows[-1]
    assert drafted16["steps"] == 2 and drafted16["tokens_per_step"] == 26.0
    assert abs(drafted16["ms_per_step"] - 44.0) < 1e-9 and abs(drafted16["tok_s"] - 52 / 0.088) < 1e-9
    assert abs(drafted16["forward_ms"] - 33.0) < 1e-9 and abs(drafted16["catch_up_ms"] - 1.5) < 1e-9
    assert abs(rows[1]["tok_s"] - 32 / 0.042) < 1e-9
    md = steptrace.markdown(rows)
    assert md.count("\n") == 2 + len(rows) and "| dspark:dspark | 16 | drafted | 16-31 | 2 | 26.00 | 44.0 | 591 |" in md


def gated(config, is_open, probe=False, c=1):
    r = rec(config, 1, int(is_open or probe), 0, 1, 1, 0.02, c=c)
    r["gate"] = {"open": is_open, "probe": probe}
    return r


def test_gate_summary_counts_open_steps_probes_closes_and_reopens_per_config_and_load():
    recs = [rec("none", 1, 0, 0, 1, 1, 0.02, c=1),  # no gate: not in the table
            gated("dspark:dspark", True), gated("dspark:dspark", True), gated("dspark:dspark", False),
            gated("dspark:dspark", False, probe=True), gated("dspark:dspark", True), gated("dspark:dspark", False),
            gated("dspark:dspark", True, c=4), gated("dspark:dspark", True, c=4)]
    one, four = steptrace.gate_summary(steptrace.gate_runs(recs))
    assert (one["config"], one["concurrency"], one["steps"]) == ("dspark:dspark", 1, 6)
    assert (one["probes"], one["closes"], one["reopens"], one["first_closed"]) == (1, 2, 1, 3)
    assert one["open_share"] == 0.5
    assert (four["steps"], four["closes"], four["first_closed"], four["open_share"]) == (2, 0, None, 1.0)
    md = steptrace.gate_markdown([one, four])
    assert "| dspark:dspark | 1 | 6 | 50% | 1 | 2 | 1 | 3 |" in md and "| dspark:dspark | 4 | 2 | 100% | 0 | 0 | 0 | – |" in md
    assert steptrace.gate_runs([rec("none", 1, 0, 0, 1, 1, 0.02)]) == {}
    began_closed = steptrace.gate_summary(steptrace.gate_runs([gated("dspark:dspark", False), gated("dspark:dspark", True)]))[0]
    assert (began_closed["closes"], began_closed["reopens"], began_closed["first_closed"]) == (0, 1, 1)


def test_gate_timeline_draws_each_gated_config_and_load_and_nothing_without_a_gate(tmp_path):
    from dspark.bench import plots

    def step(config, c, depth, probe=False, p1=0.3):
        r = rec(config, c, int(depth > 0 or probe), 0, c, c, 0.02, c=c)
        r["gate"] = {"open": depth > 0, "depth": depth, "probe": probe, "acceptance": [p1, 0.5]}
        return r

    recs = [rec("none", 1, 0, 0, 1, 1, 0.02, c=1), step("dspark:dspark", 1, 3), step("dspark:dspark", 1, 0),
            step("dspark:dspark", 1, 0, probe=True, p1=0.2), step("dspark:dspark", 4, 1),
            step("dspark:dspark-async", 1, 2)]
    out = plots.gate_timeline(steptrace.gate_runs(recs), tmp_path / "gate.png")
    assert out == tmp_path / "gate.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plots.gate_timeline(steptrace.gate_runs(recs[:1]), tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
