"""The speculative engine end to end on tiny random models: greedy output is token-identical
to plain decoding for every drafter x policy, under batching, chunked prefill and
preemption; the engine never verifies more than gamma per request nor exceeds its budget."""

from __future__ import annotations

import pytest
import torch

from dspark.config import EngineConfig
from dspark.drafters.registry import new_config, new_drafter
from dspark.engine.factory import assemble
from dspark.models.loader import load_model
from dspark.sampling import SamplingParams

PROMPTS = [  # math, code and chat flavoured, 21 in all
    *(f"Natalia sold {n} clips to her friends in April." for n in range(7)),
    *(f"def add(a, b):\n    return a + b  # {n}" for n in range(7)),
    *(f"Explain list comprehensions {n}." for n in range(7)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
POLICIES = ["static:7", "static:2", "threshold:0.3", "dspark", "dspark-async"]


def engine_for(path, kind=None, policy="none", **kw):
    """A float32 engine unless kw names a dtype (the model is loaded in it, the drafter built in it)."""
    cfg = EngineConfig(**{"device": "cpu", "dtype": "float32", "block_size": 4, "max_num_batched_tokens": 96, **kw})
    net, tok = load_model(path, dtype=cfg.dtype)
    torch.manual_seed(0)  # the same random drafter weights every time
    drafter = new_drafter(new_config(kind, net.config, tok.token_id("<|mask|>") or 0)) if kind else None
    if isinstance(drafter, torch.nn.Module):
        drafter.to(dtype=cfg.torch_dtype)
    return assemble(net, tok, cfg, drafter=drafter, policy=policy)


def run(engine, prompts=PROMPTS, params=GREEDY):
    reqs = [engine.add_request(p, params) for p in prompts]
    return engine.run_until_done(reqs)


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    return [o.token_ids for o in run(engine_for(qwen3_dir))]


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3", "mtp", "ngram", "suffix"])
def test_greedy_identical_for_every_drafter_and_policy(qwen3_dir, reference, kind):
    for policy in POLICIES:
        engine = engine_for(qwen3_dir, kind, policy)
        outs = run(engine)
        assert [o.token_ids for o in outs] == reference, (kind, policy)
        assert engine.kv.pool.num_used_blocks == 0
        assert engine.drafter.cache_bytes_in_use() == 0


@pytest.mark.parametrize("kind", ["dspark", "eagle3", "suffix"])
def test_greedy_identical_in_bfloat16(qwen3_dir, kind):
    """bfloat16 (the default on CUDA and on CPUs with native bfloat16): a verify forward of
    1 + l rows must give each row what a plain one-row step gives, or greedy output drifts."""
    plain = [o.token_ids for o in run(engine_for(qwen3_dir, dtype="bfloat16"))]
    for policy in ("static:3", "dspark"):
        assert [o.token_ids for o in run(engine_for(qwen3_dir, kind, policy, dtype="bfloat16"))] == plain, policy


def test_ngram_accepts_on_repetitive_text_and_stays_exact(qwen3_dir, reference):
    engine = engine_for(qwen3_dir, "ngram", "static:7")
    outs = run(engine)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.stats["accepted_tokens"] for o in outs) > 0  # multi-token rounds happened
    assert max(o.stats["tau"] for o in outs) > 1.0


def test_preemption_and_rollback_mid_block(qwen3_dir, reference):
    engine = engine_for(qwen3_dir, "ngram", "static:7", num_kv_blocks=40, max_num_seqs=21)
    outs = run(engine)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.stats["preemptions"] for o in outs) > 0
    assert engine.kv.pool.num_used_blocks == 0


def test_batch_invariance_under_speculation(qwen3_dir, reference):
    alone = [run(engine_for(qwen3_dir, "dspark", "dspark"), [p])[0].token_ids for p in PROMPTS[::5]]
    assert alone == reference[::5]


def test_never_more_than_gamma_nor_over_budget(qwen3_dir):
    engine = engine_for(qwen3_dir, "ngram", "static:7", max_num_batched_tokens=40)
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    while engine.has_unfinished():
        plan_budget = engine.cfg.max_num_batched_tokens
        step = engine.step()
        assert step.num_forward_tokens <= plan_budget
        assert all(v <= engine.drafter.gamma for v in step.verified.values())
    assert all(r.is_finished for r in reqs)


