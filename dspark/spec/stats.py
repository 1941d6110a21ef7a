"""Running acceptance statistics: per-position conditional acceptance of verified drafts.

Position k is *tried* when it was verified and every earlier position was accepted, and
*accepted* when it passed. The ratio, with exponential forgetting, estimates
c_k = P(x_k accepted | x_1..x_{k-1} accepted) for drafters without a confidence head, and
predicts whether drafting pays at all (the never-slower gate).

Few observations reach deep positions when early ones are rejected (hostile traffic tries
position 4 almost never), so each estimate is shrunk toward the one before it, not toward a
fixed 0.5: without evidence, position k is assumed to accept like position k - 1. `lower`
is the estimate less its standard error, for decisions that must not trust a handful of
lucky probes (the gate opening for every request on three observations); `lower` with a
negative z is the upper bound, for decisions that must not end on a few unlucky ones (two
rejected first positions are a one-in-four event at acceptance 0.5). `blend` is one request's
own record with a few observations' worth of everyone else's: one request whose drafts fail
(a prompt unlike the drafter's training) is judged by its own record within a few steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class AcceptanceStats:
    def __init__(self, gamma: int, decay: float = 0.995, prior: float = 0.5, prior_weight: float = 2.0) -> None:
        self.gamma, self.decay = gamma, decay
        self.prior, self.prior_weight = prior, prior_weight
        self.tried = [0.0] * gamma  # decayed observations (the prior is added when read)
        self.accepted = [0.0] * gamma
        self.total_tried = [0] * gamma  # undecayed counts, for reporting
        self.total_accepted = [0] * gamma
        self.version = 0  # bumped by every update, so callers can cache what they derive

    def update(self, lengths: Sequence[int], num_accepted: Sequence[int]) -> None:
        self.version += 1
        for ell, n in zip(lengths, num_accepted, strict=True):
            if ell <= 0:
                continue
            for k in range(min(n + 1, ell)):  # positions 1..min(n+1, ell), 0-based here
                self.tried[k] = self.tried[k] * self.decay + 1
                self.accepted[k] = self.accepted[k] * self.decay + (1 if k < n else 0)
                self.total_tried[k] += 1
                self.total_accepted[k] += 1 if k < n else 0

    def conditional(self) -> list[float]:
        """Estimated c_1..c_gamma, each shrunk toward the previous one, clipped away from 0 and 1."""
        out, mean, w = [], self.prior, self.prior_weight
        for a, t in zip(self.accepted, self.tried, strict=True):
            mean = min(0.99, max(0.01, (a + w * mean) / (t + w)))
            out.append(mean)
        return out

    def lower(self, z: float = 1.0) -> list[float]:
        """`conditional` less z standard errors (binomial, on the observations plus the prior's
        weight); a negative z adds them."""
        w = self.prior_weight
        return [min(0.99, max(0.01, c - z * math.sqrt(c * (1 - c) / (t + w))))
                for c, t in zip(self.conditional(), self.tried, strict=True)]

    def without(self, part: AcceptanceStats) -> AcceptanceStats:
        """These observations less `part`'s, which are among them (a request's own record within
        everyone's). Exact while the two decayed alike (one request at a time); otherwise the
        older observations of `part` are over-subtracted a little, and counts are kept >= 0."""
        rest = AcceptanceStats(self.gamma, self.decay, self.prior, self.prior_weight)
        rest.tried = [max(0.0, t - pt) for t, pt in zip(self.tried, part.tried, strict=True)]
        rest.accepted = [min(t, max(0.0, a - pa)) for t, a, pa in zip(rest.tried, self.accepted, part.accepted, strict=True)]
        return rest

    def observed(self) -> list[float | None]:
        """Undecayed conditional acceptance per position (None where never tried)."""
        return [a / t if t else None for a, t in zip(self.total_accepted, self.total_tried, strict=True)]


def blend(own: AcceptanceStats | None, shared: AcceptanceStats, weight: float) -> AcceptanceStats:
    """One request's acceptance record for judging it: its own observations, plus everyone
    else's scaled to at most `weight` observations at each position (no record, or weight 0:
    everyone's). Everyone else's, not everyone's: on a fresh engine's first request the two are
    the same, and counting its rounds twice closed the gate after two rejected first positions."""
    if own is None or weight <= 0:
        return shared
    rest = shared.without(own)
    out = AcceptanceStats(shared.gamma, shared.decay, shared.prior, shared.prior_weight)
    for k, (t, a) in enumerate(zip(rest.tried, rest.accepted, strict=True)):
        scale = min(1.0, weight / t) if t else 0.0
        out.tried[k] = own.tried[k] + scale * t
        out.accepted[k] = own.accepted[k] + scale * a
    return out
