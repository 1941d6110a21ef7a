"""Benchmark harness (dspark/bench): each command runs on the tiny random model and writes
well-formed JSON / markdown / PNG; the statistics it reports are right on hand-made data.
Tiny settings only (a couple of prompts, 8 tokens); no speed is ever asserted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from dspark.bench import frontier, offline, online, peers
from dspark.bench.summary import conditional_acceptance, macro, mean_curves, speculation
from dspark.bench.workload import Spec, hostile, interleave, parse_configs, render, select, split_drafter

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def dspark_dir(qwen3_dir, tmp_path_factory) -> Path:
    """A randomly initialised DSpark drafter saved like a trained one."""
    from dspark.drafters.base import save_drafter
    from dspark.drafters.registry import new_config, new_drafter
    from dspark.models.loader import load_model

    net, tok = load_model(qwen3_dir)
    torch.manual_seed(0)
    cfg = new_config("dspark", net.config, tok.token_id("<|mask|>") or 0)
    out = tmp_path_factory.mktemp("drafters") / "dspark-random"
    save_drafter(new_drafter(cfg), cfg, out)
    return out


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG


def stamped(path: Path) -> dict:
    data = json.loads(path.read_text())
    assert {"date", "machine", "command", "model", "settings"} <= set(data)
    return data


# ---- statistics on hand-made data ------------------------------------------------------
def test_conditional_acceptance_per_position_from_hand_made_stats():
    stats = [
        {"accepted_per_position": [3, 1], "verified_per_position": [4, 3]},
        {"accepted_per_position": [1, 0, 0], "verified_per_position": [2, 1, 0]},
        {},  # plain decoding: no speculative counters
    ]
    assert conditional_acceptance(stats) == [4 / 6, 1 / 4, None]
    assert mean_curves([[0.5, 0.2], [0.7, None, 0.1]]) == pytest.approx([0.6, 0.2, 0.1])


def test_tau_and_budget_leave_the_prefill_round_out():
    # 1 prefill round + 3 decode rounds emitting 10 tokens; 2 + 1 rounds emitting 3 (plain).
    stats = [{"completion_tokens": 11, "rounds": 4, "verified_tokens": 15, "accepted_tokens": 7},
             {"completion_tokens": 4, "rounds": 4, "verified_tokens": 0, "accepted_tokens": 0}]
    s = speculation(stats)
    assert s["tau"] == pytest.approx((10 + 3) / (3 + 3))
    assert s["budget"] == pytest.approx(15 / 6)
    assert s["acceptance_rate"] == pytest.approx(7 / 15)
    assert speculation([{"completion_tokens": 5, "rounds": 5}])["tau"] == 1.0  # plain decoding
    rows = [{"domain": "math", "tau": 2.0}, {"domain": "math", "tau": 3.0}, {"domain": "chat", "tau": 1.5}]
    assert macro(rows, "tau") == {"math": 2.5, "chat": 1.5}


HAND = [  # (config, concurrency, per-user tok/s, aggregate tok/s)
    ("none", 1, 100.0, 100.0), ("none", 2, 80.0, 160.0), ("none", 4, 50.0, 200.0),
    ("dspark", 1, 200.0, 200.0), ("dspark", 2, 150.0, 300.0), ("dspark", 4, 90.0, 360.0),
]


def hand_rows() -> list[dict]:
    return [{"config": c, "concurrency": n, "per_user_tok_s_mean": s, "throughput_tok_s": t} for c, n, s, t in HAND]


def test_sla_and_matched_throughput_summary_on_a_hand_made_table():
    rows = hand_rows()
    ref = frontier.curve(rows, "none")
    # SLA 90: none's curve crosses 90 halfway between (100, 100) and (80, 160) -> 130
    assert frontier.throughput_at_sla(ref, 90.0) == pytest.approx(130.0)
    assert frontier.throughput_at_sla(frontier.curve(rows, "dspark"), 90.0) == pytest.approx(360.0)
    assert frontier.throughput_at_sla(ref, 120.0) is None  # none never serves 120 tok/s per user
    # matched 180 tok/s: none crosses between (160, 80) and (200, 50) -> 65; dspark: best is 200 at C=1
    assert frontier.speed_at_throughput(ref, 180.0) == pytest.approx(65.0)
    assert frontier.speed_at_throughput(frontier.curve(rows, "dspark"), 180.0) == pytest.approx(200.0)
    summary = frontier.summarize(rows, "none", slas=[90.0, 120.0], levels=[180.0])
    sla90, sla120 = summary["sla"]
    assert sla90["values"] == pytest.approx({"none": 130.0, "dspark": 360.0})
    assert sla90["ratio_vs_reference"]["dspark"] == pytest.approx(360.0 / 130.0)
    assert sla120["values"]["none"] is None and sla120["ratio_vs_reference"]["dspark"] is None
    assert summary["matched"][0]["ratio_vs_reference"]["dspark"] == pytest.approx(200.0 / 65.0)
    default = frontier.summarize(rows, "none")  # levels from the reference's own points
    assert [e["level"] for e in default["sla"]] == [50.0, 80.0, 100.0]
    assert [e["level"] for e in default["matched"]] == [100.0, 160.0, 200.0]
    by_c = frontier.ratios_by_concurrency(rows, "none")
    assert {(r["concurrency"], r["throughput_ratio"]) for r in by_c} == {(1, 2.0), (2, 1.875), (4, 1.8)}
    assert all(r["throughput_ratio_runs"] is None for r in by_c)  # single runs: no per-repeat ratios


def test_per_repeat_ratios_pair_runs_that_ran_together():
    rows = [{"config": "none", "concurrency": 1, "throughput_tok_s": 100.0, "per_user_tok_s_mean": 100.0,
             "throughput_runs": [120.0, 80.0]},
            {"config": "spec", "concurrency": 1, "throughput_tok_s": 90.0, "per_user_tok_s_mean": 90.0,
             "throughput_runs": [108.0, 72.0]}]
    (r,) = frontier.ratios_by_concurrency(rows, "none")
    assert r["throughput_ratio"] == pytest.approx(0.9)
    assert r["throughput_ratio_runs"] == pytest.approx([0.9, 0.9])  # the drift cancels within each pair
    assert frontier.paired([1.0, 2.0], [1.0]) is None


def test_configs_and_workloads(qwen3_dir):
    from dspark.models.tokenizer import TextTokenizer

    assert parse_configs("none; mtp:static:1;dspark:dspark-async") == [
        Spec(None, "none"), Spec("mtp", "static:1"), Spec("dspark", "dspark-async")]
    assert Spec("/x/y/my-drafter", "threshold:0.5").label == "my-drafter:threshold:0.5"
    again = parse_configs("none;dspark:dspark;none;dspark:dspark;none")  # A/A yardsticks: identical engines
    assert [sp.label for sp in again] == ["none", "dspark:dspark", "none#2", "dspark:dspark#2", "none#3"]
    with pytest.raises(ValueError):
        parse_configs("dspark")
    with pytest.raises(ValueError, match="share the label 'dspark:static:7'"):  # results are keyed by label
        parse_configs("dspark:static:7;/runs/stage13/dspark:static:7")
    assert [sp.label for sp in parse_configs("dspark:static:7;/runs/st13:static:7")] == ["dspark:static:7", "st13:static:7"]
    gates = parse_configs("dspark:dspark;dspark:dspark?select=0;dspark:dspark?select=0")  # gate settings side by side
    assert [sp.label for sp in gates] == ["dspark:dspark", "dspark:dspark?select=0", "dspark:dspark?select=0#2"]
    assert gates[1].policy == "dspark" and gates[1].options == "select=0"
    for bad in ("dspark:dspark?selekt=0", "dspark:dspark?select=2", "dspark:dspark?probe_every=x"):
        with pytest.raises(ValueError, match="gate option"):
            parse_configs(bad)
    vocab = parse_configs("dspark@2048:dspark")[0]  # a draft vocabulary of the 2,048 most frequent tokens
    assert vocab.label == "dspark@2048:dspark" and split_drafter(vocab.drafter) == ("dspark", 2048)
    assert split_drafter("/runs/a@b") == ("/runs/a@b", None) and split_drafter("eagle3") == ("eagle3", None)
    assert split_drafter("dspark@0") == ("dspark", 0)  # every token, whatever the drafter ships with
    tok = TextTokenizer.from_dir(qwen3_dir)
    jobs = interleave(render(tok, select(["gsm8k", "humaneval", "mt-bench"], None, 2), 64))
    assert [j.domain for j in jobs] == ["math", "code", "chat"] * 2
    assert all(0 < len(j.ids) <= 64 for j in jobs)
    bad = {tok.token_id("<|im_end|>"), tok.token_id("<|im_start|>")}
    rnd = hostile(tok, 3, 20)
    assert len(rnd) == 3 and all(len(j.ids) == 20 and not bad & set(j.ids) for j in rnd)


# ---- the commands, end to end on the tiny model ---------------------------------------
def test_offline_writes_table_curves_and_sweep(qwen3_dir, dspark_dir, tmp_path):
    s = offline.OfflineSettings(model=str(qwen3_dir), drafters=(str(dspark_dir), "ngram", "eagle3"),
                                datasets=("gsm8k", "mt-bench"), num_prompts=1, max_tokens=8,
                                temperatures=(0.0, 1.0), thresholds=(0.0, 0.5), device="cpu")
    offline.run(s, tmp_path)
    data = stamped(tmp_path / "offline.json")
    assert data["skipped_drafters"] == ["eagle3"]  # no shipped checkpoint next to the fixture
    rows = data["rows"]
    assert {(r["drafter"], r["dataset"], r["temperature"]) for r in rows} == {
        (d, ds, t) for d in ("dspark-random", "ngram") for ds in ("gsm8k", "mt-bench") for t in (0.0, 1.0)}
    for r in rows:
        assert {"drafter", "kind", "dataset", "domain", "tau", "num_prompts", "temperature",
                "conditional_acceptance", "policy"} <= set(r)
        assert r["num_prompts"] == 1 and r["tau"] >= 1.0 and r["policy"] == "static:7"
        assert len(r["conditional_acceptance"]) <= 7
        assert all(c is None or 0.0 <= c <= 1.0 for c in r["conditional_acceptance"])
    sweep = data["threshold_sweep"]
    assert {r["threshold"] for r in sweep} == {0.0, 0.5} and {r["drafter"] for r in sweep} == {"dspark-random"}
    md = (tmp_path / "offline.md").read_text()
    assert "_Command:_" in md and "| dspark-random |" in md and "dspark-random / ngram" in md
    assert "math" in md and "chat" in md and "Threshold sweep" in md
    assert is_png(tmp_path / "acceptance.png") and is_png(tmp_path / "threshold-dspark-random.png")


def test_offline_reads_a_prompts_file(qwen3_dir, tmp_path):
    lines = [{"prompt": "Add 2 and 3.", "domain": "math"}, {"turns": ["Say hi.", "Again."]}]
    (tmp_path / "mine.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    s = offline.OfflineSettings(model=str(qwen3_dir), drafters=("none", "ngram"),
                                prompts_file=str(tmp_path / "mine.jsonl"), num_prompts=2, max_tokens=8, device="cpu")
    data = offline.run(s, tmp_path / "out")
    assert {(r["drafter"], r["dataset"], r["domain"], r["num_prompts"]) for r in data["rows"]} == {
        (d, ds, dom, 1) for d in ("none", "ngram") for ds, dom in (("mine:math", "math"), ("mine:custom", "custom"))}
    assert all(r["tau"] == 1.0 and r["tokens_per_s"] > 0 for r in data["rows"] if r["drafter"] == "none")
    assert "Single-stream decoding speed" in (tmp_path / "out" / "offline.md").read_text()
    assert data["threshold_sweep"] == [] and "mine:math" in (tmp_path / "out" / "offline.md").read_text()


@pytest.mark.parametrize("workload, lockstep", [("mixed", False), ("hostile", False), ("mixed", True)])
def test_online_in_process(qwen3_dir, dspark_dir, tmp_path, workload, lockstep):
    configs = f"none;ngram:static:7;{dspark_dir}:dspark;mtp:static:1" + (";none" if lockstep else "")
    s = online.OnlineSettings(model=str(qwen3_dir), configs=configs, concurrency=(1, 2), requests_per_client=1,
                              workload=workload, datasets=("gsm8k", "mt-bench"), num_prompts=2,
                              hostile_prompt_tokens=24, max_tokens=8, ignore_eos=True, profile="off", device="cpu",
                              lockstep=lockstep)
    online.run(s, tmp_path)
    suffix = "" if workload == "mixed" else "-hostile"
    data = stamped(tmp_path / f"online{suffix}.json")
    assert data["reference"] == "none" and data["skipped_configs"] == ["mtp:static:1"]
    rows = data["rows"]
    labels = ("none", "ngram:static:7", "dspark-random:dspark") + (("none#2",) if lockstep else ())
    assert [(r["config"], r["concurrency"]) for r in rows] == [(c, n) for c in labels for n in (1, 2)]
    for r in rows:
        assert r["requests"] == r["concurrency"] and r["completion_tokens"] == 8 * r["concurrency"]
        for key in ("throughput_tok_s", "per_user_tok_s_mean", "per_user_tok_s_p50", "ttft_mean_s", "ttft_p50_s",
                    "budget", "peak_rss_mib", "peak_kv_blocks", "peak_drafter_cache_mib"):
            assert r[key] is not None and r[key] >= 0, key
        assert r["budget"] <= 7
    assert all(r["budget"] == 0 and r["peak_drafter_cache_mib"] == 0 for r in rows if r["config"] == "none")
    assert any(r["peak_drafter_cache_mib"] > 0 for r in rows if r["config"].startswith("dspark-random"))
    assert {r["config"] for r in data["ratios"]} == {"ngram:static:7", "dspark-random:dspark"} | set(labels[3:])
    assert data["frontier"]["reference"] == "none" and len(data["frontier"]["sla"]) >= 1
    md = (tmp_path / f"online{suffix}.md").read_text()
    assert "Ratios vs `none`" in md and "SLA" in md and "matched" in md and workload in md
    assert ("**lockstep**" in md) == lockstep  # the load line (the command line may say lockstep too) and data["settings"]["lockstep"] == lockstep
    assert is_png(tmp_path / f"frontier{suffix}.png") and is_png(tmp_path / f"budget{suffix}.png")


def test_online_samples_with_nucleus_sampling_when_asked(qwen3_dir, tmp_path):
    s = online.OnlineSettings(model=str(qwen3_dir), configs="none;ngram:static:7", concurrency=(1,), requests_per_client=1,
                              datasets=("gsm8k",), num_prompts=1, max_tokens=8, ignore_eos=True, profile="off",
                              device="cpu", temperature=1.0, top_p=0.5)
    online.run(s, tmp_path)
    data = stamped(tmp_path / "online.json")
    assert data["settings"]["top_p"] == 0.5 and all(r["completion_tokens"] == 8 for r in data["rows"])
    assert "temperature 1.0, top-p 0.5." in (tmp_path / "online.md").read_text()


def test_online_trace_keeps_every_step_of_every_configuration(qwen3_dir, dspark_dir, tmp_path):
    import json

    from dspark.bench import steptrace

    s = online.OnlineSettings(model=str(qwen3_dir), configs=f"none;{dspark_dir}:dspark", concurrency=(1, 2),
                              requests_per_client=2, datasets=("gsm8k",), num_prompts=2, max_tokens=8,
                              ignore_eos=True, profile="off", device="cpu", lockstep=True, trace=True)
    online.run(s, tmp_path)
    rows = stamped(tmp_path / "online.json")["rows"]
    assert all("trace" not in r for r in rows)  # the steps go to their own file, not the report's rows
    steps = [json.loads(line) for line in (tmp_path / "online-steps.jsonl").read_text().splitlines()]
    for r in rows:
        mine = [t for t in steps if (t["config"], t["concurrency"]) == (r["config"], r["concurrency"])]
        assert len(mine) == r["steps"] and sum(t["emitted"] for t in mine) == r["completion_tokens"]
        assert all(t["seconds"] > 0 and t["requests"] >= 1 for t in mine)
    kinds = {(t["config"], steptrace.kind(t)) for t in steps}
    assert {k for c, k in kinds if c == "none"} <= {"plain", "prefill"}
    assert ("dspark-random:dspark", "drafted") in kinds  # profile off: no gate, every decode step drafts
    md = (tmp_path / "online.md").read_text()
    assert "Steps by load" in md and "| dspark-random:dspark | 2 | drafted |" in md
    with pytest.raises(ValueError, match="--trace"):
        online.run(online.OnlineSettings(url="http://127.0.0.1:9", trace=True), "/nonexistent")


def test_online_writes_each_finished_level_before_the_run_ends(qwen3_dir, tmp_path, monkeypatch):
    """A long run that is stopped keeps the levels it finished: after each level but the last the
    report is rewritten, marked incomplete; the final write is complete."""
    seen = []
    real = online.write

    def spy(s, path, rows, skipped, out, complete):
        seen.append((complete, sorted({r["concurrency"] for r in rows}), stamped_or_none(out)))
        return real(s, path, rows, skipped, out, complete)

    def stamped_or_none(out):
        f = tmp_path / "online.json"
        return json.loads(f.read_text())["complete"] if f.is_file() else None

    monkeypatch.setattr(online, "write", spy)
    s = online.OnlineSettings(model=str(qwen3_dir), configs="none", concurrency=(1, 2, 3), requests_per_client=1,
                              datasets=("gsm8k",), num_prompts=2, max_tokens=4, ignore_eos=True, profile="off",
                              device="cpu")
    online.run(s, tmp_path)
    assert [(c, levels) for c, levels, _ in seen] == [(False, [1]), (False, [1, 2]), (True, [1, 2, 3])]
    assert [prev for _, _, prev in seen] == [None, False, False]  # each write found the previous partial one
    assert stamped(tmp_path / "online.json")["complete"] is True
    assert "Partial" not in (tmp_path / "online.md").read_text()


def test_online_over_http_against_dspark_serve(qwen3_dir, tmp_path):
    pytest.importorskip("httpx")
    app_mod = pytest.importorskip("dspark.server.app")
    from dspark.config import EngineConfig
    from dspark.engine.factory import build_engine
    from dspark.server.launch import ServerThread

    engine = build_engine(qwen3_dir, "ngram", "static:7", EngineConfig(device="cpu"))
    settings = app_mod.ServeSettings(model_name="tiny", drafter="ngram", policy="static:7")
    with ServerThread(app_mod.create_app(engine, settings)) as srv:
        s = online.OnlineSettings(model=str(qwen3_dir), url=srv.url, concurrency=(1, 2), requests_per_client=1,
                                  datasets=("gsm8k",), num_prompts=2, max_tokens=8, ignore_eos=True)
        data = online.run(s, tmp_path)
    rows = data["rows"]
    assert [(r["config"], r["concurrency"]) for r in rows] == [("ngram:static:7", 1), ("ngram:static:7", 2)]
    assert all(r["completion_tokens"] == 8 * r["concurrency"] and r["ttft_mean_s"] > 0 for r in rows)
    assert all(r["tau"] >= 1.0 and r["budget"] is not None for r in rows)
    assert is_png(tmp_path / "frontier.png") and (tmp_path / "online.md").is_file()


def test_peers_falls_back_to_ngram_and_reports_ratios(qwen3_dir, tmp_path):
    s = peers.PeersSettings(model=str(qwen3_dir), datasets=("gsm8k",), num_prompts=1, max_tokens=8, profile="off",
                            device="cpu")
    peers.run(s, tmp_path)
    data = stamped(tmp_path / "peers.json")
    assert (data["drafter"], data["policy"]) == ("ngram", "dspark") and "ngram:dspark" in data["note"]
    names = [r["system"] for r in data["rows"]]
    assert names[:3] == ["transformers generate", "transformers prompt lookup (7)", "dspark none"]
    assert names[3].startswith("dspark ngram:static:") and names[4] == "dspark ngram:dspark"
    for r in data["rows"]:
        assert r["tokens"] == 8 and r["tok_s"] > 0 and r["vs_transformers"] > 0 and 0 <= r["greedy_match_fraction"] <= 1
        if r["system"].startswith("dspark"):
            assert r["greedy_match_none_fraction"] == 1.0  # speculative greedy = plain greedy
            assert r["tau"] == 1.0 if r["system"] == "dspark none" else 1.0 <= r["tau"] <= 8.0
        else:
            assert r["tau"] is None  # transformers does not report its steps
    assert [(r["system"], r["domain"]) for r in data["domain_rows"]] == [(n, "math") for n in names]
    assert next(r for r in data["domain_rows"] if r["system"] == "dspark none")["vs_dspark_none"] == 1.0
    assert "Note:" in (tmp_path / "peers.md").read_text()


def test_cli_wires_the_subcommands(qwen3_dir, tmp_path):
    from dspark.bench.commands import add_parser

    p = argparse.ArgumentParser()
    add_parser(p)
    args = p.parse_args(["offline", "--model", str(qwen3_dir), "--drafters", "ngram", "--datasets", "mbpp",
                         "--num-prompts", "1", "--max-tokens", "4", "--temperature", "0,1", "--device", "cpu",
                         "--out", str(tmp_path)])
    assert args.func(args) == 0
    data = json.loads((tmp_path / "offline.json").read_text())
    assert data["settings"]["temperatures"] == [0.0, 1.0] and {r["dataset"] for r in data["rows"]} == {"mbpp"}
    on = p.parse_args(["online", "--quick", "--concurrency", "1,8", "--configs", "none;dspark:dspark",
                       "--workload", "hostile", "--sla", "50,80"])
    assert on.concurrency == [1, 8] and on.sla == [50.0, 80.0] and on.workload == "hostile"
    assert p.parse_args(["peers", "--quick"]).func.__name__ == "run_peers"


def test_closed_loop_keeps_clients_busy_and_cleans_up(qwen3_dir):
    from dspark.bench.loop import closed_loop
    from dspark.bench.workload import engine_config
    from dspark.engine.factory import build_engine
    from dspark.models.tokenizer import TextTokenizer
    from dspark.sampling import SamplingParams

    engine = build_engine(qwen3_dir, "ngram", "static:7", engine_config(qwen3_dir, 3, 64, "cpu"))
    jobs = hostile(TextTokenizer.from_dir(qwen3_dir), 2, 12)
    params = lambda i: SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)  # noqa: E731
    res = closed_loop(engine, jobs, 3, params, per_client=2)
    assert sorted(o["client"] for o in res.outputs) == [0, 0, 1, 1, 2, 2]
    assert 0 < res.peak_kv_blocks and res.peak_rss_bytes > 0 and res.steps > 0
    timed = closed_loop(engine, jobs, 2, params, duration_s=0.05)
    assert len(timed.outputs) >= 2 and all(o["completion_tokens"] == 6 for o in timed.outputs)
    assert engine.kv.pool.num_used_blocks == 0 and not engine.requests and not engine.has_unfinished()
    with pytest.raises(ValueError):
        closed_loop(engine, jobs, 1, params)


class SteppedTime:
    """A time source the test advances by hand: clock verdicts that no machine speed can move."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_virtual_clock_runs_only_while_started():
    from dspark.bench.loop import VirtualClock

    source = SteppedTime()
    clock = VirtualClock(source)
    source.now += 5.0
    assert clock() == 0.0
    clock.run()
    source.now += 2.0
    assert clock() == 2.0
    clock.stop()
    source.now += 7.0
    assert clock() == 2.0
    clock.run()
    source.now += 0.5
    clock.stop()
    assert clock() == 2.5 and clock.elapsed == 2.5


