"""The throughput-interactivity frontier (Fig. 7 analog) read at SLAs and matched throughput.

Each configuration's online rows form a curve through (per-user tok/s, aggregate tok/s),
one point per concurrency, joined in concurrency order by straight lines. Two readings:

- throughput at an SLA s: the most aggregate throughput anywhere on the curve where the
  per-user speed is at least s (a segment crossing s contributes its interpolated point);
- per-user speed at a matched throughput X: the fastest per-user speed on the curve where
  the aggregate throughput is at least X.

Both are None when the curve never reaches the level (the configuration cannot serve it).
Default levels come from the reference configuration's own points (normally `none`), so
every ratio compares two configurations at a load the reference really ran.
"""

from __future__ import annotations

from collections.abc import Sequence

from dspark.bench.summary import ratio

SPEED, THROUGHPUT = "per_user_tok_s_mean", "throughput_tok_s"


def curve(rows: Sequence[dict], config: str) -> list[tuple[float, float]]:
    """(per-user speed, throughput) of one configuration, in concurrency order."""
    pts = sorted((r["concurrency"], r.get(SPEED), r.get(THROUGHPUT)) for r in rows if r["config"] == config)
    return [(s, t) for _, s, t in pts if s is not None and t is not None]


def best_along(points: Sequence[tuple[float, float]], floor: float) -> float | None:
    """max y over the polyline through points (x, y) restricted to x >= floor."""
    best = [y for x, y in points if x >= floor]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if (x0 - floor) * (x1 - floor) < 0:  # the segment crosses the floor
            best.append(y0 + (floor - x0) / (x1 - x0) * (y1 - y0))
    return max(best) if best else None


def throughput_at_sla(points: Sequence[tuple[float, float]], sla: float) -> float | None:
    return best_along(points, sla)


def speed_at_throughput(points: Sequence[tuple[float, float]], level: float) -> float | None:
    return best_along([(t, s) for s, t in points], level)


def summarize(rows: Sequence[dict], reference: str, slas: Sequence[float] | None = None,
              levels: Sequence[float] | None = None) -> dict:
    """{'reference', 'sla': [...], 'matched': [...]} with values and ratios vs the reference."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    curves = {c: curve(rows, c) for c in configs}
    ref = curves.get(reference, [])
    slas = sorted(set(slas if slas is not None else (s for s, _ in ref)))
    levels = sorted(set(levels if levels is not None else (t for _, t in ref)))

    def entry(level: float, read) -> dict:
        values = {c: read(curves[c], level) for c in configs}
        base = values.get(reference)
        return {"level": level, "values": values,
                "ratio_vs_reference": {c: ratio(v, base) for c, v in values.items()}}

    return {"reference": reference,
            "sla": [entry(s, throughput_at_sla) for s in slas],
            "matched": [entry(x, speed_at_throughput) for x in levels]}


def ratios_by_concurrency(rows: Sequence[dict], reference: str) -> list[dict]:
    """Throughput and per-user speed of every row over the reference's at the same concurrency."""
    base = {r["concurrency"]: r for r in rows if r["config"] == reference}
    out = []
    for r in rows:
        b = base.get(r["concurrency"])
        if b is None or r["config"] == reference:
            continue
        out.append({"config": r["config"], "concurrency": r["concurrency"],
                    "throughput_ratio": ratio(r.get(THROUGHPUT), b.get(THROUGHPUT)),
                    "per_user_ratio": ratio(r.get(SPEED), b.get(SPEED)),
                    "throughput_ratio_runs": paired(r.get("throughput_runs"), b.get("throughput_runs"))})
    return out


def paired(runs: Sequence[float] | None, base: Sequence[float] | None) -> list[float] | None:
    """Throughput ratio of each repeat over the reference's same repeat (the two ran next to each
    other in time), so the spread of the ratio shows apart from the machine's drift."""
    if not runs or not base or len(runs) != len(base) or len(runs) < 2:
        return None
    return [ratio(a, b) for a, b in zip(runs, base, strict=True)]
