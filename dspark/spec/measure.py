"""Measure a `StepProfile` on the engine's own target, drafter and KV pool.

Target forwards of B tokens are timed as R = ceil(B / (gamma+1)) requests verifying
(gamma+1)-token rows at a representative context length (the shape of a speculative
step); drafter proposals are timed for R requests. Contexts are reserved in the real
paged caches under throw-away ids and freed afterwards; their contents do not matter for
timing.
"""

from __future__ import annotations

import math

import torch

from dspark.drafters.base import ProposeInput
from dspark.engine.batch import BatchRow
from dspark.sampling import SamplingParams, SamplingRows
from dspark.spec.profile import StepProfile, grid, timed


def _reserve(pool, ids: list[str], length: int) -> None:
    for sid in ids:
        pool.append(sid, length)


def measure(engine, key: str, context_len: int = 256, repeats: int = 5) -> StepProfile:
    runner = engine.runner
    base, drafter = runner.base, runner.drafter.measured  # a router's profile times its neural part
    gamma, pool = drafter.gamma, engine.kv.pool
    free, bs = pool.num_free_blocks, pool.block_size
    budget = min(engine.cfg.max_num_batched_tokens, free * bs // 2)
    max_r = min(engine.cfg.max_num_seqs, budget, max(1, free // 2))
    ctx = max(1, min(context_len, engine.max_model_len - gamma - 2))
    taps = drafter.taps

    def verify_time(b: int) -> float:
        r = min(math.ceil(b / (gamma + 1)), max(1, free // 2))  # requests that fit in the free pool
        sizes = [b // r + (1 if i < b % r else 0) for i in range(r)]
        c = max(1, min(ctx, (free // r) * bs - max(sizes)))  # context that still fits
        ids = [f"__profile{i}" for i in range(r)]
        _reserve(pool, ids, c + max(sizes))
        rows = [BatchRow(sid, [1] * n, c + n, n) for sid, n in zip(ids, sizes, strict=True)]
        try:
            return timed(lambda: base.target_forward(rows, taps), repeats, base.device)
        finally:
            for sid in ids:
                pool.free(sid)

    def draft_time(r: int) -> float:
        ids = [f"__profile{i}" for i in range(r)]
        dpool = getattr(drafter, "pool", None)
        c = ctx if dpool is None else max(1, min(ctx, (dpool.num_free_blocks // r) * dpool.block_size - gamma))
        if dpool is not None:
            _reserve(dpool, ids, c)
        inputs = [ProposeInput(sid, 1, c, [1] * c) for sid in ids]
        rows = SamplingRows.same(r, SamplingParams(temperature=1.0), base.device)
        try:
            return timed(lambda: drafter.propose(inputs, rows), repeats, base.device)
        finally:
            for sid in ids:
                drafter.free(sid)

    tokens = grid(budget)
    requests = grid(max_r)
    with torch.inference_mode():
        verify_s = [verify_time(b) for b in tokens]
        draft_s = [draft_time(r) for r in requests]
    return StepProfile(key=key, tokens=tokens, verify_s=verify_s, requests=requests, draft_s=draft_s)
