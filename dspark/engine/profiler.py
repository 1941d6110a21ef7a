"""Measure a `StepProfile` on the engine's own target, drafter and KV pool, and cache it.

Target forwards of B tokens are timed as R = ceil(B / (gamma+1)) requests verifying (gamma+1)-token rows at a
representative context length (the shape of a speculative step), and, for an engine that prices forwards by
their rows (`GateConfig.rows`), on the request grid in the row shapes the engine's steps have (`row_shapes`: R
one-token rows, one of them verifying, half of them verifying a block, all of them), which price a step whose
rows are known (`StepProfile.raw`); drafter proposals are timed for R requests, at full depth and, for a
drafter that cuts exactly, at one position. Proposals are timed with sampling rows (temperature 1) over the
drafter's draft vocabulary; one that drafts batches that sample over every token
(`NeuralDrafter.select_vocab`) is also timed drafting over every token, for `sampled_s`. Greedy batches are
priced by the sampling rows' time, which is more than an argmax block costs (13 against 25 ms for 64 requests,
dspark-small): timed with greedy rows, the proposal's lower price opened the gate at 16 mixed requests where
drafting lost, 0.92x plain decoding against 1.00x (`docs/results/online/greedy-price/`), since the gate's step
model misses what a drafted step pays around the proposal under load (`docs/benchmarks.md`); a drafter that
refines greedy proposals (`DrafterConfig.refine`: its block run again over its draft) is timed with greedy
rows too, and priced at the dearer of the two. Each point is the least of a few
calls, taken in rounds that call every point in turn (`least`). Contexts are reserved in the real
paged caches under throw-away ids and freed afterwards; their contents do not matter for
timing, but the drafter's are written through its own `extend`, so that a drafter keeping
per-request state beside its cache (EAGLE-3/MTP's last feature) has it.

Profiles are cached in `$DSPARK_PROFILE_DIR` (default `~/.cache/dspark/profiles`), keyed by
everything their grids or timings depend on, the code that runs a step included (`profile_key`, `step_code`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch

from dspark.config import PAD_ROWS
from dspark.drafters.base import ContextRow, ProposeInput
from dspark.engine.batch import BatchRow
from dspark.engine.speculative import SpeculativeRunner
from dspark.sampling import SamplingParams, SamplingRows
from dspark.spec.profile import StepProfile

CACHE_ENV = "DSPARK_PROFILE_DIR"
STEP_CODE = ("models", "drafters", "kv_cache.py", "sampling.py", "engine/batch.py", "engine/runner.py",
             "engine/speculative.py", "engine/profiler.py", "spec/profile.py")  # what a step's cost depends on


def digest(paths: Sequence[Path]) -> str:
    """A short hash of these files' bytes (every .py file under a folder), in a fixed order."""
    files = sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py")))
    h = hashlib.sha1()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


@functools.cache
def step_code() -> str:
    """The digest of the package's code that runs and times a step (`STEP_CODE`): part of every profile's key, so
    a profile measured by other code is measured again. A hand-kept revision number was once left unchanged
    when products began running 32 rows at a time, and serving kept a profile that underpriced large steps."""
    root = Path(__file__).resolve().parent.parent
    return digest([root / name for name in STEP_CODE])


