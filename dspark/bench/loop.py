"""Closed-loop load on an in-process engine: C clients, each sending its next request the
moment its previous one finishes, so C requests are always in flight (until the end).

    result = closed_loop(engine, jobs, concurrency=8, per_client=4, params=lambda i: SamplingParams(...))

Drives one `LLMEngine` with `add_request` / `step` only (no server), sampling after every
step the target KV blocks in use and the drafter's cache bytes, and the process's peak
resident memory over the run (the kernel's high-water mark, reset at the start where
/proc/self/clear_refs allows; otherwise the process-lifetime peak, and it says so).
Not a command: `dspark bench online` calls it (online.py).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dspark.bench.workload import Job


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


def closed_loop(engine, jobs: Sequence[Job], concurrency: int, params: Callable[[int], object],
                per_client: int | None = None, duration_s: float | None = None,
                on_finish: Callable[[], None] | None = None) -> LoopResult:
    """Run until every client has sent per_client requests (or until duration_s has passed
    at send time) and all of them finished. Jobs are used round-robin."""
    if (per_client is None) == (duration_s is None):
        raise ValueError("give exactly one of per_client and duration_s")
    res = LoopResult(rss_scope=reset_peak_rss())
    cuda = engine.model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    live: dict[str, tuple[int, Job]] = {}
    sent = [0] * concurrency
    counter = 0
    start = time.perf_counter()

    def send(client: int) -> None:
        nonlocal counter
        if per_client is not None and sent[client] >= per_client:
            return
        if duration_s is not None and time.perf_counter() - start >= duration_s:
            return
        job = jobs[counter % len(jobs)]
        req = engine.add_request(job.ids, params(counter))
        live[req.request_id] = (client, job)
        sent[client] += 1
        counter += 1

    for c in range(concurrency):
        send(c)
    idle = 0
    while live:
        touched = engine.step()
        res.steps += 1
        res.peak_kv_blocks = max(res.peak_kv_blocks, engine.kv.pool.num_used_blocks)
        if engine.drafter is not None:
            res.peak_drafter_cache_bytes = max(res.peak_drafter_cache_bytes, engine.drafter.cache_bytes_in_use())
        idle = 0 if touched else idle + 1
        if idle > 1000:
            raise RuntimeError(f"the engine made no progress in 1000 steps with {len(live)} requests in flight")
        for req in touched:
            if not req.is_finished:
                continue
            client, job = live.pop(req.request_id)
            out = engine.output(req)
            engine.requests.pop(req.request_id, None)
            res.outputs.append({**out.stats, "dataset": job.dataset, "domain": job.domain, "client": client})
            if on_finish is not None:
                on_finish()
            send(client)
    res.wall_s = time.perf_counter() - start
    res.peak_rss_bytes = peak_rss_bytes()
    if cuda:
        res.peak_gpu_bytes = torch.cuda.max_memory_allocated()
    return res