NAP = 1e6  # the slow engine's simulated extra seconds per step: beyond any real run's length


def test_lockstep_loops_each_time_only_their_own_steps(qwen3_dir):
    """Two engines stepped in turn: each serves its load exactly as it would alone (same greedy
    tokens), and each loop's clock -- and every request timestamp the engine took from it --
    counts only that engine's work: with a shared time source that jumps NAP seconds during each
    of the slow engine's steps, the fast loop's clock holds none of those jumps (it is bounded by
    the real length of the run), while a shared wall clock would charge it every one."""
    import time

    from dspark.bench.loop import ClosedLoop, VirtualClock, closed_loop, run_loops
    from dspark.bench.workload import engine_config
    from dspark.engine.factory import build_engine
    from dspark.models.tokenizer import TextTokenizer
    from dspark.sampling import SamplingParams

    cfg = engine_config(qwen3_dir, 2, 64, "cpu")
    fast, slow = build_engine(qwen3_dir, None, "none", cfg), build_engine(qwen3_dir, "ngram", "static:3", cfg)
    real_step, skipped = slow.step, [0.0]

    def sleepy_step():
        skipped[0] += NAP  # as if the step had slept NAP seconds
        return real_step()

    slow.step = sleepy_step
    jobs = hostile(TextTokenizer.from_dir(qwen3_dir), 3, 12)
    params = lambda i: SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)  # noqa: E731
    alone = closed_loop(fast, jobs, 2, params, per_client=2)
    loops = [ClosedLoop(fast, jobs, 2, params, per_client=2), ClosedLoop(slow, jobs, 2, params, per_client=2)]
    for loop in loops:
        loop.clock = VirtualClock(lambda: time.perf_counter() + skipped[0])
    start = time.perf_counter()
    a, b = run_loops(loops)
    real = time.perf_counter() - start
    assert len(a.outputs) == len(b.outputs) == 4 and a.steps == alone.steps
    assert b.wall_s >= NAP * b.steps and a.wall_s <= real
    assert all(o["latency_s"] <= a.wall_s + 1e-9 for o in a.outputs)
    assert fast.clock is time.perf_counter and slow.clock is time.perf_counter  # restored after the run
    with pytest.raises(ValueError, match="engine each"):
        run_loops([ClosedLoop(fast, jobs, 1, params, per_client=1), ClosedLoop(fast, jobs, 1, params, per_client=1)])


