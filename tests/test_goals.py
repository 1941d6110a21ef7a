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
    (tmp_path / f"{name}.json").write_text(json.dumps({"date": "today", **payload}))


def by_goal(payload: dict) -> dict[str, dict]:
    return {c["goal"]: c for c in payload["checks"]}


def test_goals_read_the_right_rows(tmp_path):
    offline = [{"drafter": d, "temperature": 1.0, "domain": dom, "tau": tau}
               for d, tau in (("dspark", 2.6), ("eagle3", 2.0), ("dflash", 2.4)) for dom in ("math", "chat")]
    write(tmp_path, "offline", {"rows": offline})
    rows = online_rows(1.2)
    write(tmp_path, "online", {"rows": rows, "ratios": ratios(rows)})
    hostile = online_rows(0.96)
    write(tmp_path, "online-hostile", {"rows": hostile, "ratios": ratios(hostile)})
    got = by_goal(goals.run(tmp_path))
    assert got["offline τ (T = 1, γ = 7, domain macro): dspark / eagle3"]["status"] == "met"  # 1.3
    assert got["offline τ (T = 1, γ = 7, domain macro): dspark / dflash"]["status"] == "missed"  # 1.083
    assert got["C = 8: dspark:dspark aggregate / best static:k"]["value"] == 1.2 / 0.6
    assert got["matched aggregate throughput: dspark:dspark per-user / mtp:static:1"]["status"] == "met"
    assert got["never a loss (online.json): dspark:dspark / none, every C"]["status"] == "met"
    hostile_check = got["never a loss (online-hostile.json): dspark:dspark / none, every C"]
    assert hostile_check["status"] == "missed" and abs(hostile_check["value"] - 0.96) < 1e-9
    assert all(c["status"] == "not measured" for t, c in got.items() if t.startswith("single stream"))
    assert (tmp_path / "goals.md").read_text().count("| missed |") == 2


def test_repeat_checks_are_read_from_their_subdirectories(tmp_path):
    rows = online_rows(0.98)
    runs = [{**r, "throughput_ratio_runs": [0.9, 1.06]} for r in ratios(rows)]
    (tmp_path / "mixed-c64").mkdir()
    write(tmp_path / "mixed-c64", "online", {"rows": rows, "ratios": runs})
    got = [c for c in goals.run(tmp_path)["checks"] if c["source"] == "mixed-c64/online.json"]
    assert [(c["status"], c["detail"]) for c in got] == [("met", "per run: 0.90, 1.06")] * 2
    assert got[0]["goal"].startswith("never a loss, 2-run check at C = 1 (mixed-c64)")


def test_lockstep_results_are_read_beside_the_rotation_ones(tmp_path):
    """`--lockstep` sweeps in lockstep/ give their own rows (sources named), never replacing the
    rotation sweep's; a lockstep repeat check says so in its goal."""
    rows = online_rows(1.2)
    write(tmp_path, "online", {"rows": rows, "ratios": ratios(rows)})
    (tmp_path / "lockstep").mkdir()
    slower = online_rows(0.99)
    write(tmp_path / "lockstep", "online", {"rows": slower, "ratios": ratios(slower), "settings": {"lockstep": True}})
    (tmp_path / "lockstep-hostile-8").mkdir()
    runs = [{**r, "throughput_ratio_runs": [0.99] * 8} for r in ratios(slower)]
    write(tmp_path / "lockstep-hostile-8", "online-hostile", {"rows": slower, "ratios": runs,
                                                               "settings": {"lockstep": True}})
    checks = goals.run(tmp_path)["checks"]
    at = {(c["goal"], c["source"]): c for c in checks}
    top = "C = 8: dspark:dspark aggregate / none"
    assert at[top, "online.json"]["status"] == "met" and at[top, "lockstep/online.json"]["status"] == "missed"
    assert at["never a loss (lockstep/online.json): dspark:dspark / none, every C", "lockstep/online.json"]["value"] == 0.99
    assert at["never a loss (lockstep/online-hostile.json): dspark:dspark / none, every C",
              "lockstep/online-hostile.json"]["status"] == "not measured"
    eight = [c for c in checks if c["source"] == "lockstep-hostile-8/online-hostile.json"]
    assert len(eight) == 2 and all("8-run lockstep check" in c["goal"] and c["status"] == "met" for c in eight)
