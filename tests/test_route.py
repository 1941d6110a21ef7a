"""Routing between the DSpark drafter and the suffix drafter (`auto`): the routing rule, greedy
identity with plain decoding, per-request counts of which drafter proposed what, and the output
distribution through the engine with routing on (chi-square against the target's exact joint of
three tokens, a tiny random model with an 8-token vocabulary), with a router that peeks at the
sampled neural draft as the control the test must catch."""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark.config import EngineConfig
from dspark.drafters.base import ProposeInput, save_drafter
from dspark.drafters.registry import load_drafter, new_config, new_drafter
from dspark.drafters.route import RoutedDrafter, route
from dspark.engine.engine import LLMEngine
from dspark.engine.factory import assemble
from dspark.engine.gate import GateConfig
from dspark.models.loader import load_model
from dspark.sampling import SamplingParams
from dspark.spec.profile import StepProfile
from tests.conftest import build_tiny
from tests.test_spec_engine import PROMPTS, engine_for, run


class Fixed(StepProfile):
    """A profile that keeps its numbers: the engine's corrections from measured step times are off, so a
    slower or busier machine routes the same requests (no verdict here may race the clock)."""

    def observe_plain(self, *args, **kwargs) -> None:
        pass

    def observe_drafted(self, *args, **kwargs) -> None:
        pass


PROFILE = Fixed("test", tokens=[1, 64, 1024], verify_s=[1e-3, 1.2e-3, 3e-3], requests=[1, 64],
                draft_s=[0.1e-3, 1e-3])  # GPU-like: verifying more tokens costs little, drafting a fixed part
CHEAP = Fixed("cheap", tokens=[1, 64, 1024], verify_s=[1e-3, 1.2e-3, 3e-3], requests=[1, 64],
              draft_s=[1e-5, 1e-4])


def routed(path, policy: str, profile: StepProfile | None = PROFILE, sure: float = 0.0,
           store: int = 16384, cls=RoutedDrafter, **kw) -> LLMEngine:
    """An engine routing between a random DSpark drafter (its confidence logits raised by `sure`)
    and the suffix drafter (matching `store` tokens of finished requests)."""
    net, tok = load_model(path)
    torch.manual_seed(0)
    mask = tok.token_id("<|mask|>") or 0
    copy = new_drafter(new_config("suffix", net.config, mask, suffix_store=store))
    drafter = cls(new_drafter(new_config("dspark", net.config, mask)), copy)
    with torch.no_grad():
        drafter.neural.conf.proj.bias.add_(sure)
    cfg = EngineConfig(**{"device": "cpu", "block_size": 4, "max_num_batched_tokens": 96, **kw})
    engine = assemble(net, tok, cfg, drafter=drafter, policy=policy, gate=GateConfig(enabled=False))
    if profile is not None:
        engine.runner.set_profile(profile)
    return engine


def test_route_moves_requests_while_tokens_per_second_rise():
    copy, neural = [3.0, 0.2, 0.5, 1.0], [1.0, 2.0, 1.5, 1.1]
    assert route(copy, neural, None) == [1, 2, 3]  # no costs: the larger expectation
    free = StepProfile("free", tokens=[1, 64], verify_s=[1.0, 1.0], requests=[1, 64], draft_s=[0.0, 0.0])
    assert route(copy, neural, free) == [1, 2, 3]
    dear = StepProfile("dear", tokens=[1, 64], verify_s=[1.0, 1.0], requests=[1, 64], draft_s=[10.0, 10.0])
    assert route(copy, neural, dear) == []
    some = StepProfile("some", tokens=[1, 64], verify_s=[1.0, 1.0], requests=[1, 2, 64], draft_s=[0.1, 0.5, 0.5])
    assert route(copy, neural, some) == [1]  # the second move would cost more than its gain
    # a batch that samples drafts over every token: its dearer proposal keeps every request on the copy drafter
    wide = StepProfile("wide", tokens=[1, 64], verify_s=[1.0, 1.0], requests=[1, 64], draft_s=[0.0, 0.0],
                       sampled_s=[10.0, 10.0])
    assert route(copy, neural, wide) == [1, 2, 3] and route(copy, neural, wide, sampled=True) == []


