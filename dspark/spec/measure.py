"""Measure a `StepProfile` on the engine's own target, drafter and KV pool.

Target forwards of B tokens are timed as R = ceil(B / (gamma+1)) requests verifying
(gamma+1)-token rows at a representative context length (the shape of a speculative
step); drafter proposals are timed for R requests. Contexts are reserved in the real
paged caches under throw-away ids and freed afterwards; their contents do not matter for
timing, but the drafter's are written through its own `extend`, so that a drafter keeping
per-request state beside its cache (EAGLE-3/MTP's last feature) has it.
"""

from __future__ import annotations

import math

import torch

from dspark.drafters.base import ContextRow, ProposeInput
from dspark.engine.batch import BatchRow
from dspark.sampling import SamplingParams, SamplingRows
from dspark.spec.profile import StepProfile, grid, timed


def _reserve(pool, ids: list[str], length: int) -> None:
    for sid in ids:
        pool.append(sid, length)


def synthetic_context(engine, ids: list[str], length: int) -> list[ContextRow]:
    """`length` committed tokens per throw-away id, with zero tapped features: written through
    the drafter's own `extend`, so every drafter holds what `propose` reads for a real request."""
    taps, cfg = engine.runner.drafter.taps, engine.model.config
    feats = None
    if taps:
        feats = torch.zeros(length, len(taps) * cfg.hidden_size, device=engine.model.device, dtype=engine.model.dtype)
    return [ContextRow(sid, 0, [1] * length, feats) for sid in ids]


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

    def draft_time(inputs: list[ProposeInput]) -> float:
        rows = SamplingRows.same(len(inputs), SamplingParams(temperature=1.0), base.device)
        return timed(lambda: drafter.propose(inputs, rows), repeats, base.device)

    tokens = grid(budget)
    requests = grid(max_r)
    ids = [f"__profile{i}" for i in range(max_r)]
    dpool = getattr(drafter, "pool", None)
    c = ctx if dpool is None else max(1, min(ctx, (dpool.num_free_blocks // max_r) * dpool.block_size - gamma))
    inputs = [ProposeInput(sid, 1, c, [1] * (c + 1)) for sid in ids]
    with torch.inference_mode():
        verify_s = [verify_time(b) for b in tokens]
        try:
            drafter.extend(synthetic_context(engine, ids, c))  # the state a real request has when drafted
            draft_s = [draft_time(inputs[:r]) for r in requests]
        finally:
            for sid in ids:
                drafter.free(sid)
    return StepProfile(key=key, tokens=tokens, verify_s=verify_s, requests=requests, draft_s=draft_s)
