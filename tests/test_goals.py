"""`dspark bench goals` on hand-made result files: every bar is read from the right rows,
met and missed are told apart, and a missing file leaves its goals "not measured"."""

from __future__ import annotations

import json

from dspark.bench import goals


def online_rows(spec_scale: float) -> list[dict]:
    rows = []
    for c, base in ((1, 100.0), (8, 400.0)):
        for config, scale in (("none", 1.0), ("mtp:static:1", 0.6), ("dspark:static:7", 0.5),
                              ("dspark:dspark", spec_scale)):
            speed = base / c * scale
            rows.append({"config": config, "concurrency": c, "throughput_tok_s": base * scale,
                         "per_user_tok_s_mean": speed})
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    ref = {r["concurrency"]: r for r in rows if r["config"] == "none"}
    return [{"config": r["config"], "concurrency": r["concurrency"],
             "throughput_ratio": r["throughput_tok_s"] / ref[r["concurrency"]]["throughput_tok_s"]}
            for r in rows if r["config"] != "none"]


def write(tmp_path, name: str, payload: dict) -> None:
    path = tmp_path / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"date": "today", **payload}))


def by_goal(payload: dict) -> dict[str, dict]:
    return {c["goal"]: c for c in payload["checks"]}


def test_goals_read_the_right_rows(tmp_path):
    offline = [{"drafter": d, "temperature": 1.0, "domain": dom, "tau": tau}
               for d, tau in (("dspark", 2.6), ("eagle3", 2.0), ("dflash", 2.4)) for dom in ("math", "chat")]
    write(tmp_path, "offline/offline", {"rows": offline})
    rows = online_rows(1.2)
    write(tmp_path, "online/online", {"rows": rows, "ratios": ratios(rows)})
    hostile = online_rows(0.96)
    write(tmp_path, "online/online-hostile", {"rows": hostile, "ratios": ratios(hostile)})
    got = by_goal(goals.run(tmp_path))
    assert got["offline τ (T = 1, γ = 7, domain macro): dspark / eagle3"]["status"] == "met"  # 1.3
    assert got["offline τ (T = 1, γ = 7, domain macro): dspark / dflash"]["status"] == "missed"  # 1.083
    every = got["every C: dspark:dspark aggregate / best static:k"]
    assert every["value"] == 1.2 / 0.6 and every["detail"].startswith("lowest at C = 1; all: 1: 2.000 (mtp:static:1)")
    assert got["every C: dspark:dspark aggregate / none"]["status"] == "met"  # 1.2 at both
    assert got["matched aggregate throughput: dspark:dspark per-user / mtp:static:1"]["status"] == "met"
    assert got["never a loss (online/online.json): dspark:dspark / none, every C"]["status"] == "met"
    hostile_check = got["never a loss (online/online-hostile.json): dspark:dspark / none, every C"]
    assert hostile_check["status"] == "missed" and abs(hostile_check["value"] - 0.96) < 1e-9
    assert all(c["status"] == "not measured" for t, c in got.items() if t.startswith("single stream"))
    assert got["C = 1: dspark:dspark aggregate / none"]["status"] == "missed"  # 1.2 < 1.3
    assert (tmp_path / "goals" / "goals.md").read_text().count("| missed |") == 3


def test_agent_routing_is_weighed_against_the_better_drafter_alone(tmp_path):
    rows = [{"config": k, "concurrency": c, "throughput_tok_s": v} for c, vals in
            ((1, {"dspark:dspark": 40.0, "suffix:dspark": 60.0, "auto:dspark": 75.0}),
             (16, {"dspark:dspark": 300.0, "suffix:dspark": 200.0, "auto:dspark": 330.0})) for k, v in vals.items()]
    write(tmp_path, "online/online-agent", {"rows": rows})
    got = [c for c in goals.run(tmp_path)["checks"] if c["source"] == "online/online-agent.json"]
    assert [(c["goal"].split(":")[0], c["value"], c["status"]) for c in got] == [
        ("agent workload, C = 1", 1.25, "met"), ("agent workload, C = 16", 1.1, "missed")]