def test_auto_and_dspark_plus_suffix_load(qwen3_dir):
    net, _ = load_model(qwen3_dir)
    with pytest.raises(FileNotFoundError):  # the tiny test model ships no dspark drafter
        load_drafter("auto", qwen3_dir, net.config)
    path = qwen3_dir / "dspark-random-route"
    torch.manual_seed(0)
    neural = new_drafter(new_config("dspark", net.config, causal_block=True))  # as the shipped one
    save_drafter(neural, neural.config, path)
    for name in (f"{path}+suffix", f"suffix+{path}"):
        d = load_drafter(name, qwen3_dir, net.config)
        assert isinstance(d, RoutedDrafter) and d.config.kind == "auto" and d.copy.gamma == d.neural.gamma
    d.config = d.config.replace(gamma=3)
    assert (d.gamma, d.neural.gamma, d.copy.gamma) == (3, 3, 3)
    from dspark import LLM

    for name in ("suffix", f"{path}+suffix"):  # what `dspark generate --drafter ...` and serve build
        llm = LLM(str(qwen3_dir), drafter=name, policy="static:3", profile="off", device="cpu", dtype="float32")
        out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        assert [o.token_ids for o in out] == [o.token_ids for o in run(engine_for(qwen3_dir), PROMPTS[:2],
                                                                       SamplingParams(temperature=0.0, max_tokens=6,
                                                                                      ignore_eos=True))]
        assert llm.engine.drafter.config.kind == ("suffix" if name == "suffix" else "auto")
    # the router never proposes a cut block (a copy is whole), so its gate drafts the whole block or nothing; the
    # causal-block drafter alone lets the gate pick the depth
    assert not d.cuts_exactly and d.neural.cuts_exactly
    gates = [LLM(str(qwen3_dir), drafter=name, policy="dspark", profile="off", device="cpu").engine.runner.gate
             for name in (f"{path}+suffix", str(path))]
    assert [g.cuts for g in gates] == [False, True] and gates[0].cfg.cut
    gates[0].profile = gates[1].profile = StepProfile("test", tokens=[1, 512], verify_s=[0.01, 0.1], requests=[1, 64],
                                                      draft_s=[0.002, 0.04], gamma=7, shallow_s=[0.002, 0.004])
    assert not gates[0].picks_depth and not gates[0].broad(64) and gates[1].picks_depth and gates[1].broad(64)


@pytest.mark.parametrize("policy", ["static:7", "dspark"])
def test_greedy_identical_with_routing_and_stats_name_the_drafters(qwen3_dir, policy):
    reference = [o.token_ids for o in run(engine_for(qwen3_dir), PROMPTS[::2])]
    engine = routed(qwen3_dir, policy)
    outs = run(engine, PROMPTS[::2])
    assert [o.token_ids for o in outs] == reference
    drafted = {k: sum(o.stats["draft_tokens_by"].get(k, 0) for o in outs) for k in ("dspark", "suffix")}
    assert drafted["dspark"] > 0 and drafted["suffix"] > 0, drafted
    for o in outs:
        assert sum(o.stats["draft_tokens_by"].values()) == o.stats["draft_tokens"]
        assert sum(o.stats["accepted_tokens_by"].values()) == o.stats["accepted_tokens"]
    assert engine.kv.pool.num_used_blocks == 0 and engine.drafter.cache_bytes_in_use() == 0
    assert not engine.drafter.waiting and not engine.drafter.copy.seqs
    assert not engine.drafter.idle and not engine.drafter.interval


def test_a_neural_drafter_that_promises_more_than_it_delivers_loses_its_requests(qwen3_dir):
    """Random DSpark weights with a confident head (each position ~0.998): its blocks promise
    nearly gamma tokens and deliver few, so kappa falls and the copy drafter takes the requests."""
    reference = [o.token_ids for o in run(engine_for(qwen3_dir), PROMPTS)]
    engine = routed(qwen3_dir, "static:7", profile=None, sure=6.0)
    drafter = engine.drafter
    early = run(engine, PROMPTS[:7])
    late = run(engine, PROMPTS[7:])
    assert [o.token_ids for o in early + late] == reference
    assert drafter.kappa < 0.5 and drafter.promised > 0
    share = [sum(o.stats["draft_tokens_by"].get("dspark", 0) for o in outs) / sum(o.stats["draft_tokens"] for o in outs)
             for outs in (early, late)]
    assert share[1] < share[0], share


def bare_router(qwen3_dir, **kw) -> RoutedDrafter:
    net, _ = load_model(qwen3_dir)
    torch.manual_seed(0)
    return RoutedDrafter(new_drafter(new_config("dspark", net.config)),
                         new_drafter(new_config("suffix", net.config, 0)), **kw)


def test_a_request_the_router_stopped_drafting_for_is_probed_at_doubling_intervals(qwen3_dir):
    """The neural drafter's estimate is tested again: a request copied for `probe_every` steps is routed
    to it once, the next probe comes twice as late (up to probe_max), and a win on merit resets the wait."""
    router = bare_router(qwen3_dir, probe_every=2, probe_max=8)
    inputs = [ProposeInput("a", 1, 3, [0, 0, 0, 1])]
    probes = [s for s in range(40) if router.explore(inputs, []) == [0]]
    assert probes == [1, 5, 13, 21, 29, 37]  # waits of 2, 4, 8, then capped at 8
    assert router.explore(inputs, [0]) == [0] and router.interval["a"] == 2  # chosen on merit: the wait resets
    assert [s for s in range(6) if router.explore(inputs, []) == [0]] == [1, 5]


