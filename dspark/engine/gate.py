"""The never-slower gate: whether drafting pays this step, judged from history only.

The gate decides *before* drafting, from the step-cost profile and the acceptance of earlier
steps (never this step's draft tokens), whether a drafted step beats a plain one; if not, the
step decodes plainly without calling the drafter, probing again at growing intervals. It
never sees a draft token, so it cannot change what is emitted (losslessness holds).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import torch

from dspark.spec.policies import Candidate, algorithm1, candidates
from dspark.spec.profile import StepProfile
from dspark.spec.stats import AcceptanceStats, blend


@dataclass(frozen=True)
class Verdict:
    """What the gate decided for a step: the depth to draft at (0: drafting does not pay) and which of the
    judged requests to draft for (None: all of them; else their indices, ascending)."""

    depth: int
    rows: tuple[int, ...] | None = None


def ranks(cands: Sequence[Candidate], num_requests: int) -> list[int]:
    """Each request's rank by its expected accepted tokens from a full draft, the sum of its candidates'
    survivals (0: the best; ties by index)."""
    expected = [0.0] * num_requests
    for c in cands:
        expected[c.request] += c.survival
    order = sorted(range(num_requests), key=lambda r: (-expected[r], r))
    rank = [0] * num_requests
    for i, r in enumerate(order):
        rank[r] = i
    return rank


def ladder(n: int) -> list[int]:
    """The subset sizes the gate prices: every size up to 8, then about 1.5x apart, and n."""
    sizes, m = [], 1
    while m < n:
        sizes.append(m)
        m = m + 1 if m < 8 else math.ceil(m * 1.5)
    return [*sizes, n] if n > 0 else []


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
    cut: bool = True  # pick the depth too (drafters that cut exactly, profiles that price it), the shallowest whose
    # rate is within depth_margin of the best, with broad probes under load (`broad`). Side by side with it off on
    # dspark-small (docs/results/online/gate-cut/): level at one greedy request and at 64, ahead at 4 and 16 (mixed,
    # hostile, agent traces) and at one sampling request. Off, the full block is drafted or nothing
    select: bool = False  # draft only for the requests whose estimates pay: the best m by expected accepted tokens
    # (own record blended with everyone's), m chosen with Algorithm 1's throughput on a ladder of sizes; off:
    # one verdict for every decoding request, all drafted or none
    rows: bool = False  # price forwards in the engine's row shapes (`StepProfile.raw`), the gate's verdict and the
    # policy's budget alike; off: by their tokens alone, in (gamma+1)-token rows. The engine's profile times the row
    # shapes only when this is on (its own cache entry, `profiler.profile_key`). On dspark-small, side by side with
    # it off (docs/results/online/rows/): level at one request, within 5% either way at 4, 16 and 64 (mixed and
    # hostile), and 9% behind on agent traces at 16 under `auto`, where it verified fewer of the copy drafter's
    # tokens: not the default
    depth_margin: float = 0.02  # a deeper draft is chosen only when it beats every shallower one by this fraction:
    # the estimates of deep positions come from the rounds the policy chose to verify that deep (its confident ones),
    # and a deep proposal for many requests costs more than the profile's line between one position and the full
    # block. Preferring the deeper within 2% drafted 4-7 positions at 16 requests (mixed, lockstep, dspark-small),
    # and its drafted steps emitted fewer tokens per second than one position for every request
    optimism: float = 1.0  # standard errors added to the estimates before judging (divided by R in a
    # batch of R), so a verdict on few observations leans to drafting and the bonus fades with
    # evidence. At 0, the README's first command (a fresh engine, one request) closed after two
    # rejected first positions, where the drafter's first position is accepted about half the
    # time, and never reopened


    @classmethod
    def parse(cls, text: str) -> GateConfig:
        """'select=0,cut=1' -> the defaults with those fields replaced (booleans as 0/1, true/false)."""
        kinds, values = {f.name: f.type for f in fields(cls)}, {}
        for item in filter(None, (t.strip() for t in text.split(","))):
            key, sep, raw = item.partition("=")
            if not sep or key not in kinds:
                raise ValueError(f"gate option {item!r}: expected KEY=VALUE with KEY one of {', '.join(kinds)}")
            try:
                values[key] = parse_value(kinds[key], raw)
            except ValueError:
                raise ValueError(f"gate option {item!r}: {raw!r} is not {'an' if kinds[key] == 'int' else 'a'} "
                                 f"{kinds[key]}") from None
        return cls(**values)


def parse_value(kind: str, raw: str) -> bool | int | float:
    """A gate option's value by its field's type name ('bool', 'int', 'float')."""
    if kind == "bool":
        if raw.lower() not in ("0", "1", "true", "false"):
            raise ValueError(raw)
        return raw.lower() in ("1", "true")
    return int(raw) if kind == "int" else float(raw)

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

    def __init__(self, cfg: GateConfig, stats: AcceptanceStats, profile: StepProfile | None, cuts: bool = True) -> None:
        """cuts: whether the drafter proposes fewer positions when asked (`Drafter.cuts_exactly`); with `cut`, and a
        profile that prices a shallower proposal, the gate then picks the depth."""
        self.cfg, self.stats, self.profile = cfg, stats, profile
        self.cuts = cuts
        self.wait, self.interval = 0, cfg.probe_every
        self.probing = False
        self.open = True  # the last verdict (slots are reserved for the first step)
        self.depth: int | None = None  # positions to draft while open (None: the drafter's gamma)
        self.rows: tuple[int, ...] | None = None  # which judged requests to draft for while open (None: all)
        self.memo: tuple[tuple, int, Verdict] | None = None  # (key, age in steps, verdict)
        self.draft_share = 1.0  # smoothed fraction of drafted requests a router gives its costly drafter
        self.probe_extra: float | None = None  # what probes measured to cost beyond a plain step, in plain steps
        self.sampled = False  # whether the batch judged samples (its proposal may draft over more tokens)
        self.blended: dict[int, tuple[tuple, list[float]]] = {}  # id(own record) -> (versions, z; its estimates)

    def snapshot(self, probed: bool) -> dict:
        """What the gate holds after a step, for a step trace (`dspark bench online --trace`): its verdict
        (`open`, the depth, 0 when closed), whether this step was a probe, the steps to the next probe, what probes
        were measured to cost beyond a plain step, everyone's estimated acceptance per position (no bonus or
        caution) and the profile's online scales. Read after the step's observations are folded in."""
        assert self.profile is not None
        return {"open": self.open, "depth": (self.depth or self.stats.gamma) if self.open else 0, "probe": probed,
                "next_probe": None if self.open else max(0, self.interval - self.wait),
                "probe_extra": None if self.probe_extra is None else round(self.probe_extra, 4),
                "acceptance": [round(c, 4) for c in self.stats.conditional()],
                "scales": {k: round(getattr(self.profile, f"{k}_scale"), 4) for k in ("verify", "plain", "spec")}}

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
        k = num_requests if self.broad(num_requests) else min(self.cfg.probe_requests, num_requests)
        plain = self.profile.plain(num_requests)
        drafted = self.profile.cost(k, num_requests + k, self.probe_depth(num_requests), rows=num_requests)
        priced = max(0.0, (drafted - plain) / plain)  # >= 1 token each
        return priced if self.probe_extra is None else max(priced, self.probe_extra)

    def broad(self, num_requests: int) -> bool:
        """Whether a probe drafts one position for every request rather than the whole block for a few: where the
        gate picks the depth (`cut`, a profile that prices a shallow proposal) and more requests decode than a
        narrow probe takes. Under load the verdict turns on the first position, and a narrow probe learned it two
        observations at a time: at 16 requests on dspark-small a few unlucky first rounds held the estimate well
        below the 0.575 that one position for every request was accepted, and the gate stayed closed where drafting
        it ran 1.04-1.07x plain (docs/results/online/gate-cut/); one broad probe observes it for every request, in
        the shape an open gate drafts. A drafter of one position (MTP-1) probes so too: its whole block is that
        position. Narrow, MTP-1's gate at 16 requests started on a warm-up's low estimate (0.25 against the 0.57 it
        was accepted) and stayed closed through the run, 7% behind drafting it on every step."""
        return (self.picks_depth or self.stats.gamma == 1) and num_requests > self.cfg.probe_requests

    @property
    def picks_depth(self) -> bool:
        """Whether verdicts choose the depth: `cut`, a drafter that cuts exactly, a profile that prices it."""
        return self.cfg.cut and self.cuts and self.profile is not None and self.profile.cuts

    def probe_depth(self, num_requests: int) -> int | None:
        """The positions a probe drafts: one for a broad probe, else the whole block (None), to learn every
        position's acceptance."""
        return 1 if self.broad(num_requests) else None

    def step_depth(self, num_requests: int, deepest: int | None) -> int | None:
        """The positions this step drafts for num_requests decoding requests: the verdict's (None: gamma), or a
        probe's (`probe_depth`; a narrow probe drafts `deepest`, the most the policy verifies)."""
        return (self.probe_depth(num_requests) or deepest) if self.probing else self.depth

    def observe_probe(self, num_requests: int, seconds: float) -> None:
        """A probe among num_requests decoding requests took these seconds, catching up included. The
        profile prices a drafted step with the drafter's context written and every kernel warm; a probe
        first writes the context its requests gained while the gate was closed, and its unusual shapes
        (two verify rows beside many one-token rows) meet kernels not built yet: at 16 requests on
        dspark-small probes cost 1.5-3 plain steps where the profile said 0.3. The measured cost is
        folded in, and the wait for the next probe stretches to what it allows (`shortest_interval`)."""
        if self.profile is None or num_requests < 1:
            return
        extra = max(0.0, seconds / self.profile.plain(num_requests) - 1.0)
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
        verdict = self.pays(num_requests, caps, own)
        self.open, self.depth, self.rows = verdict.depth > 0, verdict.depth or None, verdict.rows
        if self.open:
            self.interval = self.cfg.probe_every
        return self.open

    def wants_slots(self) -> bool:
        """Whether the next step should reserve draft slots (KV and token budget). A closed gate
        withholds them: reserving and rolling back γ slots per request on every step slowed plain
        decoding at 16 requests (a hostile workload)."""
        return self.idle or self.open or self.wait + 1 >= self.interval

    def probe_subset(self, decode: Sequence, step: int) -> list:
        """The requests a probe drafts for: every one for a broad probe (`broad`), else a window of
        `probe_requests`, rotating with the step, so a probe at 64 requests costs a draft for two, not for 64."""
        k = self.cfg.probe_requests
        if len(decode) <= k or self.broad(len(decode)):
            return list(decode)
        return [decode[(step + i) % len(decode)] for i in range(k)]

    def chosen(self, decode: Sequence) -> list:
        """The requests an open gate drafts for: those its verdict picked (all where it picked none)."""
        return list(decode) if self.rows is None else [decode[i] for i in self.rows if i < len(decode)]

    def pays(self, num_requests: int, caps: Sequence[int], own: Sequence[AcceptanceStats | None] = ()) -> Verdict:
        """The verdict (`decide`), remembered for a few steps."""
        key = (num_requests, tuple(caps), self.stats.version, tuple(map(id, own)), self.sampled)  # records change with version
        if self.memo is not None and self.memo[0] == key and self.memo[1] < self.cfg.recheck_every:
            self.memo = (key, self.memo[1] + 1, self.memo[2])
            return self.memo[2]
        verdict = self.decide(num_requests, caps, own)
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
        if not own:
            return torch.tensor([shared] * num_requests, dtype=torch.float64)
        seen, self.blended = self.blended, {}
        rows = []
        for o in own:
            if o is None:
                rows.append(shared)
                continue
            key = (o.version, self.stats.version, z)  # a row is recomputed only when a record it reads changed
            hit = seen.get(id(o))
            row = hit[1] if hit is not None and hit[0] == key else blend(o, self.stats, self.cfg.own_weight).lower(z)
            self.blended[id(o)] = (key, row)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.float64)

    def predict(self, num_requests: int, caps: Sequence[int], own: Sequence[AcceptanceStats | None] = ()) -> int:
        """The depth `decide` drafts at (0: drafting does not pay)."""
        return self.decide(num_requests, caps, own).depth

    def decide(self, num_requests: int, caps: Sequence[int], own: Sequence[AcceptanceStats | None] = ()) -> Verdict:
        """Algorithm 1 on the cautious acceptance estimates at each depth the profile can price (with `cut`) and,
        with `select`, for the best m requests at each size of a `ladder`: the depth and requests whose best
        budget beats plain decoding by the most (depth 0: none beats it). Until `judge_after`
        first draft positions were verified there is too little to be cautious about: the estimates are
        taken at face value (the prior, 0.5 per position, at first), so a drafter that could pay is tried
        and one that could not even then is not. A deeper block must win by `depth_margin`."""
        assert self.profile is not None
        deepest = max(caps, default=0)
        cands = candidates(self.estimates(num_requests, own), caps)
        rank = ranks(cands, num_requests) if self.cfg.select else [0] * num_requests
        sizes = ladder(num_requests) if self.cfg.select else [num_requests]
        plain = num_requests / self.profile.plain(num_requests)
        verified: dict[int, float] = {}  # verify(b), shared by every walk of this decision
        best_at: dict[int, tuple[float, int]] = {}  # depth -> (rate, m) of its best subset size
        for d in (range(1, deepest + 1) if self.picks_depth else [deepest]):
            for m in sizes:
                v = self.rate(num_requests, m, (c for c in cands if c.position <= d and rank[c.request] < m), d,
                              verified)
                if d not in best_at or v > best_at[d][0]:
                    best_at[d] = (v, m)
        best = max((v for v, _ in best_at.values()), default=0.0)
        depth = min((d for d, (v, _) in best_at.items() if v > plain and v >= best * (1 - self.cfg.depth_margin)),
                    default=0)
        if depth == 0 or best_at[depth][1] == num_requests:
            return Verdict(depth)
        m = best_at[depth][1]
        return Verdict(depth, tuple(sorted(r for r in range(num_requests) if rank[r] < m)))

    def rate(self, num_requests: int, drafted: int, cands: Iterable[Candidate], depth: int,
             verified: dict[int, float] | None = None) -> float:
        """Expected tokens per second of a step drafting depth positions for `drafted` of the requests (their
        candidates `cands`), the budget chosen by Algorithm 1; the rest decode plainly in the same forward.
        The costly drafter runs for draft_share of the drafted requests (a router); verify(b) is memoised in
        `verified`."""
        assert self.profile is not None
        cost = self.profile.pricer(drafted * self.draft_share, depth, self.sampled, verified, rows=num_requests)
        walked: list[Candidate] = []  # read lazily: the walk stops at its first loss, long before the end
        admitted = algorithm1((walked.append(c) or c for c in cands), drafted, 0, cost, num_requests - drafted)
        gain = sum(c.survival for c in walked[:admitted])
        return (num_requests + gain) / cost(drafted, num_requests + admitted)
