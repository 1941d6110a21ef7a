"""Step-cost profile: seconds of a target forward of B tokens, and of a drafter proposal
for R requests, so schedulers maximise tokens per second of the whole step.

Measured at engine start (warm-up, then timed runs on a grid up to the token budget, at a
representative context length), interpolated, cached on disk per model / drafter / device
/ dtype / threads, and corrected while serving, since a start-up profile drifts with heat,
context and load. The corrections compare engine steps with what the profile predicts. The
machine's speed (`verify_scale`) is read from the target's forward inside every step, plain or
drafted, since the profile's forward timings are of exactly that; it moves every batch shape alike,
the drafter's too: a neighbour that slows the machine slows drafting as much as verifying. Two more
scales sit on top of it, each from whole steps of its own kind (draft, forward, acceptance and the
host work around them): `plain_scale`, a plain step against its forward, and `spec_scale`, what a
drafted step really costs against its prediction, e.g. the verify path's host work, rows the raw
forward timings do not see, or a proposal that caught up a long pending context. The machine's speed
must come from drafted steps too: while the gate is open the engine takes no plain step, and a
drafted-step scale on top of a stale machine scale took in every slowdown of the machine, then, once
plain steps raised the machine scale, counted it a second time and held the gate closed (`auto` at 16
agent requests in lockstep, `docs/benchmarks.md`). Inside one step the scales are constant factors,
so they never change which tokens Algorithm 1 admits; they change whether drafting beats a plain step
(the gate) — the comparison a wrong profile gets wrong. A caller that cannot time the forward alone
(on CUDA it returns before its kernels finish) passes none: a plain step's whole time then goes to the
machine scale, as before, and a drafted step leaves the machine scale as it is.

    dspark profile [--model PATH] [--drafter NAME] [--refresh] [--plot FILE.png]

This file holds the profile's data and arithmetic; measuring it and its on-disk cache are in
`engine/profiler.py`.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields


def interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation, linear extrapolation past the last point (a one-point
    grid, e.g. a profile measured for one request at a time, is constant)."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i == len(xs):
        i = len(xs) - 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def nondecreasing(ys: list[float]) -> list[float]:
    """Each value lowered to the least of it and every value after it."""
    out, low = [], float("inf")
    for y in reversed(ys):
        low = min(low, y)
        out.append(low)
    return out[::-1]


@dataclass
class StepProfile:
    key: str
    tokens: list[int]  # grid of forward sizes B
    verify_s: list[float]  # seconds per target forward of B tokens
    requests: list[int] = field(default_factory=lambda: [1])  # grid of R
    draft_s: list[float] = field(default_factory=lambda: [0.0])  # seconds per proposal for R requests
    gamma: int = 1  # positions of a full proposal (draft_s)
    shallow_s: list[float] = field(default_factory=list)  # seconds per one-position proposal for R requests
    #                                                       (a drafter that cuts exactly; empty: every depth costs a full one)
    pair_s: list[float] = field(default_factory=list)  # seconds per two-position proposal for R requests, where one
    #   position costs less than the line through it would say (a drafter with an early exit; empty: on the line)
    sampled_s: list[float] = field(default_factory=list)  # seconds per full proposal for R requests in a batch
    #   that samples, where such a batch drafts over more tokens than a greedy one (`NeuralDrafter.select_vocab`;
    #   empty: the same as draft_s)
    rows: list[int] = field(default_factory=list)  # grid of R for forwards timed in the engine's own row shapes
    row_extra: list[list[int]] = field(default_factory=list)  # per R: tokens beyond one per row of each timed forward
    row_s: list[list[float]] = field(default_factory=list)  # per R: its seconds (empty: `tokens` alone prices forwards)
    smoothing: float = 0.05
    verify_scale: float = 1.0  # measured / profiled seconds of target forwards, smoothed: the machine's speed
    plain_scale: float = 1.0  # whole plain steps / their forward's prediction, smoothed, on top of verify_scale
    spec_scale: float = 1.0  # measured / predicted seconds of drafted steps, smoothed, on top of verify_scale

    def __post_init__(self) -> None:
        # more tokens (requests) never cost less: a point measured above a later one was slowed by
        # something else on the machine (noise only ever adds time), so it takes the later value;
        # a noisy one-token point above the two-token one made drafting look free at one request
        self.verify_s, self.draft_s = nondecreasing(self.verify_s), nondecreasing(self.draft_s)
        self.shallow_s = [min(a, b) for a, b in zip(nondecreasing(self.shallow_s), self.draft_s, strict=False)]
        self.pair_s = [min(a, b) for a, b in zip(nondecreasing(self.pair_s), self.draft_s, strict=False)]
        self.sampled_s = [max(a, b) for a, b in zip(nondecreasing(self.sampled_s), self.draft_s, strict=False)]
        self.row_s = [nondecreasing(ys) for ys in self.row_s]

    @property
    def cuts(self) -> bool:
        """Whether a shallower proposal is known to cost less (the gate may pick the depth)."""
        return bool(self.shallow_s) and self.gamma > 1

    def verify(self, b: int, rows: int | None = None) -> float:
        """Seconds of a plain step of b tokens in `rows` rows (None: not known): the forward, on this machine now,
        and the step's host work."""
        return self.forward(b, rows) * self.plain_scale

    def plain(self, requests: int) -> float:
        """Seconds of a plain decoding step of this many requests: one one-token row each."""
        return self.verify(requests, requests)

    def forward(self, b: int, rows: int | None = None) -> float:
        return self.raw(b, rows) * self.verify_scale

    def raw(self, b: int, rows: int | None = None) -> float:
        """Profiled seconds of a target forward of b tokens. Given its rows (one per request, a prefill chunk one
        more) and a profile timed in row shapes, the forward of b - rows tokens beyond one per row, interpolated
        between the two timed row counts around it; else the forward of b tokens in (gamma+1)-token rows. At
        8-31 requests on dspark-small a drafted step's forward, rows verifying a few draft tokens beside
        one-token rows, took 37-38 ms where a plain step's took 25 (`dspark bench online --trace`,
        docs/results/online/trace/): attention pads one grid for one-token rows and another for verify rows,
        and both grow with the rows."""
        if rows is None or not self.rows:
            return interp(self.tokens, self.verify_s, b)
        extra = max(0, b - rows)
        at = [interp(xs, ys, extra) for xs, ys in zip(self.row_extra, self.row_s, strict=True)]
        return interp(self.rows, at, rows)

    def draft(self, r: float, depth: int | None = None, sampled: bool = False) -> float:
        """Seconds of a proposal of depth positions (None: gamma) for r requests, linear in the depth
        between the one-position and the full proposal (between the two-position one and the full one past two
        positions, where `pair_s` holds); below one request (a router that sends a
        fraction of its requests to this drafter), one request's proposal in that fraction of the steps.
        A batch that samples adds what its larger vocabulary costs, per position (`sampled_s`)."""
        if r <= 0:
            return 0.0
        if r < 1:
            return r * self.draft(1, depth, sampled)
        full = interp(self.requests, self.draft_s, r)
        positions = self.gamma if depth is None else min(max(1, depth), self.gamma)
        extra = interp(self.requests, self.sampled_s, r) - full if sampled and self.sampled_s else 0.0
        if self.cuts and positions < self.gamma:
            first, one = (2, interp(self.requests, self.pair_s, r)) if self.pair_s and positions >= 2 \
                else (1, interp(self.requests, self.shallow_s, r))
            full = one + (full - one) * (positions - first) / (self.gamma - first)
        return (full + extra * positions / self.gamma) * self.verify_scale

    def cost(self, r: float, b: int, depth: int | None = None, sampled: bool = False, rows: int | None = None) -> float:
        """Seconds of a speculative step: draft depth positions for r requests (a batch that samples, or
        not), verify b tokens in `rows` rows (None: not known), accept."""
        return self.pricer(r, depth, sampled, rows=rows)(r, b)

    def pricer(self, r: float, depth: int | None = None, sampled: bool = False,
               verified: dict[int, float] | None = None, rows: int | None = None) -> Callable[[int, int], float]:
        """`cost` for one r, for a walk that prices many budgets (Algorithm 1): the proposal priced once,
        each verify(b) looked up in `verified`, filled as it goes (share it between walks; one `rows` per
        dict). Where the drafter runs (r > 0) and the rows are known, the forward is priced with at least one
        verify row: like the proposal, the second attention grid is a fixed cost of drafting, so the walk
        weighs each draft token at its own marginal cost and its early stop still holds."""
        draft, seen = self.draft(r, depth, sampled), {} if verified is None else verified
        least = 0 if rows is None or r <= 0 else rows + 1

        def cost(_r: float, b: int) -> float:
            v = seen.get(b)
            if v is None:
                v = seen[b] = self.verify(max(b, least), rows)
            return (draft + v) * self.spec_scale
        return cost

    def sps(self, b: int) -> float:
        return 1.0 / self.verify(b)

    def observe_plain(self, b: int, seconds: float, forward: float | None = None, rows: int | None = None) -> None:
        """A whole plain step of b tokens in `rows` rows took these seconds, its target forward `forward` of them."""
        self.observe_forward(b, seconds if forward is None else forward, rows)
        if forward is not None:
            self.plain_scale = self._smoothed(self.plain_scale, self.forward(b, rows), seconds)

    def observe_drafted(self, r: int, b: int, seconds: float, depth: int | None = None,
                        forward: float | None = None, sampled: bool = False, rows: int | None = None) -> None:
        """A whole drafted step (proposal of depth positions for r requests, b forward tokens in `rows` rows; a
        batch that samples, or not) took these seconds, its target forward `forward` of them (None: not timed
        apart; the machine scale stays)."""
        if forward is not None:
            self.observe_forward(b, forward, rows)
        predicted = self.draft(r, depth, sampled) + self.verify(b, rows)
        self.spec_scale = self._smoothed(self.spec_scale, predicted, seconds, clip=2.0)

    def observe_forward(self, b: int, seconds: float, rows: int | None = None) -> None:
        """A target forward of b tokens in `rows` rows took these seconds: the machine's speed."""
        self.verify_scale = self._smoothed(self.verify_scale, self.raw(b, rows), seconds)

    def _smoothed(self, scale: float, profiled: float, seconds: float, clip: float = 10.0) -> float:
        """One step's measured / profiled ratio, clipped to [1/clip, clip], folded into the scale. The
        drafted-step scale clips at 2: drafted steps are rare, so one outlier (a new batch shape's first
        forward) would otherwise hold the gate closed for many of them."""
        if profiled <= 0 or seconds <= 0:
            return scale
        ratio = min(clip, max(1 / clip, seconds / profiled))
        return (1 - self.smoothing) * scale + self.smoothing * ratio

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> StepProfile:
        """A cached profile; keys this version does not know (corrections an older or newer version kept,
        e.g. `verify_fix`) are dropped, so a shared cache never stops an engine from starting."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})


def plot(profile: StepProfile, path: str) -> None:
    """Target steps/s against forward tokens, and draft time against requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(profile.tokens, [1 / t for t in profile.verify_s], marker="o")
    a.set_xlabel("tokens in the target forward (B)")
    a.set_ylabel("SPS(B), steps/s")
    a.set_xscale("log")
    b.plot(profile.requests, [t * 1000 for t in profile.draft_s], marker="o", color="C1", label=f"{profile.gamma} positions")
    if profile.shallow_s:
        b.plot(profile.requests, [t * 1000 for t in profile.shallow_s], marker="o", color="C2", label="one position")
        b.legend()
    b.set_xlabel("requests drafted (R)")
    b.set_ylabel("draft ms")
    b.set_xscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