def test_sampled_speculation_is_reproducible_with_a_seed(qwen3_dir):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=3, ignore_eos=True)
    a = run(engine_for(qwen3_dir, "dspark", "static:7"), PROMPTS[:3], params)
    b = run(engine_for(qwen3_dir, "dspark", "static:7"), PROMPTS[:3], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_mismatched_drafter_is_refused(qwen3_dir, llama_dir):
    net, _ = load_model(qwen3_dir)
    other, tok = load_model(llama_dir)
    bad = new_drafter(new_config("dspark", net.config.__class__(**{**net.config.__dict__, "vocab_size": 999})))
    with pytest.raises(ValueError, match="vocabulary"):
        assemble(other, tok, EngineConfig(device="cpu"), drafter=bad, policy="dspark")


def test_logprobs_under_speculation_match_plain(qwen3_dir):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    plain = run(engine_for(qwen3_dir), PROMPTS[:2], params)
    spec = run(engine_for(qwen3_dir, "ngram", "static:7"), PROMPTS[:2], params)
    for a, b in zip(plain, spec, strict=True):
        assert [x["token_id"] for x in a.logprobs] == [x["token_id"] for x in b.logprobs]
        assert all(abs(x["logprob"] - y["logprob"]) < 1e-4 for x, y in zip(a.logprobs, b.logprobs, strict=True))


def test_a_closed_gate_probes_a_few_requests_and_stays_exact(qwen3_dir, reference):
    """Drafting never pays under this profile, so every drafted step is a probe, and a probe
    drafts for one request of the batch; the output is still plain greedy decoding."""
    from dspark.engine.gate import GateConfig
    from dspark.spec.profile import StepProfile

    net, tok = load_model(qwen3_dir)
    drafter = new_drafter(new_config("ngram", net.config, tok.token_id("<|mask|>") or 0))
    cfg = EngineConfig(device="cpu", block_size=4, max_num_batched_tokens=96)
    engine = assemble(net, tok, cfg, drafter=drafter, policy="dspark",
                       gate=GateConfig(probe_every=1, probe_max=2, probe_requests=1))
    engine.runner.set_profile(StepProfile("never", tokens=[1, 96], verify_s=[1e-3, 1e-3], requests=[1, 64],
                                          draft_s=[10.0, 10.0]))
    sizes, slots = [], []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda lookahead=None: (slots.append(lookahead), schedule(lookahead))[1]
    propose = engine.runner._propose
    engine.runner._propose = lambda decode, depth: (sizes.append(len(decode)), propose(decode, depth))[1]
    outs = run(engine)
    assert [o.token_ids for o in outs] == reference
    assert sizes and max(sizes) == 1 and engine.runner.drafted_steps == len(sizes)
    assert engine.runner.drafted_steps < engine.runner.steps
    assert 0 in slots  # a closed gate withholds the draft slots between its probes


def test_an_open_gate_drafts_for_the_requests_it_picked_and_stays_exact(qwen3_dir, reference):
    """A proposal for one request is almost free, one for two costs seconds: the open gate drafts for one
    request per step, the rest decode plainly in the same forward; the output is plain greedy decoding."""
    from dspark.engine.gate import GateConfig
    from dspark.spec.profile import StepProfile

    net, tok = load_model(qwen3_dir)
    drafter = new_drafter(new_config("ngram", net.config, tok.token_id("<|mask|>") or 0))
    cfg = EngineConfig(device="cpu", block_size=4, max_num_batched_tokens=96)
    engine = assemble(net, tok, cfg, drafter=drafter, policy="dspark", gate=GateConfig(select=True, probe_requests=1))
    engine.runner.set_profile(StepProfile("one", tokens=[1, 96], verify_s=[1e-3, 1e-3], requests=[1, 2],
                                          draft_s=[1e-6, 10.0]))
    drafted = []
    propose = engine.runner._propose
    engine.runner._propose = lambda decode, depth: (drafted.append((len(decode), engine.runner.gate.probing)),
                                                    propose(decode, depth))[1]
    outs = run(engine)
    assert [o.token_ids for o in outs] == reference
    assert max(n for n, _ in drafted) == 1 and any(not probing for _, probing in drafted)


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_shifted_drafters_keep_one_feature_per_request_and_count_it(qwen3_dir, reference, kind):
    """EAGLE-3/MTP read only the last committed token's fused feature: what they keep beside
    the paged cache is one [d] row per request at every length, and the cache figures count it."""
    from dspark.drafters.neural import NeuralDrafter

    engine = engine_for(qwen3_dir, kind, "static:3")
    drafter = engine.drafter
    row = drafter.config.hidden_size * torch.tensor([], dtype=engine.model.dtype).element_size()
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
    seen = set()
    while engine.has_unfinished():
        engine.step()
        kept = drafter.cache_bytes_in_use() - NeuralDrafter.cache_bytes_in_use(drafter)
        drafted = sum(1 for r in reqs if drafter.pool.length(r.request_id) > 0)
        assert kept == row * drafted
        seen.add(drafted)
    assert max(seen) == 3
    assert [engine.output(r).token_ids for r in reqs] == reference[:3]
    assert drafter.cache_bytes_in_use() == 0


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_a_probe_after_a_closed_spell_drafts_from_the_whole_context(qwen3_dir, kind):
    """A closed gate hands the drafter nothing; a probe first catches up every token committed since. What
    it then proposes must be what a drafter given the whole context at once proposes (greedy: the same tokens)."""
    from dspark.drafters.base import ContextRow, ProposeInput
    from dspark.engine.gate import GateConfig
    from dspark.sampling import SamplingRows
    from dspark.spec.profile import StepProfile

    net, tok = load_model(qwen3_dir)
    mask = tok.token_id("<|mask|>") or 0
    torch.manual_seed(0)
    drafter = new_drafter(new_config(kind, net.config, mask))
    torch.manual_seed(0)
    fresh = new_drafter(new_config(kind, net.config, mask))
    fresh.bind(net, 64, 4)
    cfg = EngineConfig(device="cpu", block_size=4, max_num_batched_tokens=96)
    engine = assemble(net, tok, cfg, drafter=drafter, policy="dspark",
                      gate=GateConfig(probe_every=3, probe_max=3, probe_budget=0.0, explore_budget=0.0,
                                      probe_requests=1))
    engine.runner.set_profile(StepProfile("never", tokens=[1, 96], verify_s=[1e-3, 1e-3], requests=[1, 64],
                                          draft_s=[10.0, 10.0]))
    checked = []
    propose = engine.runner._propose

    def checking(decode, depth=None):
        block = propose(decode, depth)
        for i, s in enumerate(decode):
            r, n = s.request, s.request.num_computed
            ids = torch.tensor([r.all_ids[:n]])
            with torch.no_grad():
                _, taps = net.forward_dense(ids, fresh.taps)
            fresh.extend([ContextRow("ref", 0, r.all_ids[:n], taps[0])])
            ref = fresh.propose([ProposeInput("ref", r.all_ids[-1], n, r.all_ids)],
                                SamplingRows.same(1, SamplingParams(temperature=0.0)))
            fresh.free("ref")
            checked.append((block.tokens[i].tolist(), ref.tokens[0].tolist(), n))
        return block

    engine.runner._propose = checking
    run(engine, PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert engine.runner.drafted_steps < engine.runner.steps  # closed spells happened
    assert len(checked) >= 3 and all(got == want for got, want, _ in checked), checked


@pytest.mark.parametrize("kind, keeps", [("dspark", True), ("ngram", False)])
def test_the_gate_reads_request_records_of_steady_drafters_only(qwen3_dir, kind, keeps):
    """A neural drafter's requests keep their own acceptance records for the gate; a copy drafter's
    acceptance comes in bursts, so its requests are judged by everyone's record alone."""
    from dspark.spec.profile import StepProfile

    engine = engine_for(qwen3_dir, kind, "dspark")
    engine.runner.set_profile(StepProfile("cheap", tokens=[1, 96], verify_s=[1e-3, 1e-3], requests=[1, 64],
                                          draft_s=[1e-6, 1e-6]))
    seen = []
    step = engine.runner.step

    def recording(scheduled):
        out = step(scheduled)
        seen.append(len(engine.runner.own))
        return out

    engine.runner.step = recording
    run(engine, PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert engine.runner.drafted_steps > 0 and engine.runner.drafter.bursty is not keeps
    assert (max(seen) > 0) is keeps


@pytest.mark.parametrize(("kind", "over", "cut"), [("eagle3", {}, True), ("dspark", {"causal_block": True}, True),
                                                   ("dspark", {}, False)])
def test_static_k_drafts_k_positions_where_the_drafter_cuts_exactly(qwen3_dir, reference, kind, over, cut):
    """static:2 never verifies a third position, so a drafter that cuts exactly proposes two (and the output
    stays plain decoding's); a bidirectional block still runs whole."""
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=96)
    net, tok = load_model(qwen3_dir, dtype=cfg.dtype)
    torch.manual_seed(0)
    engine = assemble(net, tok, cfg, drafter=new_drafter(new_config(kind, net.config, 5, **over)), policy="static:2")
    propose, valid = engine.runner._propose, []
    engine.runner._propose = lambda decode, depth: (lambda b: (valid.append(b.num_valid), b)[1])(propose(decode, depth))
    assert [o.token_ids for o in run(engine)] == reference
    assert valid and all(v == ([2] * len(v) if cut else None) for v in valid)
