"""The agent workload of the benchmarks: traces from the standard library and GSM8K, later turns
that carry the model's turn and the next tool message, a context bound that ends traces early,
and per-task-kind reports from `dspark bench offline | online --workload agent` (tiny random
model with a long context; a couple of traces, 8 tokens a turn; no speed is asserted)."""

from __future__ import annotations

import json

import pytest

from dspark.bench import agent, offline, online
from dspark.bench.loop import closed_loop
from dspark.bench.workload import Job, follow
from dspark.sampling import SamplingParams
from tests.conftest import build_tiny


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("long"), "qwen3", max_position_embeddings=1200)


@pytest.fixture(scope="module")
def tok(long_dir):
    from dspark.models.tokenizer import TextTokenizer

    return TextTokenizer.from_dir(long_dir)


def test_sources_come_from_the_standard_library_and_gsm8k():
    src = agent.sources()
    assert len(src.functions) > 50 and len(src.math) > 10
    assert all(code.startswith(("def ", "@")) for _, code in src.functions[:20])


def test_traces_mix_kinds_and_carry_their_later_turns(tok):
    jobs = agent.jobs(tok, 4, 1100)
    assert len(jobs) == 4 and all(j.dataset == "agent" and len(j.ids) <= 1100 for j in jobs)
    kinds = {j.domain for j in jobs} | {k for j in jobs for k, _ in j.turns}
    assert "plan" in kinds and len(kinds) >= 4
    assert all(j.turns and j.turns[-1][0] == "plan" for j in jobs)
    ids = list(jobs[0].turns[0][1])  # closes the model's turn, then a tool message, then the assistant's cue
    start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert ids[0] == end and ids.count(start) == 2 and tok.decode(ids).startswith("\ntool\n")
    assert tok.decode(ids).endswith("assistant\n")


def test_follow_appends_the_turn_and_the_next_message_within_the_limit():
    job = Job([1, 2], "agent", "rename", (("json_edit", (7, 8)), ("plan", (9,))), limit=8)
    nxt = follow(job, [3, 4, 0], stop_ids={0})  # the stop token is dropped: the message closes the turn
    assert nxt == Job([1, 2, 3, 4, 7, 8], "agent", "json_edit", (("plan", (9,)),), 8)
    assert follow(nxt, [5, 6, 5], stop_ids={0}) is None  # 10 tokens: over the limit, the trace ends
    assert follow(Job([1], "agent", "plan"), [2], stop_ids=set()) is None  # the last turn


def test_a_closed_loop_sends_each_trace_turn_by_turn(long_dir, tok):
    from dspark.engine.factory import build_engine

    jobs = agent.jobs(tok, 2, 1100)
    engine = build_engine(long_dir, "suffix", "static:7", profile="off")
    res = closed_loop(engine, jobs, 2, lambda i: SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                      per_client=1)
    assert len(jobs) < len(res.outputs) <= len(jobs) + sum(len(j.turns) for j in jobs)  # later turns ran
    by_client = {}
    for o in res.outputs:
        by_client.setdefault(o["client"], []).append(o["prompt_tokens"])
    for prompts in by_client.values():
        assert prompts == sorted(prompts) and len(set(prompts)) == len(prompts)  # contexts grow turn by turn


def test_online_agent_report_has_a_row_per_task_kind(long_dir, tmp_path):
    s = online.OnlineSettings(model=str(long_dir), configs="ngram:dspark;suffix:dspark", concurrency=(2,),
                              requests_per_client=1, workload="agent", num_prompts=2, max_tokens=8, ignore_eos=True,
                              profile="off", device="cpu")
    online.run(s, tmp_path)
    data = json.loads((tmp_path / "online-agent.json").read_text())
    phases = data["phases"]
    assert {(p["config"], p["concurrency"]) for p in phases} == {(c, n) for c in ("ngram:dspark", "suffix:dspark")
                                                                 for n in (2,)}
    assert all(p["tau"] >= 1.0 and p["requests"] >= 1 for p in phases)
    assert all(set(p["draft_by"]) <= {"ngram", "suffix"} for p in phases)
    assert "phases" not in data["rows"][0]
    md = (tmp_path / "online-agent.md").read_text()
    assert "Per task kind" in md and "| rename |" in md


def test_offline_agent_report_names_the_drafter_per_kind(long_dir, tmp_path):
    s = offline.OfflineSettings(model=str(long_dir), drafters=("none", "suffix"), workload="agent", num_prompts=1,
                                max_tokens=8, device="cpu", thresholds=())
    data = offline.run(s, tmp_path)
    assert {r["dataset"].split(":")[0] for r in data["rows"]} == {"agent"}
    kinds = {p["kind"] for p in data["phases"] if p["drafter"] == "suffix"}
    assert len(kinds) >= 2
    md = (tmp_path / "offline-agent.md").read_text()
    assert "which drafter carried it" in md and "agent traces" in md
