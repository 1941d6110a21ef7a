"""The never-slower gate: whether drafting pays this step, judged from history only.

The gate decides *before* drafting, from the step-cost profile and the acceptance of earlier
steps (never this step's draft tokens), whether a drafted step beats a plain one; if not, the
step decodes plainly without calling the drafter, probing again at growing intervals. It
never sees a draft token, so it cannot change what is emitted (losslessness holds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.spec.policies import algorithm1, candidates
from dspark.spec.profile import StepProfile
from dspark.spec.stats import AcceptanceStats, blend


@dataclass(frozen=True)
class GateConfig:
    enabled: bool = True
    probe_every: int = 8  # first probe after this many undrafted steps; doubles while drafting loses
    probe_max: int = 256  # the interval stops doubling here where probes are cheap ...
    probe_budget: float = 0.0025  # ... and further out where they are not: probes (their cost beyond a plain
    # step, from the profile) add at most this fraction to the steps between them (0: off)
    probe_ceiling: int = 4096  # the interval never grows past this (new traffic is found within it)
    explore_budget: float = 0.02  # while the interval doubles, it is at least long enough that a probe's
    # extra cost is this fraction of the steps before the next one (0: off): on a fresh engine the
    # doubling alone probed at steps 8, 24, 56, 120, 248, about 2% of a 512-step run at one request
    recheck_every: int = 16  # a cached verdict is recomputed at least this often (the profile drifts online)
    probe_requests: int = 2  # a probe drafts for this many requests (the acceptance estimates are shared)
    caution: float = 0.0  # standard errors taken off the acceptance estimates before judging (guards
    # against opening for every request on a few lucky probes); 1.0 kept EAGLE-3 under the dspark
    # policy at 1.35x plain where static:7 ran 1.53x (dspark-small in bfloat16, one request, a
    # short lockstep run not kept), 0 ran 1.71x
    own_weight: float = 4.0  # a request's own acceptance record counts against this many observations of
    # everyone's at each position (0: everyone's alone; a bursty drafter, `Drafter.bursty`, keeps none).
    # With everyone's record only, one long request whose drafts all failed (4 of 253 draft tokens
    # accepted, dspark-small) kept the gate open alone at the end of a C = 4 mixed run, on the other
    # requests' record, and the run lost 7% to plain
    judge_after: int = 16  # caution applies once this many first draft positions were verified: on
    # the prior alone (0.5, less its standard error) the gate closed on the first step and its rare
    # probes never gathered the evidence to reopen, even where drafting won 1.3x
    cut: bool = False  # pick the depth too (drafters that cut exactly, profiles that price it). Off: on dspark-small
    # it opened the gate at one or two positions where the full block kept it closed, and lost to plain decoding at
    # 16 requests (mixed 0.954x, hostile 0.906x; docs/results/online/gate-depth/): the gate's step model, decoding
    # requests alone, misses what the engine really pays around a drafted step under load
    depth_margin: float = 0.02  # a shallower draft is chosen only when it beats every deeper one by this fraction
    optimism: float = 1.0  # standard errors added to the estimates before judging (divided by R in a
    # batch of R), so a verdict on few observations leans to drafting and the bonus fades with
    # evidence. At 0, the README's first command (a fresh engine, one request) closed after two
    # rejected first positions, where the drafter's first position is accepted about half the
    # time, and never reopened


class Gate:
    """Predicts whether drafting pays, from history only (lossless).

    The gate judges the *decode-alone* shape (the decoding requests, no prefill chunks). A step
    that shares its forward with prefill chunks looks as if a few draft tokens were free (the
    chunks make the forward slow anyway), but opening there drafts for every request after a
    closed spell, each first catching up its whole pending context, a cost the profile's draft
    time (measured with the context already written) does not hold. Once open, Algorithm 1 still sizes
    the budget with the prefill tokens counted. The verdict depends on the number of requests, the
    acceptance estimates and the profile; it is cached until one of the first two changes or
    `recheck_every` steps pass, so a closed gate costs a dictionary lookup per step. Behind a
    router (`auto`), the drafter's cost is weighed for the share of requests the router has lately
    given its costly drafter (the copy drafter costs about nothing), not for all of them.
    """

    def __init__(self, cfg: GateConfig, stats: AcceptanceStats, profile: StepProfile | None) -> None:
        self.cfg, self.stats, self.profile = cfg, stats, profile
        self.wait, self.interval = 0, cfg.probe_every
        self.probing = False
        self.open = True  # the last verdict (slots are reserved for the first step)
        self.depth: int | None = None  # positions to draft while open (None: the drafter's gamma)
        self.memo: tuple[tuple, int, int] | None = None  # (key, age in steps, verdict: the depth)
        self.draft_share = 1.0  # smoothed fraction of drafted requests a router gives its costly drafter
        self.probe_extra: float | None = None  # what probes measured to cost beyond a plain step, in plain steps
        self.sampled = False  # whether the batch judged samples (its proposal may draft over more tokens)

    def cost(self, r: float, b: int, depth: int | None = None) -> float:
        """A drafted step's seconds: the costly drafter runs for draft_share of the r requests."""
        assert self.profile is not None
        return self.profile.cost(r * self.draft_share, b, depth, self.sampled)

    def observe_share(self, drafted: int, requests: int) -> None:
        self.draft_share = 0.9 * self.draft_share + 0.1 * drafted / requests

    @property
    def idle(self) -> bool:
        """Disabled, or no profile to judge by: every step with slots drafts."""
        return not self.cfg.enabled or self.profile is None

    def should_draft(self, num_requests: int, caps: Sequence[int], own: Sequence[AcceptanceStats | None] = (),
                     sampled: bool = False) -> bool:
        """A step scheduled with draft slots: draft (verdict open, or a probe is due) or not. `own`:
        each request's own acceptance record (None: none yet; empty: the shared estimates for all);
        `sampled`: whether any of the requests samples."""
        self.probing, self.sampled = False, sampled
        if self.idle:
            return True
        if self.judge(num_requests, caps, own):
            return True
        self.wait += 1
        if self.wait >= self.interval:  # probe: refresh the acceptance estimates
            longest = self.longest_interval(num_requests)
            self.wait, self.interval = 0, min(longest, max(self.interval * 2, self.shortest_interval(num_requests)))
            self.probing = True
            return True
        return False

    def longest_interval(self, num_requests: int) -> int:
        """probe_max, or more where a probe costs more than probe_budget of the plain steps
        between probes (a probe drafts, then verifies more tokens than a plain step would)."""
        if not self.cfg.probe_budget or self.profile is None:
            return self.cfg.probe_max
        extra = self.probe_cost(num_requests)
        return min(self.cfg.probe_ceiling, max(self.cfg.probe_max, math.ceil(extra / self.cfg.probe_budget)))

    def shortest_interval(self, num_requests: int) -> int:
        """The fewest steps to the next probe: its extra cost at most explore_budget of them."""
        if not self.cfg.explore_budget or self.profile is None:
            return 1
        return math.ceil(self.probe_cost(num_requests) / self.cfg.explore_budget)

    def probe_cost(self, num_requests: int) -> float:
        """What a probe adds to a plain step of these requests, in plain steps: the profile's price, or
        what probes were measured to cost where that is more (`observe_probe`)."""
        assert self.profile is not None
        k = min(self.cfg.probe_requests, num_requests)
        plain = self.profile.verify(num_requests)
        priced = max(0.0, (self.profile.cost(k, num_requests + k) - plain) / plain)  # a probe verifies >= 1 token each
        return priced if self.probe_extra is None else max(priced, self.probe_extra)

    def observe_probe(self, num_requests: int, seconds: float) -> None:
        """A probe among num_requests decoding requests took these seconds, catching up included. The
        profile prices a drafted step with the drafter's context written and every kernel warm; a probe
        first writes the context its requests gained while the gate was closed, and its unusual shapes
        (two verify rows beside many one-token rows) meet kernels not built yet: at 16 requests on
        dspark-small probes cost 1.5-3 plain steps where the profile said 0.3. The measured cost is
        folded in, and the wait for the next probe stretches to what it allows (`shortest_interval`)."""
        if self.profile is None or num_requests < 1:
            return
        extra = max(0.0, seconds / self.profile.verify(num_requests) - 1.0)
        self.probe_extra = extra if self.probe_extra is None else 0.5 * (self.probe_extra + extra)
        self.interval = min(self.longest_interval(num_requests), max(self.interval, self.shortest_interval(num_requests)))

    def withheld(self, num_requests: int, gamma: int, own: Sequence[AcceptanceStats | None] = (),
                 sampled: bool = False) -> None:
        """A step scheduled without draft slots (the gate was closed): advance the probe clock
        and judge whether drafting would pay now, so that the next step reserves slots."""
        self.probing, self.sampled = False, sampled
        if self.idle:
            return
        if not self.judge(num_requests, [gamma] * num_requests, own):
            self.wait += 1

    def judge(self, num_requests: int, caps: Sequence[int], own: Sequence[AcceptanceStats | None] = ()) -> bool:
        """The verdict for decoding these requests alone, remembered as `open`. When it pays, the
        probe backoff restarts, so that after the next close the gate probes soon again."""
        depth = self.pays(num_requests, caps, own)
        self.open, self.depth = depth > 0, depth or None
        if self.open:
            self.interval = self.cfg.probe_every
        return self.open

    def wants_slots(self) -> bool:
        """Whether the next step should reserve draft slots (KV and token budget). A closed gate
        withholds them: reserving and rolling back γ slots per request on every step slowed plain
        decoding at 16 requests (a hostile workload)."""
        return self.idle or self.open or self.wait + 1 >= self.interval

    def probe_subset(self, decode: Sequence, step: int) -> list:
        """The requests a probe drafts for: a window of `probe_requests`, rotating with the step,
        so a probe at 64 requests costs a draft for two, not for 64."""
        k = self.cfg.probe_requests
        if len(decode) <= k:
            return list(decode)
        return [decode[(step + i) % len(decode)] for i in range(k)]

    def pays(self, num_requests: int, caps: Sequence[int], own: Sequence[AcceptanceStats | None] = ()) -> int:
        """The depth to draft at (`predict`), remembered for a few steps; 0: drafting does not pay."""
        key = (num_requests, tuple(caps), self.stats.version, tuple(map(id, own)), self.sampled)  # records change with version
        if self.memo is not None and self.memo[0] == key and self.memo[1] < self.cfg.recheck_every:
            self.memo = (key, self.memo[1] + 1, self.memo[2])
            return self.memo[2]
        verdict = self.predict(num_requests, caps, own)
        self.memo = (key, 1, verdict)
        return verdict

    def estimates(self, num_requests: int, own: Sequence[AcceptanceStats | None]) -> torch.Tensor:
        """[R, gamma] conditional acceptance per request, from its own record and everyone else's
        (`blend`), plus `optimism` / R standard errors in a batch of R, less `caution` ones once
        there is enough to be cautious about. Exploring costs a drafted step for all R requests
        and a wrong close costs one request's speed-up: the bonus on every row drafted hostile
        prompts on 20% of the steps at 16 requests, 0.95-0.96x plain; at face value 0.98x."""
        judging = self.stats.total_tried[0] >= self.cfg.judge_after
        z = (self.cfg.caution if judging else 0.0) - self.cfg.optimism / max(1, num_requests)
        shared = self.stats.lower(z)
        rows = [blend(o, self.stats, self.cfg.own_weight).lower(z) if o is not None else shared
                for o in own] if own else [shared] * num_requests
        return torch.tensor(rows, dtype=torch.float64)

    def predict(self, num_requests: int, caps: Sequence[int], own: Sequence[AcceptanceStats | None] = ()) -> int:
        """Algorithm 1 on the cautious acceptance estimates at each depth the profile can price (with `cut`): the
        depth whose best budget beats plain decoding by the most (0: none beats it). Until `judge_after`
        first draft positions were verified there is too little to be cautious about: the estimates are
        taken at face value (the prior, 0.5 per position, at first), so a drafter that could pay is tried
        and one that could not even then is not. A shallower block must win by `depth_margin`: the
        gate prices every request at the mean acceptance, while the policy verifies a confident
        request's deep positions that the mean undervalues."""
        assert self.profile is not None
        deepest = max(caps, default=0)
        cands = candidates(self.estimates(num_requests, own), caps)
        plain = num_requests / self.profile.verify(num_requests)
        rates = {d: self.rate(num_requests, [c for c in cands if c.position <= d], d)
                 for d in (range(1, deepest + 1) if self.cfg.cut and self.profile.cuts else [deepest])}
        best = max(rates.values(), default=0.0)
        return max((d for d, v in rates.items() if v > plain and v >= best * (1 - self.cfg.depth_margin)), default=0)

    def rate(self, num_requests: int, cands: Sequence, depth: int) -> float:
        """Expected tokens per second of a step drafting depth positions, the budget chosen by Algorithm 1."""
        cost = lambda r, b: self.cost(r, b, depth)  # noqa: E731
        admitted = algorithm1(cands, num_requests, 0, cost)
        gain = sum(c.survival for c in cands[:admitted])
        return (num_requests + gain) / cost(num_requests, num_requests + admitted)
