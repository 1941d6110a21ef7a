"""Closed-loop load on in-process engines: C clients, each sending its next request the
moment its previous one finishes, so C requests are always in flight (until the end).

    result = closed_loop(engine, jobs, concurrency=8, per_client=4, params=lambda i: SamplingParams(...))
    results = run_loops([ClosedLoop(plain, ...), ClosedLoop(spec, ...)])   # lockstep

A job that carries later turns (the `agent` workload's traces) is followed by its next turn, sent
by the same client as soon as the turn finishes (its prompt: the context so far, the model's
turn, the next message). A `ClosedLoop` drives one `LLMEngine` with `add_request` / `step` only (no server), one
`advance()` (one engine step, then refills) at a time, sampling after every step the target
KV blocks in use and the drafter's cache bytes. Its time is a `VirtualClock` that runs only
inside `advance()`, and the engine stamps its requests (arrival, first token, finish) with
that clock. So `run_loops` can step several loops in turn -- lockstep: one step of each
engine, round after round, in a fresh random order each round -- and each still measures only
its own work, while all of them see the same machine at every moment (a noisy neighbour slows
them alike, instead of landing on whichever configuration ran its whole pass at the time).
Alone, a loop's clock is the wall time of its run. `run_loops` also records the process's
peak resident memory (the kernel's high-water mark, reset at the start where
/proc/self/clear_refs allows; otherwise the process-lifetime peak, and it says so). Not a
command: `dspark bench online` calls it (online.py).
"""

from __future__ import annotations

import random
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dspark.bench import steptrace
from dspark.bench.workload import Job, follow


@dataclass
class LoopResult:
    outputs: list[dict] = field(default_factory=list)  # RequestOutput.stats + dataset, domain, client
    wall_s: float = 0.0
    steps: int = 0
    peak_kv_blocks: int | None = 0  # None: not observable (a server without the metric)
    peak_drafter_cache_bytes: int | None = 0
    peak_rss_bytes: int | None = None
    rss_scope: str = "run"  # "run": high-water mark reset at the start; "process": lifetime peak
    peak_gpu_bytes: int | None = None
    trace: list[dict] | None = None  # every engine step (`steptrace.record`), when the loop keeps them