def cache_dir() -> Path:
    """Where profiles are cached: $DSPARK_PROFILE_DIR, else ~/.cache/dspark/profiles (read at
    each call, so a test or a second deployment can point it elsewhere)."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/dspark/profiles").expanduser()


def profile_key(model: str, drafter: str, device: str, dtype: str, gamma: int, budget: int, max_seqs: int,
                rows: bool = False, pad_rows: int = PAD_ROWS) -> str:
    """Cache key of a profile: everything its grids or timings depend on (max_seqs bounds the
    request grid, so a profile measured for a one-request engine never serves a 64-request one; rows: whether it
    times the row shapes, which only an engine pricing by them (`GateConfig.rows`) measures, and which depend on
    how the engine lays out their attention grids, `EngineConfig.pad_rows`)."""
    raw = (f"{model}|{drafter}|{device}|{dtype}|{gamma}|{budget}|{max_seqs}|{torch.get_num_threads()}|"
           f"{torch.__version__}|{step_code()}" + (f"|rows{pad_rows}" if rows else ""))
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def grid(limit: int) -> list[int]:
    out, x = [], 1
    while x < limit:
        out.append(x)
        x = x + 1 if x < 4 else int(x * 1.5)
    return sorted(set(out + [limit]))


def once(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one fn() call (the device synchronised on both sides)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def least(points: Sequence[Callable[[], float]], repeats: int) -> list[float]:
    """Each point's least seconds (a point times one call of its own), after one warm-up call of
    each, over `repeats` rounds that call every point once in turn. Noise only ever adds time, so
    the least is kept; and the rounds spread a point's repeats over the whole measurement: timed
    back to back, one burst of noise (another process, a cold cache) longer than a few calls
    inflated every repeat of the points it met and left a kink in the profile (verifying 9 tokens
    measured 1.4 one-token forwards where a drafted step's verify costs about one, dspark-small), on
    which the gate kept drafting off at one request."""
    for point in points:
        point()
    best = [math.inf] * len(points)
    for _ in range(repeats):
        for i, point in enumerate(points):
            best[i] = min(best[i], point())
    return best


def load_cached(key: str) -> StepProfile | None:
    path = cache_dir() / f"{key}.json"
    return StepProfile.from_json(path.read_text()) if path.is_file() else None


def save_cached(profile: StepProfile) -> Path:
    path = cache_dir() / f"{profile.key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json())
    return path


def cached_or_measured(engine, runner: SpeculativeRunner, key: str, refresh: bool = False,
                       rows: bool = False) -> StepProfile:
    """The cached profile under key, else (or when refresh) one measured now and cached (rows: with row shapes)."""
    prof = None if refresh else load_cached(key)
    if prof is None:
        prof = measure(engine, runner, key, rows=rows)
        save_cached(prof)
    return prof



def _reserve(pool, ids: list[str], length: int) -> None:
    for sid in ids:
        pool.append(sid, length)


def synthetic_context(engine, runner: SpeculativeRunner, ids: list[str], length: int) -> list[ContextRow]:
    """`length` committed tokens per throw-away id, with zero tapped features: written through
    the drafter's own `extend`, so every drafter holds what `propose` reads for a real request."""
    taps, cfg = runner.drafter.taps, engine.model.config
    feats = None
    if taps:
        feats = torch.zeros(length, len(taps) * cfg.hidden_size, device=engine.model.device, dtype=engine.model.dtype)
    return [ContextRow(sid, 0, [1] * length, feats) for sid in ids]


def measure(engine, runner: SpeculativeRunner, key: str, context_len: int = 256, repeats: int = 5,
            rows: bool = False) -> StepProfile:
    """Time target forwards on the token grid and drafter proposals on the request grid; with rows, target
    forwards in the engine's row shapes on the request grid too (for an engine that prices by them)."""
    base, drafter = runner.base, runner.drafter.measured  # a router's profile times its neural part
    gamma, pool = drafter.gamma, engine.kv.pool
    free, bs = pool.num_free_blocks, pool.block_size
    budget = min(engine.cfg.max_num_batched_tokens, free * bs // 2)
    max_r = min(engine.cfg.max_num_seqs, budget, max(1, free // 2))
    ctx = max(1, min(context_len, engine.max_model_len - gamma - 2))
    taps = drafter.taps

    def verify_time(b: int) -> float:
        """One forward of b tokens in (gamma+1)-token rows."""
        r = min(math.ceil(b / (gamma + 1)), max(1, free // 2))  # requests that fit in the free pool
        return rows_time([b // r + (1 if i < b % r else 0) for i in range(r)])

    def rows_time(sizes: list[int]) -> float:
        """One forward of these rows (one request each; their slots held only while it runs)."""
        r = len(sizes)
        c = max(1, min(ctx, (free // r) * bs - max(sizes)))  # context that still fits
        ids = [f"__profile{i}" for i in range(r)]
        _reserve(pool, ids, c + max(sizes))
        rows = [BatchRow(sid, [1] * n, c + n, n) for sid, n in zip(ids, sizes, strict=True)]
        try:
            return once(lambda: base.target_forward(rows, taps), base.device)
        finally:
            for sid in ids:
                pool.free(sid)

    split = getattr(drafter, "splits_vocab", False)

    refines = bool(drafter.config.refine)

    def draft_time(inputs: list[ProposeInput], depth: int | None = None, every_token: bool = False) -> float:
        rows = SamplingRows.same(len(inputs), SamplingParams(temperature=1.0), base.device)
        with drafter.hold_vocab(narrow=not every_token) if split else nullcontext():
            sampled = once(lambda: drafter.propose(inputs, rows, depth), base.device)
        if not refines or every_token:
            return sampled
        # a drafter that refines greedy proposals runs its block again for them: the dearer of the two kinds
        greedy = SamplingRows.same(len(inputs), SamplingParams(temperature=0.0), base.device)
        return max(sampled, once(lambda: drafter.propose(inputs, greedy, depth), base.device))

    tokens = grid(budget)
    requests = grid(max_r)
    shapes = {r: row_shapes(r, gamma, budget) for r in requests if rows and r <= max(1, free // 2)}
    ids = [f"__profile{i}" for i in range(max_r)]
    dpool = getattr(drafter, "pool", None)
    c = ctx if dpool is None else max(1, min(ctx, (dpool.num_free_blocks // max_r) * dpool.block_size - gamma))
    inputs = [ProposeInput(sid, 1, c, [1] * (c + 1)) for sid in ids]
    with torch.inference_mode():
        verify_s = least([partial(verify_time, b) for b in tokens], repeats)
        timed = iter(least([partial(rows_time, sizes) for r in shapes for sizes in shapes[r]], repeats))
        row_s = [[next(timed) for _ in shapes[r]] for r in shapes]  # back into one list per row count
        try:
            drafter.extend(synthetic_context(engine, runner, ids, c))  # the state a real request has when drafted
            # one position is timed only where a step may draft it: a router's neural part cuts, the router does not
            cuts = runner.drafter.cuts_exactly and gamma > 1
            # a drafter with an early exit (or a pair) also times two positions: one is off the line from there to
            # the full block
            depths = ((None, 1, 2) if drafter.exits and gamma > 2 else (None, 1)) if cuts else (None,)
            points = [partial(draft_time, inputs[:r], depth) for depth in depths for r in requests]
            points += [partial(draft_time, inputs[:r], None, True) for r in requests] if split else []
            drafted = least(points, repeats)
            n = len(requests)
            by_depth = {d: drafted[i * n:(i + 1) * n] for i, d in enumerate(depths)}
            draft_s, sampled_s = by_depth[None], drafted[-n:] if split else []
            shallow_s, pair_s = by_depth.get(1, []), by_depth.get(2, [])
        finally:
            for sid in ids:
                drafter.free(sid)
    return StepProfile(key=key, tokens=tokens, verify_s=verify_s, requests=requests, draft_s=draft_s, gamma=gamma,
                       shallow_s=shallow_s, pair_s=pair_s, sampled_s=sampled_s, rows=list(shapes),
                       row_extra=[[sum(s) - r for s in shapes[r]] for r in shapes], row_s=row_s)


def row_shapes(r: int, gamma: int, budget: int) -> list[list[int]]:
    """The row sizes timed for r requests, one row each, as a drafted step lays them out: every row one token
    (a plain step); one row verifying one draft token beside one-token rows (the second attention grid's
    fixed cost); half the rows verifying a full block; every row verifying one. Those over the token budget,
    or repeating an earlier one's size, are left out."""
    half = (r + 1) // 2
    shapes = [[1] * r, [2] + [1] * (r - 1), [gamma + 1] * half + [1] * (r - half), [gamma + 1] * r]
    out: list[list[int]] = []
    for sizes in shapes:
        if sum(sizes) <= budget and all(sum(sizes) != sum(o) for o in out):
            out.append(sizes)
    return out
