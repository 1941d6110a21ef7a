"""Verification policies: how many draft tokens l_r of each request the target verifies.

`none` (plain decoding), `static:k`, `threshold:t`, `dspark` (Algorithm 1 with the early
stop that keeps it lossless) and `dspark-async` (budget K from a global search over the
confidences of two steps earlier, then the top-K current candidates). Every policy sees
calibrated conditional confidences c [R, gamma] and per-request caps (draft slots reserved,
positions the drafter really proposed). Costs come from the step profile: a step that
verifies B tokens after drafting for R requests takes draft(R) + verify(B) seconds, so the
throughput being maximised is expected emitted tokens per second of the *whole* step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

CostFn = Callable[[int, int], float]  # (decode requests R, forward tokens B) -> seconds


@dataclass(frozen=True)
class Candidate:
    survival: float  # a_{r,j}
    request: int
    position: int  # j, 1-based


def candidates(conf: torch.Tensor, caps: Sequence[int]) -> list[Candidate]:
    """All (r, j) with j <= cap_r and a_{r,j} > 0, sorted by a desc, ties by smaller j."""
    surv = torch.cumprod(conf.double(), dim=1).tolist()
    out = [Candidate(surv[r][j - 1], r, j) for r, cap in enumerate(caps) for j in range(1, cap + 1)
           if surv[r][j - 1] > 0]
    out.sort(key=lambda c: (-c.survival, c.position))
    return out


def lengths_from(chosen: Sequence[Candidate], num_requests: int) -> list[int]:
    ell = [0] * num_requests
    for c in chosen:
        ell[c.request] = max(ell[c.request], c.position)
    return ell


def algorithm1(cands: Iterable[Candidate], num_requests: int, other_tokens: int, cost: CostFn,
               plain_rows: int = 0) -> int:
    """Number of leading candidates Algorithm 1 admits (greedy walk, early stop). plain_rows: decoding
    requests in the same forward that were not drafted for; each emits one token, as a drafted one does."""
    tau, batch = float(num_requests + plain_rows), num_requests + plain_rows + other_tokens
    best = tau / cost(num_requests, batch)
    admitted = 0
    for i, c in enumerate(cands):
        tau += c.survival
        theta = tau / cost(num_requests, batch + i + 1)
        if theta > best:
            best, admitted = theta, i + 1
        else:
            break  # the early stop: never look at candidates past the first loss
    return admitted


def global_best(survivals: Sequence[float], num_requests: int, other_tokens: int, cost: CostFn,
                plain_rows: int = 0) -> int:
    """Unconstrained search over sorted survivals (only safe on stale confidences)."""
    tau, batch = float(num_requests + plain_rows), num_requests + plain_rows + other_tokens
    best, best_k = tau / cost(num_requests, batch), 0
    for i, s in enumerate(sorted(survivals, reverse=True)):
        tau += s
        theta = tau / cost(num_requests, batch + i + 1)
        if theta > best:
            best, best_k = theta, i + 1
    return best_k


class Policy:
    name = "base"
    needs_cost = False
    deepest: int | None = None  # the most positions it ever verifies (None: any), so no deeper draft is needed

    def choose(self, conf: torch.Tensor, caps: Sequence[int], other_tokens: int, cost: CostFn,
               plain_rows: int = 0) -> list[int]:
        """l_r per drafted request. other_tokens: prefill tokens in the same forward; plain_rows: decoding
        requests in it that were not drafted for (the gate's choice); cost(R drafted, B tokens) seconds."""
        raise NotImplementedError


class NoSpeculation(Policy):
    name = "none"

    def choose(self, conf, caps, other_tokens, cost, plain_rows=0):
        return [0] * len(caps)


class Static(Policy):
    def __init__(self, k: int) -> None:
        self.k, self.name, self.deepest = k, f"static:{k}", k

    def choose(self, conf, caps, other_tokens, cost, plain_rows=0):
        return [min(self.k, c) for c in caps]


class Threshold(Policy):
    def __init__(self, t: float) -> None:
        self.t, self.name = t, f"threshold:{t}"

    def choose(self, conf, caps, other_tokens, cost, plain_rows=0):
        surv = torch.cumprod(conf.double(), dim=1)
        keep = (surv >= self.t).long().cumprod(1).sum(1).tolist()
        return [min(k, c) for k, c in zip(keep, caps, strict=True)]


class DSpark(Policy):
    """Algorithm 1: global sort by prefix survival, greedy admission, early stop."""

    name, needs_cost = "dspark", True

    def choose(self, conf, caps, other_tokens, cost, plain_rows=0):
        cands = candidates(conf, caps)
        return lengths_from(cands[: algorithm1(cands, len(caps), other_tokens, cost, plain_rows)], len(caps))


class DSparkAsync(Policy):
    """Budget K from the confidences of two steps earlier; admit the current top-K."""

    name, needs_cost = "dspark-async", True

    def __init__(self, lag: int = 2) -> None:
        self.lag = lag
        self.history: deque[tuple[list[float], int, int]] = deque(maxlen=lag)  # (survivals, R drafted, plain rows)

    def choose(self, conf, caps, other_tokens, cost, plain_rows=0):
        cands = candidates(conf, caps)
        if len(self.history) == self.lag:
            old, old_r, old_plain = self.history[0]
            budget = global_best(old, old_r, other_tokens, cost, old_plain)
        else:  # warm-up: the synchronous, causal rule
            budget = algorithm1(cands, len(caps), other_tokens, cost, plain_rows)
        self.history.append(([c.survival for c in cands], len(caps), plain_rows))
        return lengths_from(cands[:budget], len(caps))


def make_policy(spec: str) -> Policy:
    """Parse 'none', 'static:k', 'threshold:t', 'dspark', 'dspark-async'."""
    name, _, arg = spec.partition(":")
    try:
        if name == "none" and not arg:
            return NoSpeculation()
        if name == "static" and int(arg) >= 0:
            return Static(int(arg))
        if name == "threshold" and 0.0 <= float(arg) <= 1.0:
            return Threshold(float(arg))
        if name == "dspark" and not arg:
            return DSpark()
        if name == "dspark-async" and not arg:
            return DSparkAsync()
    except ValueError:
        pass
    raise ValueError(f"unknown policy {spec!r}; expected none, static:K, threshold:T (0..1), dspark, dspark-async")