def test_lockstep_rounds_vary_who_steps_after_whom(qwen3_dir):
    """In a fixed cycle an engine always follows the same other engine (and inherits the caches
    it left); each round's order is shuffled, so every engine follows each of the others."""
    from dspark.bench.loop import ClosedLoop, run_loops
    from dspark.bench.workload import engine_config
    from dspark.engine.factory import build_engine
    from dspark.models.loader import load_model
    from dspark.models.tokenizer import TextTokenizer
    from dspark.sampling import SamplingParams

    cfg = engine_config(qwen3_dir, 1, 64, "cpu")
    loaded = load_model(qwen3_dir, "cpu", cfg.dtype)
    engines = [build_engine(qwen3_dir, None, "none", cfg, loaded=loaded) for _ in range(3)]
    trace: list[int] = []
    for i, e in enumerate(engines):
        real = e.step
        e.step = lambda i=i, real=real: trace.append(i) or real()
    jobs = hostile(TextTokenizer.from_dir(qwen3_dir), 2, 12)
    params = lambda i: SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)  # noqa: E731
    run_loops([ClosedLoop(e, jobs, 1, params, per_client=1) for e in engines])
    rounds = [trace[i : i + 3] for i in range(0, len(trace), 3)]
    assert all(sorted(r) == [0, 1, 2] for r in rounds) and len(rounds) >= 12
    after = {i: {r[r.index(i) - 1] for r in rounds if r.index(i) > 0} for i in range(3)}
    assert all(after[i] == {0, 1, 2} - {i} for i in range(3))