def test_sampled_single_stream_reads_one_client_at_temperature_one(tmp_path):
    rows = online_rows(1.4)
    write(tmp_path, "online/c1-six-t1/online", {"settings": {"temperature": 1.0}, "rows": rows, "ratios": ratios(rows)})
    goal = "single stream, temperature 1: dspark:dspark / none"
    got = by_goal(goals.run(tmp_path))[goal]
    assert (got["status"], got["value"]) == ("met", 1.4)
    write(tmp_path, "online/c1-six-t1/online", {"settings": {"temperature": 0.0}, "rows": rows, "ratios": ratios(rows)})
    assert by_goal(goals.run(tmp_path))[goal]["status"] == "not measured"  # a greedy run is not this goal


def test_goals_say_which_machine_ran_each_source(tmp_path):
    old = {"cpu": "AMD EPYC", "cores": 2}
    new = {"cpu": "AMD EPYC", "cpu_id": "family 25, model 17", "isa": "avx512_bf16", "cores": 2}
    rows = online_rows(1.2)
    write(tmp_path, "online/online", {"rows": rows, "ratios": ratios(rows), "machine": old})
    write(tmp_path, "online/online-hostile", {"rows": rows, "ratios": ratios(rows), "machine": new})
    payload = goals.run(tmp_path)
    text = (tmp_path / "goals" / "goals.md").read_text()
    assert payload["machines"]["online/online"] == "AMD EPYC (2 cores)"
    assert "different machines: AMD EPYC (2 cores): `online/online.json`; " \
           "AMD EPYC (family 25, model 17; avx512_bf16; 2 cores): `online/online-hostile.json`" in text
    write(tmp_path, "online/online", {"rows": rows, "ratios": ratios(rows), "machine": new})
    goals.run(tmp_path)
    assert "Every source ran on AMD EPYC (family 25, model 17" in (tmp_path / "goals" / "goals.md").read_text()


def test_every_concurrency_is_judged_at_its_worst(tmp_path):
    """A loss to the best static configuration at a middle concurrency misses the bar, named there."""
    rows = [{"config": k, "concurrency": c, "throughput_tok_s": v, "per_user_tok_s_mean": v / c}
            for c, vals in ((1, {"none": 10.0, "mtp:static:1": 12.0, "dspark:dspark": 15.0}),
                            (16, {"none": 100.0, "mtp:static:1": 110.0, "dspark:dspark": 99.0}),
                            (64, {"none": 200.0, "mtp:static:1": 190.0, "dspark:dspark": 205.0}))
            for k, v in vals.items()]
    write(tmp_path, "online/online", {"rows": rows, "ratios": ratios(rows)})
    got = by_goal(goals.run(tmp_path))
    static = got["every C: dspark:dspark aggregate / best static:k"]
    assert static["status"] == "missed" and static["value"] == 99.0 / 110.0 and "lowest at C = 16" in static["detail"]
    plain = got["every C: dspark:dspark aggregate / none"]
    assert plain["status"] == "missed" and plain["value"] == 0.99 and "lowest at C = 16" in plain["detail"]


def test_step_costs_are_ceilings_read_at_one_request(tmp_path):
    """The step anatomy's bars are costs: at most 0.15 plain steps for a γ = 7 proposal, 1.3 for a drafted step."""
    runs = {"dspark:static:7": {"proposal_over_plain": 0.16, "drafted_over_plain": 1.25},
            "dspark:dspark": {"proposal_over_plain": 0.14, "drafted_over_plain": 1.2}}
    write(tmp_path, "steps/steps", {"settings": {"concurrency": 1}, "results": runs})
    got = by_goal(goals.run(tmp_path))
    proposal = got["one request: a γ = 7 DSpark proposal / a plain step (dspark:static:7)"]
    drafted = got["one request: a γ = 7 DSpark drafted step / a plain step (dspark:static:7)"]
    assert (proposal["status"], proposal["value"], proposal["detail"]) == ("missed", 0.16, "dspark:dspark: 0.140")
    assert (drafted["status"], drafted["value"]) == ("met", 1.25)
    assert "| ≤ 0.15 | 0.160 | missed |" in (tmp_path / "goals" / "goals.md").read_text()
    write(tmp_path, "steps/steps", {"settings": {"concurrency": 16}, "results": runs})
    assert {c["status"] for c in goals.run(tmp_path)["checks"] if c["source"] == "steps/steps.json"} == {"not measured"}
