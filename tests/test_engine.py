"""Plain-decoding engine: exact greedy output, batch invariance, preemption, bad input."""

from __future__ import annotations

import pytest
import torch

from dspark.config import EngineConfig
from dspark.engine.engine import LLMEngine
from dspark.engine.factory import assemble
from dspark.models.loader import load_model
from dspark.sampling import SamplingParams

PROMPTS = ["The quick brown fox", "def add(a, b):\n", "Natalia sold clips to 48", "Explain list"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_engine(path, **kw) -> LLMEngine:
    net, tok = load_model(path)
    defaults = dict(device="cpu", max_num_batched_tokens=64, block_size=4)
    defaults.update(kw)
    return assemble(net, tok, EngineConfig(**defaults))


def naive_greedy(net, ids: list[int], n: int) -> list[int]:
    """Full recompute of the whole sequence for every token: the reference."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            hidden, _ = net.forward_dense(torch.tensor([out]))
            out.append(int(net.logits(hidden[:, -1], normed=True).argmax()))
    return out[len(ids):]


def generate(engine: LLMEngine, prompts, params):
    reqs = [engine.add_request(p, params) for p in prompts]
    return engine.run_until_done(reqs)


def test_greedy_equals_full_recompute(model_dir):
    engine = make_engine(model_dir, max_num_batched_tokens=8)  # forces chunked prefill
    outs = generate(engine, PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = engine.tokenizer.encode(prompt)
        assert out.token_ids == naive_greedy(engine.model, ids, GREEDY.max_tokens)
        assert out.finish_reason == "length"
    assert engine.kv.pool.num_used_blocks == 0


def test_batch_invariance(qwen3_dir):
    alone = [generate(make_engine(qwen3_dir), [p], GREEDY)[0].token_ids for p in PROMPTS]
    together = [o.token_ids for o in generate(make_engine(qwen3_dir), PROMPTS, GREEDY)]
    assert alone == together


def test_requests_join_between_steps(qwen3_dir):
    engine = make_engine(qwen3_dir)
    first = engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(5):
        engine.step()
    late = engine.add_request(PROMPTS[1], GREEDY)
    outs = engine.run_until_done([first, late])
    ref = [generate(make_engine(qwen3_dir), [p], GREEDY)[0].token_ids for p in PROMPTS[:2]]
    assert [o.token_ids for o in outs] == ref


def test_preemption_completes_every_request(qwen3_dir):
    ref = [o.token_ids for o in generate(make_engine(qwen3_dir), PROMPTS, GREEDY)]
    small = make_engine(qwen3_dir, num_kv_blocks=12)  # 48 slots: not enough for 4 requests
    outs = generate(small, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.stats["preemptions"] for o in outs) > 0
    assert small.kv.pool.num_used_blocks == 0


def test_seeded_sampling_is_reproducible_and_batch_independent(qwen3_dir):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=7, ignore_eos=True)
    a = generate(make_engine(qwen3_dir), [PROMPTS[0]], params)[0].token_ids
    b = generate(make_engine(qwen3_dir), PROMPTS, params)[0].token_ids
    assert a == b


def test_stop_conditions(qwen3_dir):
    engine = make_engine(qwen3_dir)
    base = generate(engine, [PROMPTS[0]], GREEDY)[0]
    stop_tok = base.token_ids[5]
    out = generate(engine, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop_tok,)))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_tok
    assert len(out.token_ids) == base.token_ids.index(stop_tok) + 1
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        out = generate(engine, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop=(stop,), ignore_eos=True))[0]
        assert out.finish_reason == "stop" and stop not in out.text and text.startswith(out.text)


@pytest.mark.parametrize("bad", [
    dict(prompt=""),
    dict(prompt=[]),
    dict(prompt="x " * 400),
    dict(prompt=[10**6]),
    dict(params=dict(temperature=-1)),
    dict(params=dict(top_p=0)),
    dict(params=dict(top_k=-5)),
    dict(params=dict(max_tokens=0)),
])
def test_bad_input_is_refused_and_engine_keeps_serving(qwen3_dir, bad):
    engine = make_engine(qwen3_dir)
    good = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    with pytest.raises(ValueError):
        params = SamplingParams(**bad["params"]) if "params" in bad else GREEDY
        engine.add_request(bad.get("prompt", PROMPTS[1]), params)
    out = engine.run_until_done([good])[0]
    assert out.token_ids == generate(make_engine(qwen3_dir), [PROMPTS[0]], GREEDY)[0].token_ids


def test_abort_frees_blocks(qwen3_dir):
    engine = make_engine(qwen3_dir)
    req = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    engine.abort(req.request_id)
    assert engine.kv.pool.num_used_blocks == 0 and not engine.has_unfinished()


def test_engines_leave_the_global_rng_alone(qwen3_dir):
    """Building an engine (plain or speculative) and sampling unseeded requests reads only the
    engine's own generator: the caller's torch RNG state is untouched, and an engine's
    unseeded samples follow from its config's seed alone."""
    from dspark.engine.factory import build_engine

    loaded = load_model(qwen3_dir)
    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    cfg = EngineConfig(device="cpu", dtype="float32", seed=7)
    engines = [assemble(*loaded, cfg), build_engine(qwen3_dir, "ngram", "static:3", cfg, loaded=loaded)]
    assert torch.equal(torch.random.get_rng_state(), before)
    outs = [e.run_until_done([e.add_request(p, sampled) for p in PROMPTS]) for e in engines]
    assert torch.equal(torch.random.get_rng_state(), before)
    again = assemble(*loaded, cfg)
    torch.manual_seed(99)  # the caller's reseeding does not reach the engine's draws
    assert [o.token_ids for o in generate(again, PROMPTS, sampled)] == [o.token_ids for o in outs[0]]


def test_step_retires_every_finished_request(qwen3_dir):
    """Driven by `step()` alone (no run_until_done, no server), 1,000 short requests leave
    nothing behind: the request table is empty and every KV block is free."""
    engine = make_engine(qwen3_dir, num_kv_blocks=64, max_num_seqs=32, max_num_batched_tokens=256)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    reqs = [engine.add_request([5 + i % 7, 9, 11], short) for i in range(1000)]
    aborted = [engine.add_request([5, 9], short) for _ in range(3)]
    engine.step()
    for r in aborted:
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    assert all(r.finish_reason == "length" and len(r.output_ids) == 2 for r in reqs)
    assert all(r.finish_reason == "abort" for r in aborted)
    assert engine.requests == {} and engine.kv.pool.num_used_blocks == 0
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_a_step_tells_what_it_did(qwen3_dir):
    """`step()` returns a frozen StepOutput: the plan, the forward's size, who progressed or
    finished and their new tokens; a raising forward becomes StepFailed naming the step's requests."""
    import dataclasses

    from dspark.engine.output import StepFailed

    engine = make_engine(qwen3_dir)
    assert not engine.step().ran  # nothing queued: an empty plan
    reqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)) for p in PROMPTS[:2]]
    step = engine.step()
    assert step.scheduled_ids == [r.request_id for r in reqs] and step.num_forward_tokens == step.plan.num_tokens
    assert set(step.new_tokens) == {r.request_id for r in step.progressed}
    assert all(list(step.new_tokens[r.request_id]) == r.output_ids for r in step.progressed)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.num_forward_tokens = 0  # type: ignore[misc]
    while engine.has_unfinished():
        step = engine.step()
    assert set(step.finished) <= set(reqs) and all(r.is_finished for r in reqs)

    other = engine.add_request(PROMPTS[2], GREEDY)

    def broken(scheduled):
        raise RuntimeError("injected")

    engine.runner.step = broken  # type: ignore[method-assign]
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == [other.request_id] and "injected" in str(failed.value)


def test_default_dtype_follows_the_hardware_and_the_environment(monkeypatch):
    """bfloat16 on CUDA and on CPUs that multiply it natively, float32 on other CPUs;
    DSPARK_DTYPE overrides either."""
    import dspark.config as config

    monkeypatch.delenv("DSPARK_DTYPE", raising=False)
    monkeypatch.setattr(config, "native_bf16_cpu", lambda: False)
    assert config.default_dtype("cpu") == "float32" and config.default_dtype("cuda:0") == "bfloat16"
    monkeypatch.setattr(config, "native_bf16_cpu", lambda: True)
    assert config.default_dtype("cpu") == "bfloat16"
    monkeypatch.setenv("DSPARK_DTYPE", "float32")
    assert config.default_dtype("cpu") == "float32" and config.EngineConfig(device="cpu").dtype == "float32"