def test_engines_share_one_loaded_target(qwen3_dir):
    """Side-by-side engines on one copy of the target's weights decode exactly as an engine with
    its own copy; a copy loaded for another dtype is refused."""
    from dspark.config import EngineConfig
    from dspark.engine.factory import build_engine
    from dspark.models.loader import load_model
    from dspark.sampling import SamplingParams

    cfg = EngineConfig(device="cpu", dtype="float32")
    loaded = load_model(qwen3_dir, "cpu", "float32")
    shared = [build_engine(qwen3_dir, d, p, cfg, loaded=loaded) for d, p in ((None, "none"), ("ngram", "static:3"))]
    assert shared[0].model is shared[1].model is loaded[0]
    own = build_engine(qwen3_dir, None, "none", cfg)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = [e.run_until_done([e.add_request([5, 6, 7, 5, 6, 7], params)])[0].token_ids for e in (*shared, own)]
    assert outs[0] == outs[1] == outs[2]
    with pytest.raises(ValueError, match="dtype|float"):
        build_engine(qwen3_dir, None, "none", EngineConfig(device="cpu", dtype="bfloat16"), loaded=loaded)


def test_lockstep_refuses_servers():
    s = online.OnlineSettings(url="http://127.0.0.1:9", lockstep=True)
    with pytest.raises(ValueError, match="lockstep"):
        online.run(s, "/nonexistent")


