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