def test_probes_per_step_are_capped_and_the_longest_waiting_goes_first(qwen3_dir):
    router = bare_router(qwen3_dir, probe_every=3, probe_max=3)
    inputs = [ProposeInput(sid, 1, 3, [0, 0, 0, 1]) for sid in "abc"]
    router.explore(inputs[:1], [])  # "a" arrived a step earlier
    steps = [router.explore(inputs, []) for _ in range(6)]
    assert steps[0] == [] and steps[1] == [0] and steps[2] == [1] and all(len(s) <= 1 for s in steps)
    assert [i for s in steps for i in s].count(2) >= 1  # every request gets its turn
    assert router.explore(inputs, [1, 2]) in ([1, 2], [0, 1, 2])  # chosen ones stay; at most one probe is added


def test_probes_that_start_the_drafter_alone_are_spaced_by_their_cost(qwen3_dir):
    router = bare_router(qwen3_dir, probe_every=1, probe_max=1, probe_budget=0.01)
    router.set_profile(StepProfile("dear", tokens=[1, 64], verify_s=[1.0, 1.0], requests=[1, 64], draft_s=[0.1, 0.1]))
    inputs = [ProposeInput("a", 1, 3, [0, 0, 0, 1])]
    alone = [s for s in range(40) if router.explore(inputs, []) == [0]]
    assert alone == [9, 19, 29, 39]  # a proposal of 0.1 plain steps: at most one per 10 steps
    inputs.append(ProposeInput("b", 1, 3, [0, 0, 0, 1]))
    assert router.explore(inputs, [1]) == [0, 1]  # riding along with a request chosen on merit: no wait


# ---- the output distribution through the engine ---------------------------------------------
V, TOKENS, N = 8, 3, 3000
PROMPT = [4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6]  # the suffix drafter finds matches, DSpark drafts too


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("v8"), "qwen3", seed=1, vocab_size=V)


def exact_joint(path) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) [V**3] from plain decoding's own full distributions."""
    net, tok = load_model(path)
    engine = assemble(net, tok, EngineConfig(device="cpu"))
    prefixes = [list(p) for n in range(TOKENS) for p in itertools.product(range(V), repeat=n)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=V)
    outs = engine.run_until_done([engine.add_request(PROMPT + p, params) for p in prefixes])
    dist = {}
    for p, o in zip(prefixes, outs, strict=True):
        row = torch.zeros(V, dtype=torch.float64)
        for t, lp in o.logprobs[0]["top"]:
            row[t] = float(torch.tensor(lp, dtype=torch.float64).exp())
        dist[tuple(p)] = row / row.sum()
    return torch.tensor([dist[()][a] * dist[(a,)][b] * dist[(a, b)][c]
                         for a, b, c in itertools.product(range(V), repeat=TOKENS)])


def sampled_joint(engine: LLMEngine) -> tuple[torch.Tensor, dict]:
    counts, by = torch.zeros(V**TOKENS, dtype=torch.float64), {}
    for start in range(0, N, 500):
        reqs = [engine.add_request(PROMPT, SamplingParams(temperature=1.0, max_tokens=TOKENS, seed=i, ignore_eos=True))
                for i in range(start, min(N, start + 500))]
        for o in engine.run_until_done(reqs):
            a, b, c = o.token_ids
            counts[a * V * V + b * V + c] += 1
            for k, n in o.stats["draft_tokens_by"].items():
                by[k] = by.get(k, 0) + n
    return counts, by


def pvalue(observed: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * observed.sum()
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2.0), torch.tensor(stat / 2.0)))


class Peeking(RoutedDrafter):
    """A wrong router: it lets the neural drafter draft for everyone, then keeps the neural block
    only where its sampled first token is even (the choice depends on the draft itself)."""

    def propose(self, inputs, rows, depth=None):
        block = self.copy.propose(inputs, rows)
        self.hand_over([i.seq_id for i in inputs])
        nb = self.neural.propose(inputs, rows)
        keep = [r for r in range(len(inputs)) if int(nb.tokens[r, 0]) % 2 == 0]
        block.sources = [self.copy.config.kind] * len(inputs)
        block.probs = block.distributions(nb.probs.shape[-1])
        for r in keep:
            block.tokens[r], block.probs[r], block.confidence[r] = nb.tokens[r], nb.probs[r], nb.confidence[r]
            block.num_valid[r], block.sources[r] = self.gamma, self.neural.config.kind
        return block


@pytest.mark.parametrize("policy", ["static:7", "dspark"])
def test_sampled_output_follows_the_target_with_routing(small_vocab, policy):
    p = exact_joint(small_vocab)
    # without the store every request copies from its own 11 tokens only: both drafters get requests
    engine = routed(small_vocab, policy, CHEAP, sure=-0.5, store=0, max_num_seqs=128, max_num_batched_tokens=2048)
    counts, by = sampled_joint(engine)
    assert min(by.get("dspark", 0), by.get("suffix", 0)) > 0.05 * sum(by.values()), by
    assert pvalue(counts, p) > 1e-3


def test_a_router_that_peeks_at_the_draft_is_caught(small_vocab):
    p = exact_joint(small_vocab)
    counts, _ = sampled_joint(routed(small_vocab, "static:7", cls=Peeking, max_num_seqs=128, max_num_batched_tokens=2048))
    assert pvalue(counts, p) < 1e-6
