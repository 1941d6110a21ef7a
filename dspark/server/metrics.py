"""Prometheus metrics of one server, all named `dspark_...`, on a per-app registry.

    metrics = ServerMetrics()              # its own CollectorRegistry, so apps never clash
    metrics.observe_request(meter, req.stats, now)   # after a step touched the request
    metrics.observe_verification_budget(n) # once per engine step
    metrics.observe_step(ran, engine.gate_state())  # once per engine step: did the drafter run, is the gate open
    body = metrics.render()                # what GET /metrics returns

Only the engine thread writes (prometheus_client is thread-safe, so /metrics may read at
any time). Counters grow by deltas of each request's `RequestStats`, so speculative
counters are live while a request runs, not only when it finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from dspark.engine.request import RequestStats

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5, 10, 20, 40)
CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass
class RequestMeter:
    """How much of one request's stats the metrics have counted already."""

    arrival: float  # perf_counter when the server received the request (TTFT starts here)
    last_token_time: float | None = None
    completion_tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    preemptions: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests_running = Gauge("dspark_requests_running", "Requests in the running batch", registry=r)
        self.requests_waiting = Gauge("dspark_requests_waiting", "Requests waiting for admission", registry=r)
        self.prompt_tokens = Counter("dspark_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("dspark_generation_tokens", "Tokens generated", registry=r)
        self.draft_tokens = Counter("dspark_draft_tokens", "Draft tokens proposed by the drafter", registry=r)
        self.verified_tokens = Counter("dspark_verified_tokens", "Draft tokens sent to the target", registry=r)
        self.accepted_tokens = Counter("dspark_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_position = Counter("dspark_accepted_tokens_per_position",
                                             "Draft tokens accepted, by draft position (1..gamma)",
                                             ["position"], registry=r)
        self.verified_per_position = Counter("dspark_verified_tokens_per_position",
                                             "Draft tokens verified, by draft position (1..gamma)",
                                             ["position"], registry=r)
        self.verification_budget = Histogram("dspark_verification_budget_tokens",
                                             "Tokens the target processes in one engine step",
                                             buckets=TOKEN_BUCKETS, registry=r)
        self.engine_steps = Counter("dspark_engine_steps", "Engine steps that ran, by whether the drafter ran in them",
                                    ["drafter"], registry=r)
        self.gate_open: Gauge | None = None  # registered at the first step a gate judged (`observe_step`)
        self.gate_probes: Counter | None = None
        self.mean_accepted_length = Gauge("dspark_mean_accepted_length",
                                          "tau: tokens emitted per decode round, over all requests so far",
                                          registry=r)
        self.ttft = Histogram("dspark_time_to_first_token_seconds", "From receipt to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dspark_inter_token_latency_seconds", "Time per output token after the first",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.kv_blocks_used = Gauge("dspark_kv_blocks_used", "KV-cache blocks in use", registry=r)
        self.kv_blocks_free = Gauge("dspark_kv_blocks_free", "KV-cache blocks free", registry=r)
        self.requests_finished = Counter("dspark_requests_finished", "Requests that ended, by finish reason",
                                         ["finish_reason"], registry=r)
        self.requests_rejected = Counter("dspark_requests_rejected", "Requests refused before generation, by cause",
                                         ["reason"], registry=r)
        self.preemptions = Counter("dspark_preemptions", "Times a running request was preempted (KV full)",
                                   registry=r)
        self.step_errors = Counter("dspark_engine_step_errors", "Engine steps that raised", registry=r)
        self._tokens = 0  # for tau over all requests
        self._rounds = 0

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- engine-thread observations ------------------------------------------------
    def observe_verification_budget(self, num_tokens: int) -> None:
        """Call once per engine step with the tokens of the target's forward: prefill chunks
        plus sum over requests of (1 + l_r) (just the anchors under plain decoding)."""
        self.verification_budget.observe(num_tokens)

    def observe_step(self, drafter_ran: bool, gate: tuple[bool, bool] | None) -> None:
        """Call once per engine step that ran: whether the drafter ran, and the gate's (open, probed) after the
        step (`LLMEngine.gate_state`; None: no gate)."""
        self.engine_steps.labels(drafter="ran" if drafter_ran else "skipped").inc()
        if gate is None:
            return
        if self.gate_open is None or self.gate_probes is None:  # a server without a gate shows neither
            self.gate_open = Gauge("dspark_gate_open", "1 while the never-slower gate judges drafting to pay, 0 "
                                   "while it decodes plainly", registry=self.registry)
            self.gate_probes = Counter("dspark_gate_probes", "Steps a closed gate drafted to measure acceptance "
                                       "again", registry=self.registry)
        self.gate_open.set(int(gate[0]))
        if gate[1]:
            self.gate_probes.inc()

    def observe_queues(self, running: int, waiting: int, kv_used: int, kv_free: int) -> None:
        self.requests_running.set(running)
        self.requests_waiting.set(waiting)
        self.kv_blocks_used.set(kv_used)
        self.kv_blocks_free.set(kv_free)

    def observe_request(self, meter: RequestMeter, stats: RequestStats, now: float) -> None:
        """Count what changed in stats since the meter last saw them."""
        new = stats.completion_tokens - meter.completion_tokens
        if new > 0:
            self.generation_tokens.inc(new)
            if meter.last_token_time is None:
                self.ttft.observe((stats.first_token_time or now) - meter.arrival)
            else:
                per_token = (now - meter.last_token_time) / new  # a spec round emits several at once
                for _ in range(new):
                    self.itl.observe(per_token)
            meter.last_token_time = now
        self._tokens += new
        self._rounds += stats.rounds - meter.rounds
        if self._rounds:
            self.mean_accepted_length.set(self._tokens / self._rounds)
        meter.completion_tokens, meter.rounds = stats.completion_tokens, stats.rounds
        for name in ("draft_tokens", "verified_tokens", "accepted_tokens", "preemptions"):
            delta = getattr(stats, name) - getattr(meter, name)
            if delta > 0:
                getattr(self, name).inc(delta)
            setattr(meter, name, getattr(stats, name))
        _count_positions(self.accepted_per_position, meter.accepted_per_position, stats.accepted_per_position)
        _count_positions(self.verified_per_position, meter.verified_per_position, stats.verified_per_position)


def _count_positions(counter: Counter, seen: list[int], current: list[int]) -> None:
    """Increment counter{position=k} by current[k-1] - seen[k-1]; seen catches up in place."""
    for k, value in enumerate(current):
        before = seen[k] if k < len(seen) else 0
        if value > before:
            counter.labels(position=str(k + 1)).inc(value - before)
    seen[:] = list(current)