def test_repeated_runs_merge_into_one_row():
    from dspark.bench.online import merge_runs

    runs = [{"config": "none", "concurrency": 4, "throughput_tok_s": 100.0, "completion_tokens": 500, "steps": 120,
             "peak_kv_blocks": 10, "ttft_mean_s": 0.02, "acceptance_rate": None},
            {"config": "none", "concurrency": 4, "throughput_tok_s": 120.0, "completion_tokens": 600, "steps": 130,
             "peak_kv_blocks": 12, "ttft_mean_s": 0.04, "acceptance_rate": None}]
    row = merge_runs(runs)
    assert row["throughput_tok_s"] == 110.0 and row["throughput_runs"] == [100.0, 120.0] and row["repeats"] == 2
    assert row["completion_tokens"] == 1100 and row["steps"] == 250 and row["peak_kv_blocks"] == 12
    assert abs(row["ttft_mean_s"] - 0.03) < 1e-12 and row["acceptance_rate"] is None and row["config"] == "none"
    assert merge_runs(runs[:1])["throughput_runs"] == [100.0]


def test_offline_sweeps_only_the_drafters_named(qwen3_dir, dspark_dir, tmp_path):
    s = offline.OfflineSettings(model=str(qwen3_dir), drafters=(str(dspark_dir),), datasets=("gsm8k",),
                                num_prompts=1, max_tokens=4, thresholds=(0.5,), device="cpu", sweep=())
    data = offline.run(s, tmp_path)
    assert data["threshold_sweep"] == [] and {r["drafter"] for r in data["rows"]} == {"dspark-random"}


