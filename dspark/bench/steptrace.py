"""Every engine step of an online run, and what they cost by load: `dspark bench online --trace`.

Where a configuration wins or loses against plain decoding is decided step by step: how many requests a
step carried, whether the drafter ran for all of them, some (a gate's probe, a router's choice) or none,
whether prefill chunks shared the forward, and how long its phases took. With `--trace` every step of every
configuration is kept (`record`: one JSON line each, in `online-steps.jsonl` beside the report), and the report
gains a table that groups them by kind and by requests per step (`summarize`): tokens emitted per step,
milliseconds per step and tokens per second, so a drafted step at sixteen requests can be set against a
plain one at sixteen requests of the same run. A step's seconds are its own `LLMEngine.step()`, timed
around the call. Under a policy with the never-slower gate each record also carries the gate's state after the
step (`Gate.snapshot`: open or closed, a probe or not, the steps to the next probe, everyone's acceptance
estimates, the profile's online scales), and a second table counts, per configuration and load, the steps the
gate held open, its probes, and how often it closed and opened again (`gate_runs`, `gate_summary`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

KINDS = ("plain", "drafted", "partial", "prefill")  # the order of the table


def kind(rec: dict) -> str:
    """'prefill': prefill chunks shared the forward; else 'plain' (no draft verified), 'drafted' (the drafter
    ran for every request of the step) or 'partial' (for some: a probe, a selection, a router's share)."""
    if rec["forward"] > rec["requests"] + rec["verified"]:
        return "prefill"
    if not rec["drafted"]:
        return "plain"
    return "drafted" if rec["drafted"] == rec["requests"] else "partial"


def low(requests: int) -> int:
    """The power of two at or below requests (at least 1)."""
    return 1 << (max(1, requests).bit_length() - 1)


def bucket(requests: int) -> str:
    """Requests per step in powers of two: '1', '2-3', '4-7', ..."""
    n = low(requests)
    return "1" if n == 1 else f"{n}-{2 * n - 1}"


def record(step, seconds: float) -> dict:
    """One engine step (`StepOutput`) that took `seconds`, as a flat record."""
    return {"requests": len(step.plan.scheduled), "drafted": len(step.verified) if step.drafter_ran else 0,
            "verified": sum(step.verified.values()), "accepted": sum(step.accepted.values()),
            "forward": step.num_forward_tokens, "emitted": sum(len(t) for t in step.new_tokens.values()),
            "seconds": round(seconds, 6), "times": {k: round(v, 6) for k, v in step.times.items()},
            **({"gate": dict(step.gate)} if step.gate is not None else {})}


def summarize(records: Iterable[dict]) -> list[dict]:
    """Rows per (config, concurrency, kind, requests bucket), in that order: steps, tokens emitted per step,
    ms per step, tokens per second, and the mean forward, proposal and catch-up ms."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    order: dict[str, int] = {}
    for r in records:
        order.setdefault(r["config"], len(order))
        groups[(r["config"], r["concurrency"], KINDS.index(kind(r)), low(r["requests"]))].append(r)
    rows = []
    for (config, c, k, n), recs in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], *kv[0][1:])):
        seconds, emitted = sum(r["seconds"] for r in recs), sum(r["emitted"] for r in recs)
        phase = {p: 1000 * sum(r["times"].get(p, 0.0) for r in recs) / len(recs) for p in ("verify", "draft", "catch_up")}
        rows.append({"config": config, "concurrency": c, "kind": KINDS[k], "requests": bucket(n), "steps": len(recs),
                     "tokens_per_step": emitted / len(recs), "ms_per_step": 1000 * seconds / len(recs),
                     "tok_s": emitted / seconds if seconds > 0 else None,
                     "forward_ms": phase["verify"], "draft_ms": phase["draft"], "catch_up_ms": phase["catch_up"]})
    return rows


def markdown(rows: list[dict]) -> str:
    """The `summarize` rows as a markdown table."""
    head = ("| config | C | kind | requests per step | steps | tokens per step | ms per step | tok/s | forward ms | "
            "proposal ms | catch-up ms |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['config']} | {r['concurrency']} | {r['kind']} | {r['requests']} | {r['steps']} | "
             f"{r['tokens_per_step']:.2f} | {r['ms_per_step']:.1f} | "
             f"{'–' if r['tok_s'] is None else format(r['tok_s'], '.0f')} | {r['forward_ms']:.1f} | "
             f"{r['draft_ms']:.1f} | {r['catch_up_ms']:.1f} |" for r in rows]
    return head + "\n".join(lines) + "\n"


def gate_runs(records: Iterable[dict]) -> dict[tuple[str, int], list[dict]]:
    """The gate's states of the records that carry one, per (config, concurrency), in record order (empty: no
    gated configuration); what `gate_summary` counts and `plots.gate_timeline` draws."""
    runs: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in records:
        if "gate" in r:
            runs[(r["config"], r["concurrency"])].append(r["gate"])
    return dict(runs)


def gate_summary(runs: dict[tuple[str, int], list[dict]]) -> list[dict]:
    """A row per run of `gate_runs`: steps, the share judged open, probes, closes (an open verdict followed by a
    closed one), reopens (the reverse), and the first step judged closed, counting from 1 (None: never; 1: the
    run began closed, on what the warm-up taught it)."""
    rows = []
    for (config, c), gates in runs.items():
        flips = [(a["open"], b["open"]) for a, b in zip(gates, gates[1:], strict=False)]
        first = next((i + 1 for i, g in enumerate(gates) if not g["open"]), None)
        rows.append({"config": config, "concurrency": c, "steps": len(gates),
                     "open_share": sum(g["open"] for g in gates) / len(gates), "probes": sum(g["probe"] for g in gates),
                     "closes": flips.count((True, False)), "reopens": flips.count((False, True)), "first_closed": first})
    return rows


def gate_markdown(rows: list[dict]) -> str:
    """The `gate_summary` rows as a markdown table."""
    head = ("| config | C | steps | open | probes | closes | reopens | first step closed |\n"
            "|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['config']} | {r['concurrency']} | {r['steps']} | {r['open_share']:.0%} | {r['probes']} | "
             f"{r['closes']} | {r['reopens']} | {'–' if r['first_closed'] is None else r['first_closed']} |" for r in rows]
    return head + "\n".join(lines) + "\n"
