"""Turn per-request stats (`RequestOutput.stats`, see engine/request.py) into benchmark rows.

Pure functions, no engine: what `dspark bench offline` and `dspark bench online` report.

- tau: emitted tokens per *decode* round, recovered/bonus token included. The engine's own
  `stats["tau"]` also counts the prefill round (one token); here that round is left out, so
  plain decoding gives exactly 1.0 and short generations are not pulled towards 1.
- conditional acceptance at draft position k (Fig. 2): sum of accepted_per_position[k] over
  sum of verified_per_position[k], where the latter counts the rounds in which position k
  was verified with every earlier position accepted (so k is not penalised for them).
- verification budget: draft tokens sent to the target per request per decode round (mean
  l_r); the target itself processes 1 + l_r tokens for the request.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence


def conditional_acceptance(stats: Iterable[dict]) -> list[float | None]:
    """Per draft position k = 1.., accepted / tried summed over requests (None: never tried)."""
    acc: list[int] = []
    tried: list[int] = []
    for s in stats:
        a, v = s.get("accepted_per_position", []), s.get("verified_per_position", [])
        width = max(len(a), len(v))
        acc += [0] * (width - len(acc))
        tried += [0] * (width - len(tried))
        for k, n in enumerate(a):
            acc[k] += n
        for k, n in enumerate(v):
            tried[k] += n
    return [a / t if t else None for a, t in zip(acc, tried, strict=True)]


def decode_rounds(s: dict) -> int:
    """Rounds after the one that produced the first token."""
    return max(0, s.get("rounds", 0) - 1)


def speculation(stats: Sequence[dict]) -> dict:
    """tau, acceptance and verification budget over a set of requests (token-weighted)."""
    rounds = sum(decode_rounds(s) for s in stats)
    emitted = sum(max(0, s.get("completion_tokens", 0) - 1) for s in stats if s.get("rounds", 0) > 0)
    verified = sum(s.get("verified_tokens", 0) for s in stats)
    accepted = sum(s.get("accepted_tokens", 0) for s in stats)
    return {
        "tau": emitted / rounds if rounds else None,
        "decode_rounds": rounds,
        "completion_tokens": sum(s.get("completion_tokens", 0) for s in stats),
        "draft_tokens": sum(s.get("draft_tokens", 0) for s in stats),
        "verified_tokens": verified,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / verified if verified else None,
        "budget": verified / rounds if rounds else None,
    }


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _p50(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def latency(stats: Sequence[dict], wall_s: float) -> dict:
    """Aggregate output tok/s, per-user decode tok/s and TTFT over one closed-loop run."""
    speeds = [s["decode_tokens_per_s"] for s in stats if s.get("decode_tokens_per_s")]
    ttfts = [s["ttft_s"] for s in stats if s.get("ttft_s") is not None]
    tokens = sum(s.get("completion_tokens", 0) for s in stats)
    return {
        "requests": len(stats),
        "wall_s": wall_s,
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else None,
        "per_user_tok_s_mean": _mean(speeds),
        "per_user_tok_s_p50": _p50(speeds),
        "ttft_mean_s": _mean(ttfts),
        "ttft_p50_s": _p50(ttfts),
    }


def macro(rows: Sequence[dict], key: str, group: str = "domain") -> dict[str, float]:
    """Mean of rows[key] per group (datasets weigh equally within a domain), None values skipped."""
    out: dict[str, list[float]] = {}
    for r in rows:
        if r.get(key) is not None:
            out.setdefault(r[group], []).append(r[key])
    return {g: statistics.fmean(v) for g, v in out.items()}


def mean_curves(curves: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Position-wise mean of several acceptance curves, ignoring missing positions."""
    width = max((len(c) for c in curves), default=0)
    cols = [[c[k] for c in curves if k < len(c) and c[k] is not None] for k in range(width)]
    return [statistics.fmean(col) if col else None for col in cols]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
