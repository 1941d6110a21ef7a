"""Sampled speculative decoding follows the target distribution exactly.

A toy first-order Markov target p(x_k | x_{k-1}) and drafter q(x_k | x_{k-1}) over a
3-token vocabulary, with a drafter confidence c_k that depends on the previous draft token
(like DSpark's Markov confidence head). 10^5 independent requests run vectorised through
the real `verify` and the real policies; the empirical joint of the first three emitted
tokens is compared with the target's exact joint by a chi-square test. A deliberately
look-back global search (Appendix A: no early stop) must be caught as biased.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark.sampling import SamplingParams, SamplingRows, draw, probabilities, sample
from dspark.spec.policies import DSpark, DSparkAsync, Policy, Static, Threshold, candidates, make_policy
from dspark.spec.verify import verify, verify_greedy

V, GAMMA, N, TOKENS = 3, 3, 100_000, 3
TARGET = torch.tensor([[1.2, 0.4, -0.5], [0.1, 1.0, 0.3], [-0.4, 0.2, 1.1]])  # logits of p(. | prev)
DRAFT = torch.tensor([[0.2, 0.2, 0.0], [0.9, 0.1, 0.0], [0.0, -0.3, 0.8]])  # logits of q(. | prev)
CONF = torch.tensor([0.8, 0.05, 0.95])  # c_k as a function of the previous draft token


def processed(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    return probabilities(logits, SamplingRows.same(logits.shape[0], params))


def sps_cost(sps: dict[int, float]):
    """A single-request cost from an SPS table (Appendix A's numbers by default)."""
    return lambda r, b: 1.0 / sps.get(b, sps[max(sps)] * max(sps) / b)


def per_pattern(policy: Policy, conf: torch.Tensor, cost) -> torch.Tensor:
    """Apply a stateless policy to each request alone (R = 1), vectorised over the few
    distinct confidence patterns."""
    patterns, inverse = torch.unique(conf, dim=0, return_inverse=True)
    lengths = torch.tensor([policy.choose(p[None], [GAMMA], 0, cost)[0] for p in patterns])
    return lengths[inverse]


class LookBack(Policy):
    """The retrospective global search of Appendix A (no early stop): biased on purpose."""

    name, needs_cost = "lookback", True

    def choose(self, conf, caps, other_tokens, cost):
        cands = candidates(conf, caps)
        tau, best, best_k = float(len(caps)), len(caps) / cost(len(caps), len(caps)), 0
        for i, c in enumerate(cands):
            tau += c.survival
            theta = tau / cost(len(caps), len(caps) + i + 1)
            if theta > best:
                best, best_k = theta, i + 1
        ell = [0] * len(caps)
        for c in cands[:best_k]:
            ell[c.request] = max(ell[c.request], c.position)
        return ell


def simulate(choose, temperature=1.0, top_p=1.0, top_k=0, seed=0, draft=DRAFT) -> torch.Tensor:
    """[N, TOKENS] first tokens emitted by speculative decoding from anchor 0."""
    torch.manual_seed(seed)
    p_tab = processed(TARGET, temperature, top_p, top_k)  # [V, V]
    q_tab = processed(draft, temperature, top_p, top_k)
    out = torch.full((N, TOKENS), -1, dtype=torch.long)
    count = torch.zeros(N, dtype=torch.long)
    anchor = torch.zeros(N, dtype=torch.long)
    rows = SamplingRows.same(N, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k))
    while bool((count < TOKENS).any()):
        prev, drafts, conf = anchor, [], []
        for _ in range(GAMMA):
            conf.append(CONF[prev])
            prev = sample(q_tab[prev], rows, [None] * N)  # the engine's own draft sampler
            drafts.append(prev)
        tokens = torch.stack(drafts, 1)  # [N, G]
        ctx = torch.cat([anchor[:, None], tokens], 1)  # x_0..x_G
        target_probs = p_tab[ctx]  # [N, G+1, V]
        draft_probs = q_tab[ctx[:, :GAMMA]]
        lengths = choose(torch.stack(conf, 1))
        verdict = verify(tokens, draft_probs, target_probs, lengths, [None] * N)
        taken = []
        for r, emitted in enumerate(verdict.tokens):
            c = int(count[r])
            keep = emitted[: max(0, TOKENS - c)]
            out[r, c : c + len(keep)] = torch.tensor(keep, dtype=torch.long)
            taken.append(len(keep))
        count += torch.tensor(taken)
        anchor = out[torch.arange(N), count - 1]
    return out


def chi_square_pvalue(samples: torch.Tensor, temperature=1.0, top_p=1.0, top_k=0) -> float:
    p_tab = processed(TARGET, temperature, top_p, top_k).double()
    cells = list(itertools.product(range(V), repeat=TOKENS))
    expected = torch.tensor([p_tab[0, a] * p_tab[a, b] * p_tab[b, c] for a, b, c in cells]) * N
    index = samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2]
    observed = torch.bincount(index, minlength=V**TOKENS).double()
    keep = expected > 0
    assert int(observed[~keep].sum()) == 0, "a token the target gives zero probability was emitted"
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


PAYS = sps_cost({1: 1.0, 2: 0.9, 3: 0.8, 4: 0.62})  # verifying pays for confident prefixes only
APPENDIX_A = sps_cost({1: 1.0, 2: 0.5, 3: 0.45, 4: 0.3})


@pytest.mark.slow
@pytest.mark.parametrize("policy", [Static(0), Static(1), Static(3), Threshold(0.5), DSpark()], ids=lambda p: p.name)
def test_policies_are_lossless(policy):
    samples = simulate(lambda conf: per_pattern(policy, conf, PAYS))
    assert chi_square_pvalue(samples) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [dict(temperature=0.7, top_k=2), dict(temperature=1.3, top_p=0.8)])
