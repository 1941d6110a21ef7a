"""Admission, batching and preemption. No tensor maths here: only queues and KV blocks.

Each step the scheduler picks the requests that run and how many of their known tokens
they feed (`num_new_tokens`: a prefill chunk, or 1 for the anchor of a decoding request),
within `max_num_batched_tokens` and `max_num_seqs`, and reserves KV blocks for those
tokens plus `num_lookahead` draft slots. Running requests go first (oldest first), then
waiting ones (chunked prefill shares the step's token budget). When blocks run out, the
newest running request is preempted: its blocks are freed and it goes back to the front
of the queue to be recomputed later. A request is never dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dspark.config import EngineConfig
from dspark.engine.request import Request, Status
from dspark.kv_cache import BlockPool


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # known tokens fed this step (KV written for them)
    num_lookahead: int = 0  # extra KV slots reserved for draft tokens

    @property
    def samples(self) -> bool:
        """Whether this step ends the request's known tokens, so it emits a new token."""
        return self.request.num_computed + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_lookahead for s in self.scheduled)


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: BlockPool, lookahead: int = 0) -> None:
        self.cfg, self.pool, self.lookahead = cfg, pool, lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lookahead: int | None = None) -> SchedulerOutput:
        """Pick this step's batch; `lookahead` overrides the draft slots per decoding request."""
        look = self.lookahead if lookahead is None else lookahead
        out, budget = SchedulerOutput(), self.cfg.max_num_batched_tokens
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.status is not Status.RUNNING or budget <= 0:
                continue
            n = min(req.num_pending, budget)
            extra = self._lookahead(req, n, look, budget)
            if not self._reserve(req, n + extra, out):
                continue  # req itself was preempted
            out.scheduled.append(ScheduledRequest(req, n, extra))
            budget -= n + extra
        while self.waiting and len(self.running) < self.cfg.max_num_seqs and budget > 0:
            req = self.waiting[0]
            n = min(req.num_pending, budget)
            extra = self._lookahead(req, n, look, budget)
            if not self.pool.can_append(req.request_id, n + extra):
                break  # wait for blocks; never preempt to admit
            self.waiting.popleft()
            self.pool.append(req.request_id, n + extra)
            req.status = Status.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, extra))
            budget -= n + extra
        return out

    def _lookahead(self, req: Request, n: int, look: int, budget: int) -> int:
        if look <= 0 or req.num_computed + n != req.num_tokens:
            return 0  # only a request about to decode drafts
        room = min(req.remaining_tokens - 1, req.max_model_len - req.num_tokens)
        return max(0, min(look, budget - n, room))

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Append n KV slots to req, preempting the newest other requests if needed."""
        while not self.pool.can_append(req.request_id, n):
            done = {id(s.request) for s in out.scheduled}
            victims = [r for r in self.running if r is not req and id(r) not in done]
            victim = max(victims, key=lambda r: r.arrival) if victims else req
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        self.pool.append(req.request_id, n)
        return True

    def preempt(self, req: Request) -> None:
        self.pool.free(req.request_id)
        self.running.remove(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.stats.preemptions += 1
        self.waiting.appendleft(req)

    def commit(self, req: Request, num_computed: int) -> None:
        """After a step: req's cache holds num_computed tokens; roll back the rest."""
        req.num_computed = num_computed
        self.pool.truncate(req.request_id, num_computed)

    def finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.pool.free(req.request_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
