"""Closed-loop load on a running OpenAI-compatible server (`dspark serve`, or any server with
/v1/completions and streamed usage): the same C-clients loop as loop.py, over HTTP.

    dspark serve --drafter dspark --policy dspark &
    dspark bench online --url http://127.0.0.1:8000 --concurrency 1,4,16

Each request is one POST /v1/completions with `stream: true` and
`stream_options: {include_usage: true}`; the prompt travels as token ids (so both sides
see the same tokens). TTFT is the time to the first streamed text, the per-user speed is
(completion_tokens - 1) over the time between the first and the last text chunk, and the
speculative counters come from the final usage chunk (`verified_tokens`, `accepted_tokens`,
`tau`, which dspark adds to OpenAI's usage). While the load runs, /metrics is polled for
`dspark_kv_blocks_used` (the peak is reported when the server exposes it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

from dspark.bench.loop import LoopResult
from dspark.bench.workload import Job


def server_info(url: str) -> dict:
    """The first model card of /v1/models (id, and dspark's drafter and policy)."""
    import httpx

    cards = httpx.get(f"{url}/v1/models", timeout=30).json().get("data") or [{}]
    return cards[0]


async def one_request(client, url: str, body: dict) -> dict:
    """Stream one completion; returns stats shaped like RequestOutput.stats."""
    sent = time.perf_counter()
    first = last = None
    usage: dict = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            if any(c.get("text") for c in chunk.get("choices") or []):
                last = time.perf_counter()
                first = first or last
    done = time.perf_counter()
    n = int(usage.get("completion_tokens", 0))
    tau = usage.get("tau") or 0.0
    span = (last - first) if first is not None and last is not None else 0.0
    return {
        "prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": n,
        "rounds": round(n / tau) if tau else n,
        "verified_tokens": usage.get("verified_tokens", 0), "accepted_tokens": usage.get("accepted_tokens", 0),
        "draft_tokens": usage.get("draft_tokens", 0), "tau": tau,
        "ttft_s": None if first is None else first - sent, "latency_s": done - sent,
        "decode_tokens_per_s": (n - 1) / span if n >= 2 and span > 0 else None,
    }


async def _poll_kv(client, url: str, peak: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            text = (await client.get(f"{url}/metrics", timeout=5)).text
            for line in text.splitlines():
                if line.startswith("dspark_kv_blocks_used"):
                    peak[0] = max(peak[0], int(float(line.split()[-1])))
        except Exception:  # metrics are optional; the load must go on
            return
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except TimeoutError:
            pass


async def _closed_loop(url: str, jobs: Sequence[Job], concurrency: int, body: dict, per_client: int | None,
                       duration_s: float | None) -> LoopResult:
    import httpx

    res = LoopResult(rss_scope="server", peak_drafter_cache_bytes=None)
    counter = [0]
    start = time.perf_counter()
    peak, stop = [-1], asyncio.Event()  # -1: /metrics never answered

    async def client_loop(client, c: int) -> None:
        for _ in range(per_client if per_client is not None else 1 << 30):
            if duration_s is not None and time.perf_counter() - start >= duration_s:
                return
            job, i = jobs[counter[0] % len(jobs)], counter[0]
            counter[0] += 1
            req = {**body, "prompt": job.ids, "seed": body.get("seed", 0) + i}
            stats = await one_request(client, url, req)
            res.outputs.append({**stats, "dataset": job.dataset, "domain": job.domain, "client": c})

    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        poller = asyncio.create_task(_poll_kv(client, url, peak, stop))
        try:
            await asyncio.gather(*(client_loop(client, c) for c in range(concurrency)))
        finally:
            stop.set()
            await poller
    res.wall_s = time.perf_counter() - start
    res.peak_kv_blocks = peak[0] if peak[0] >= 0 else None
    return res


def closed_loop(url: str, jobs: Sequence[Job], concurrency: int, body: dict, per_client: int | None = None,
                duration_s: float | None = None) -> LoopResult:
    """body: the sampling fields of every request (model, max_tokens, temperature, ...)."""
    if (per_client is None) == (duration_s is None):
        raise ValueError("give exactly one of per_client and duration_s")
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    return asyncio.run(_closed_loop(url.rstrip("/"), jobs, concurrency, body, per_client, duration_s))