def reset_peak_rss() -> str:
    """Reset the kernel's resident high-water mark of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "run"
    except OSError:
        return "process"


def peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class VirtualClock:
    """Seconds of `source` (the wall clock) that pass only between `run()` and `stop()`;
    calling it reads the time."""

    def __init__(self, source: Callable[[], float] = time.perf_counter) -> None:
        self.source = source
        self.elapsed = 0.0
        self._since: float | None = None

    def __call__(self) -> float:
        return self.elapsed + (0.0 if self._since is None else self.source() - self._since)

    def run(self) -> None:
        self._since = self.source()

    def stop(self) -> None:
        self.elapsed, self._since = self(), None


class ClosedLoop:
    """C closed-loop clients on one engine, advanced one engine step at a time. Stops when every
    client has sent per_client requests (or, at send time, duration_s of its clock have passed)
    and all of them finished. Jobs are used round-robin."""

    def __init__(self, engine, jobs: Sequence[Job], concurrency: int, params: Callable[[int], object],
                 per_client: int | None = None, duration_s: float | None = None,
                 on_finish: Callable[[], None] | None = None, trace: bool = False) -> None:
        if (per_client is None) == (duration_s is None):
            raise ValueError("give exactly one of per_client and duration_s")
        if concurrency < 1 or not jobs:
            raise ValueError("a closed loop needs at least one client and one job")
        self.engine, self.jobs, self.concurrency, self.params = engine, jobs, concurrency, params
        self.per_client, self.duration_s, self.on_finish = per_client, duration_s, on_finish
        self.clock = VirtualClock()
        self.result = LoopResult(trace=[] if trace else None)
        if trace and hasattr(engine.runner, "snapshots"):
            engine.runner.snapshots = True  # each step's record carries the gate's state
        self.live: dict[str, tuple[int, Job]] = {}
        self.sent = [0] * concurrency
        self.counter = 0
        self.idle = 0

    def begin(self) -> None:
        """Every client sends its first request."""
        self._timed(self._send_all)

    def advance(self) -> bool:
        """One engine step and the refills it causes; False once nothing is in flight."""
        if self.live:
            self._timed(self._step)
        return bool(self.live)

    def end(self) -> LoopResult:
        self.result.wall_s = self.clock.elapsed
        return self.result

    def _timed(self, work: Callable[[], object]) -> None:
        saved, self.engine.clock = self.engine.clock, self.clock
        self.clock.run()
        try:
            work()
            if self.engine.model.device.type == "cuda":
                torch.cuda.synchronize()  # the step's queued kernels belong to this loop's time
        finally:
            self.clock.stop()
            self.engine.clock = saved

    def _send_all(self) -> None:
        for client in range(self.concurrency):
            self._send(client)

    def _send(self, client: int, turn: Job | None = None) -> None:
        """The client's next job, or `turn`: the next turn of the trace it is in (always sent; a
        trace counts as one request towards per_client)."""
        if turn is None:
            if self.per_client is not None and self.sent[client] >= self.per_client:
                return
            if self.duration_s is not None and self.clock() >= self.duration_s:
                return
            self.sent[client] += 1
        job = turn or self.jobs[self.counter % len(self.jobs)]
        req = self.engine.add_request(job.ids, self.params(self.counter))
        self.live[req.request_id] = (client, job)
        self.counter += 1

    def _step(self) -> None:
        engine, res = self.engine, self.result
        start = time.perf_counter()
        step = engine.step()
        if res.trace is not None and step.ran:
            res.trace.append(steptrace.record(step, time.perf_counter() - start))
        touched = step.progressed
        res.steps += 1
        res.peak_kv_blocks = max(res.peak_kv_blocks, engine.kv.pool.num_used_blocks)
        if engine.drafter is not None:
            res.peak_drafter_cache_bytes = max(res.peak_drafter_cache_bytes, engine.drafter.cache_bytes_in_use())
        self.idle = 0 if touched else self.idle + 1
        if self.idle > 1000:
            raise RuntimeError(f"the engine made no progress in 1000 steps with {len(self.live)} requests in flight")
        for req in touched:
            if not req.is_finished:
                continue
            client, job = self.live.pop(req.request_id)
            out = engine.output(req)  # the engine retired it when it finished
            res.outputs.append({**out.stats, "dataset": job.dataset, "domain": job.domain, "client": client})
            if self.on_finish is not None:
                self.on_finish()
            self._send(client, follow(job, out.token_ids, req.stop_ids))


def run_loops(loops: Sequence[ClosedLoop], seed: int = 0) -> list[LoopResult]:
    """Run the loops to the end in lockstep (one step of each per round, round after round; a
    loop that has finished drops out) and return their results in the given order. Each round
    takes the loops in a fresh random order (seeded): in a fixed cycle an engine would always
    step right after the same other engine, and one whose step evicts the caches (a drafter's
    weights, a long verification) would slow its successor's every step, not everyone's alike."""
    if len({id(loop.engine) for loop in loops}) != len(loops):
        raise ValueError("loops run in lockstep need an engine each")
    scope = reset_peak_rss()
    cuda = any(loop.engine.model.device.type == "cuda" for loop in loops)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for loop in loops:
        loop.begin()
    rng = random.Random(seed)
    active = list(loops)
    while active:
        rng.shuffle(active)
        active = [loop for loop in active if loop.advance()]
    results = [loop.end() for loop in loops]
    peak = peak_rss_bytes()
    gpu = torch.cuda.max_memory_allocated() if cuda else None
    for res in results:
        res.rss_scope, res.peak_rss_bytes, res.peak_gpu_bytes = scope, peak, gpu
    return results


def closed_loop(engine, jobs: Sequence[Job], concurrency: int, params: Callable[[int], object],
                per_client: int | None = None, duration_s: float | None = None,
                on_finish: Callable[[], None] | None = None) -> LoopResult:
    """One engine's closed loop, run alone to the end."""
    return run_loops([ClosedLoop(engine, jobs, concurrency, params, per_client, duration_s, on_finish)])[0]