def test_a_configuration_sets_engine_options_beside_gate_options():
    from dspark.bench.workload import parse_configs, split_options

    assert split_options("select=1,pad_rows=0") == ("select=1", {"pad_rows": 0})
    spec = parse_configs("dspark:dspark;dspark:dspark?pad_rows=0")[1]
    assert spec.label == "dspark:dspark?pad_rows=0" and split_options(spec.options) == ("", {"pad_rows": 0})
    with pytest.raises(ValueError, match="pad_rows=N"):
        parse_configs("dspark:dspark?pad_rows=-1")
    with pytest.raises(ValueError, match="gate option"):
        parse_configs("dspark:dspark?padrows=1")


def test_peers_systems_stop_alike_at_the_end_token(qwen3_dir):
    """With stop_at_eos the engine and transformers end at the model's end token, at the same position (a token of
    the plain greedy answer is made the end token here, as a random model emits no real one)."""
    import transformers

    from dspark.config import EngineConfig
    from dspark.engine.factory import build_engine

    engine = build_engine(str(qwen3_dir), None, "none", EngineConfig(device="cpu", dtype="float32"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    prompt = [5, 17, 42, 9, 33]
    full = peers.EngineSystem(engine, 12)(prompt)
    assert len(full) == 12 and peers.hf_system(hf, 12, 0)(prompt) == full  # EOS ignored: exactly 12 each
    end = full[5]
    engine.tokenizer.eos_token_ids = (end,)
    stopped = peers.EngineSystem(engine, 12, stop_at_eos=True)(prompt)
    assert stopped == full[: full.index(end) + 1]  # the end token emitted, nothing after it
    assert peers.hf_system(hf, 12, 0, eos=[end])(prompt) == stopped
    assert "up to 12 new tokens" in peers.length(peers.PeersSettings(max_tokens=12, stop_at_eos=True))