def test_lossless_with_top_p_top_k(knobs):
    samples = simulate(lambda conf: per_pattern(DSpark(), conf, PAYS), **knobs)
    assert chi_square_pvalue(samples, **knobs) > 1e-3


@pytest.mark.slow
def test_a_draft_vocabulary_is_lossless():
    """A drafter restricted to a draft vocabulary never proposes the other tokens (q = 0 there);
    the target still emits them at its own rate, through the residual distribution."""
    restricted = DRAFT.clone()
    restricted[:, 2] = float("-inf")  # token 2 is outside the draft vocabulary
    samples = simulate(lambda conf: per_pattern(Static(3), conf, PAYS), draft=restricted)
    assert bool((samples == 2).any())
    assert chi_square_pvalue(samples) > 1e-3


@pytest.mark.slow
def test_async_budget_over_the_whole_batch_is_lossless():
    policy = DSparkAsync()
    batch_cost = lambda r, b: 1.0 + 2.0 * max(0, b - 1.4 * r) / r  # noqa: E731

    def choose(conf):
        return torch.tensor(policy.choose(conf, [GAMMA] * conf.shape[0], 0, batch_cost))

    assert chi_square_pvalue(simulate(choose)) > 1e-3


@pytest.mark.slow
def test_look_back_search_is_caught_as_biased():
    """The test has power: Appendix A's retrospective scheduler shifts the distribution."""
    samples = simulate(lambda conf: per_pattern(LookBack(), conf, APPENDIX_A))
    assert chi_square_pvalue(samples) < 1e-6
    causal = simulate(lambda conf: per_pattern(make_policy("dspark"), conf, APPENDIX_A), seed=1)
    assert chi_square_pvalue(causal) > 1e-3


def test_greedy_verification_rule():
    tokens = torch.tensor([[2, 1, 0]])
    draft = torch.nn.functional.one_hot(tokens, V).float()
    target = torch.nn.functional.one_hot(torch.tensor([[2, 1, 1, 0]]), V).float()
    verdict = verify(tokens, draft, target, torch.tensor([3]), [None])
    assert verdict.num_accepted == [2] and verdict.tokens == [[2, 1, 1]]
    verdict = verify(tokens, draft, target, torch.tensor([2]), [None])
    assert verdict.num_accepted == [2] and verdict.tokens == [[2, 1, 1]]  # bonus after a full prefix
    verdict = verify(tokens, draft, target, torch.tensor([0]), [None])
    assert verdict.num_accepted == [0] and verdict.tokens == [[2]]


def test_greedy_fast_path_equals_one_hot_verification():
    """verify_greedy (argmax ids only) gives what verify gives one-hot p and q, on random blocks
    with matches planted at random prefixes and every length l_r = 0..G."""
    gen = torch.Generator().manual_seed(5)
    rows, width = 64, 6
    target_ids = torch.randint(0, V, (rows, width + 1), generator=gen)
    draft_ids = torch.randint(0, V, (rows, width), generator=gen)
    keep = torch.randint(0, width + 1, (rows,), generator=gen)  # plant a matching prefix of this length
    planted = torch.arange(width)[None, :] < keep[:, None]
    draft_ids = torch.where(planted, target_ids[:, :width], draft_ids)
    lengths = torch.randint(0, width + 1, (rows,), generator=gen)
    one_hot = torch.nn.functional.one_hot
    slow = verify(draft_ids, one_hot(draft_ids, V).float(), one_hot(target_ids, V).float(), lengths, [None] * rows)
    fast = verify_greedy(draft_ids, target_ids, lengths)
    assert fast.num_accepted == slow.num_accepted and fast.tokens == slow.tokens
    assert any(0 < n < ell for n, ell in zip(fast.num_accepted, lengths.tolist(), strict=True))  # rejections seen
    assert any(n == ell > 0 for n, ell in zip(fast.num_accepted, lengths.tolist(), strict=True))  # bonus tokens seen


def test_draw_takes_the_argmax_of_greedy_rows_and_samples_the_rest():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    greedy = SamplingRows.same(6, SamplingParams(temperature=0.0))
    assert torch.equal(draw(logits, greedy, [None] * 6), sample(probabilities(logits, greedy), greedy, [None] * 6))
    mixed = SamplingRows.build([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=0)] * 3)
    gens = [torch.Generator().manual_seed(7) for _ in range(6)]
    again = [torch.Generator().manual_seed(7) for _ in range(6)]
    assert torch.equal(draw(logits, mixed, gens), sample(probabilities(logits, mixed), mixed, again))
    assert torch.equal(draw(logits, mixed, gens)[::2], logits.argmax(-1)[::2])


@pytest.mark.parametrize("seeded", [False, True])
def test_sample_follows_its_distribution(seeded):
    """The engine's sampler (exponential race) draws token i with probability p_i, seeded or not,
    and never a zero-probability token."""
    torch.manual_seed(1)
    p = torch.tensor([0.05, 0.0, 0.5, 0.15, 0.3])
    n = 40_000
    gens = [torch.Generator().manual_seed(i) if seeded and i % 2 else None for i in range(n)]
    tokens = sample(p.repeat(n, 1), SamplingRows.same(n, SamplingParams(temperature=1.0)), gens)
    observed = torch.bincount(tokens, minlength=len(p)).double()
    assert observed[1] == 0
    keep = p > 0
    expected = p.double()[keep] * n
    stat = float(((observed[keep] - expected) ** 2 / expected).sum())
    assert float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2.0), torch.tensor(stat / 2.0))) > 1e-3
