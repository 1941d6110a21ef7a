"""Every drafter x every policy on a fresh machine: an EMPTY step-profile cache directory.

The cost-weighing policies (dspark, dspark-async) measure the profile at engine start when
it is not cached; the measurement drafts for throw-away requests, so every drafter must
hold what `propose` reads for them (EAGLE-3/MTP once raised KeyError '__profile0' here).
Covers `LLM`/`build_engine`, `dspark serve`'s app startup and `dspark profile`; each run
points `DSPARK_PROFILE_DIR` at its own empty temporary directory.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from dspark.cli import build_parser, main
from dspark.config import EngineConfig
from dspark.drafters.base import save_drafter
from dspark.drafters.registry import new_config, new_drafter
from dspark.engine.factory import build_engine
from dspark.engine.profiler import CACHE_ENV
from dspark.models.loader import load_model
from dspark.sampling import SamplingParams
from dspark.spec.profile import StepProfile

KINDS = ["dspark", "dflash", "eagle3", "mtp", "dspark-exit", "pair", "ngram"]  # pair: a causal block + MTP
EXIT = {"causal_block": True, "exit_mlp": 16}  # dspark-exit: a causal block with an early exit
POLICIES = ["none", "static:1", "static:3", "threshold:0.3", "dspark", "dspark-async"]
PROMPTS = ["def add(a, b):", "The quick brown fox"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SMALL = ["--device", "cpu", "--max-num-seqs", "2", "--max-num-batched-tokens", "24"]


@pytest.fixture(scope="module")
def drafters(qwen3_dir, tmp_path_factory) -> dict[str, str]:
    """kind -> what `--drafter` takes: `ngram`, or a directory of an untrained drafter."""
    net, tok = load_model(qwen3_dir)
    out = {"ngram": "ngram"}
    for kind in KINDS[:-1]:
        if kind == "pair":
            continue
        torch.manual_seed(0)
        extra = EXIT if kind == "dspark-exit" else {}
        config = new_config(kind.split("-")[0], net.config, tok.token_id("<|mask|>") or 0, **extra)
        path = tmp_path_factory.mktemp(kind)
        save_drafter(new_drafter(config), config, path)  # type: ignore[arg-type]
        out[kind] = str(path)
    config = new_config("dspark", net.config, tok.token_id("<|mask|>") or 0, causal_block=True)
    causal = tmp_path_factory.mktemp("causal")
    save_drafter(new_drafter(config), config, causal)  # type: ignore[arg-type]
    out["pair"] = f"{causal}+{out['mtp']}"
    return out


@pytest.fixture(scope="module")
def reference(qwen3_dir) -> list[list[int]]:
    engine = build_engine(str(qwen3_dir), None, "none", EngineConfig(device="cpu"))
    return [o.token_ids for o in engine.run_until_done([engine.add_request(p, GREEDY) for p in PROMPTS])]


def fresh_dir(tmp_path, monkeypatch, name: str):
    path = tmp_path / name.replace(":", "-")
    monkeypatch.setenv(CACHE_ENV, str(path))
    assert not path.exists()
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_every_policy_builds_and_generates_without_a_cached_profile(qwen3_dir, drafters, reference, kind,
                                                                     tmp_path, monkeypatch):
    cfg = EngineConfig(device="cpu", max_num_seqs=2, max_num_batched_tokens=24)
    for policy in POLICIES:
        cache = fresh_dir(tmp_path, monkeypatch, f"{kind}-{policy}")
        engine = build_engine(str(qwen3_dir), drafters[kind], policy, cfg)
        outs = engine.run_until_done([engine.add_request(p, GREEDY) for p in PROMPTS])
        assert [o.token_ids for o in outs] == reference, (kind, policy)
        measured = sorted(cache.glob("*.json")) if cache.exists() else []
        assert len(measured) == (1 if engine.policy.needs_cost else 0), (kind, policy)
        assert engine.kv.pool.num_used_blocks == 0
        if engine.drafter is not None and policy != "none":
            assert engine.drafter.cache_bytes_in_use() == 0  # the profile's throw-away requests are freed


@pytest.mark.parametrize("kind", KINDS)
def test_profile_command_measures_into_an_empty_cache(qwen3_dir, drafters, kind, tmp_path, monkeypatch, capsys):
    cache = fresh_dir(tmp_path, monkeypatch, kind)
    assert main(["profile", "--model", str(qwen3_dir), "--drafter", drafters[kind], "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "draft  R=" in out
    assert len(list(cache.glob("*.json"))) == 1
    # an autoregressive drafter and a causal block cut exactly: a one-position proposal is timed too, and two
    # positions where one reads an early exit or the pair's one-position drafter
    prof = StepProfile.from_json(next(cache.glob("*.json")).read_text())
    assert bool(prof.shallow_s) == (kind in ("eagle3", "dspark-exit", "pair")) == ("one position" in out)
    assert bool(prof.pair_s) == (kind in ("dspark-exit", "pair")) == ("two:" in out)
    assert len(prof.shallow_s) in (0, len(prof.requests)) and len(prof.pair_s) in (0, len(prof.requests))
    # the default engine prices by tokens: its profile times no row shapes (they cost a fresh machine seconds)
    assert not prof.rows and "rows R=" not in out


def test_row_shaped_pricing_is_a_gate_option(qwen3_dir, drafters, tmp_path, monkeypatch, capsys):
    from dspark.engine.gate import GateConfig

    cache = fresh_dir(tmp_path, monkeypatch, "rows")
    cfg = EngineConfig(device="cpu", max_num_seqs=2, max_num_batched_tokens=24)
    by_tokens = build_engine(str(qwen3_dir), drafters["dspark"], "dspark", cfg)
    by_rows = build_engine(str(qwen3_dir), drafters["dspark"], "dspark", cfg, gate=GateConfig(rows=True))
    assert not by_tokens.runner.profile.rows and by_rows.runner.profile.rows
    assert by_rows.runner.gate.profile is by_rows.runner.profile  # the gate and the policy price alike
    assert len(list(cache.glob("*.json"))) == 2  # one cache entry each: the row shapes are measured only when used
    prof = by_rows.runner.profile  # every row count starts from its plain step, more tokens never cost less
    assert len(prof.row_extra) == len(prof.row_s) == len(prof.rows)
    for extra, secs in zip(prof.row_extra, prof.row_s, strict=True):
        assert extra[0] == 0 and extra == sorted(set(extra)) and len(secs) == len(extra)
    again = build_engine(str(qwen3_dir), drafters["dspark"], "dspark", cfg, gate=GateConfig(rows=True))
    assert again.runner.profile.row_s == prof.row_s  # read back from its own cache entry
    assert main(["profile", "--model", str(qwen3_dir), "--drafter", drafters["dspark"], "--device", "cpu",
                 "--gate", "rows=1"]) == 0  # the command prints them when asked for
    assert "rows R=" in capsys.readouterr().out


@pytest.mark.parametrize("kind", KINDS)
def test_serve_starts_and_answers_without_a_cached_profile(qwen3_dir, drafters, kind, tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from dspark.server.launch import ServerThread, build_app

    cache = fresh_dir(tmp_path, monkeypatch, kind)
    args = build_parser().parse_args(["serve", "--model", str(qwen3_dir), "--drafter", drafters[kind],
                                      "--policy", "dspark-async", *SMALL])
    with ServerThread(build_app(args)) as srv:
        body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        reply = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    assert len(list(cache.glob("*.json"))) == 1


def test_profile_points_take_turns_and_keep_their_least_time():
    """`least` warms every point up, then calls them in rounds (a burst of noise cannot inflate
    every repeat of one point), and keeps each point's least time, never the warm-up's."""
    from dspark.engine.profiler import least

    calls: list[str] = []
    script = {"a": [0.1, 5.0, 3.0, 4.0], "b": [0.1, 2.0, 6.0, 1.0]}  # warm-up first (fast: must not count)

    def point(name: str):
        def run() -> float:
            calls.append(name)
            return script[name][sum(c == name for c in calls) - 1]
        return run

    assert least([point("a"), point("b")], repeats=3) == [3.0, 1.0]
    assert calls == ["a", "b"] * 4


def test_a_refining_drafter_is_lossless_and_profiled_on_its_own(qwen3_dir, reference, tmp_path, monkeypatch):
    """A causal DSpark drafter that refines its greedy proposals (`DrafterConfig.refine`) emits plain decoding's
    tokens under every policy, and its profile is a cache entry of its own (its proposals cost more)."""
    net, tok = load_model(qwen3_dir)
    paths = {}
    for refine in (0, 2):
        torch.manual_seed(0)
        config = new_config("dspark", net.config, tok.token_id("<|mask|>") or 0, causal_block=True, refine=refine)
        paths[refine] = tmp_path / f"refine{refine}"
        save_drafter(new_drafter(config), config, paths[refine])  # type: ignore[arg-type]
    cfg = EngineConfig(device="cpu", max_num_seqs=2, max_num_batched_tokens=24)
    for policy in POLICIES:
        fresh_dir(tmp_path, monkeypatch, f"refine-{policy}")
        engine = build_engine(str(qwen3_dir), str(paths[2]), policy, cfg)
        outs = engine.run_until_done([engine.add_request(p, GREEDY) for p in PROMPTS])
        assert [o.token_ids for o in outs] == reference, policy
    cache = fresh_dir(tmp_path, monkeypatch, "refine-both")
    for refine in (0, 2):  # the same directory name, refining or not: two cache entries
        shutil.rmtree(tmp_path / "drafter", ignore_errors=True)
        shutil.copytree(paths[refine], tmp_path / "drafter")
        build_engine(str(qwen3_dir), str(tmp_path / "drafter"), "dspark", cfg)
    assert len(list(cache.glob("*.json"))) == 2


def test_one_position_is_timed_only_where_a_step_may_draft_it(qwen3_dir, tmp_path, monkeypatch):
    """A causal block cuts exactly: its profile times a one-position proposal beside the full one. The router over
    it and the copy drafter never drafts a cut block (a copy is whole), so its profile, which times the same neural
    drafter, leaves that out."""
    net, tok = load_model(qwen3_dir)
    torch.manual_seed(0)
    config = new_config("dspark", net.config, tok.token_id("<|mask|>") or 0, causal_block=True)
    path = tmp_path / "causal"
    save_drafter(new_drafter(config), config, path)  # type: ignore[arg-type]
    cfg = EngineConfig(device="cpu", max_num_seqs=2, max_num_batched_tokens=24)
    for name, timed in ((str(path), True), (f"{path}+suffix", False)):
        fresh_dir(tmp_path, monkeypatch, f"one-{timed}")
        runner = build_engine(str(qwen3_dir), name, "dspark", cfg).runner
        assert bool(runner.profile.shallow_s) == timed == runner.gate.picks_depth, name
