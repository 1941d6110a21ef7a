"""The `agent` workload of `dspark bench offline | online`: multi-turn agent traces whose phases
(task kinds) differ, and the per-phase report (τ and tok/s per task kind and configuration, and
which drafter proposed the tokens).

A trace is an episode of `dspark.agent.generate` (code edits, log extraction, JSON edits, tool
calls, then a plan), built from the running interpreter's standard library (functions of a fixed
set of modules, read once) and the shipped GSM8K questions (planning). Its first turn is a user
message; when the model's turn finishes, the client sends the next request: the context so far,
the model's turn, then the next task as a `tool` message, so contexts grow turn by turn. A trace
ends after its last task, or earlier where the next context would not leave room for max_tokens
(the model's context length bounds the turns). Each turn is one request; its domain is its kind.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path

from dspark.agent.generate import IM_END, Episode, Sources, episodes, message
from dspark.agent.tasks import functions
from dspark.bench.prompts import load_dataset
from dspark.bench.summary import speculation
from dspark.bench.workload import Job

MODULES = ("json/decoder.py", "json/encoder.py", "string.py", "textwrap.py", "shlex.py", "fnmatch.py", "csv.py",
           "heapq.py", "bisect.py", "calendar.py", "difflib.py", "base64.py", "colorsys.py", "glob.py",
           "gettext.py", "ipaddress.py", "statistics.py", "urllib/parse.py")


def sources(max_functions: int = 400) -> Sources:
    """Standard-library functions (a fixed subset of modules) and GSM8K questions."""
    root = Path(sysconfig.get_paths()["stdlib"])
    fns: list[tuple[str, str]] = []
    for name in MODULES:
        path = root / name
        if path.is_file():
            fns += list(functions(path.read_text(encoding="utf-8", errors="replace")))
    math = [(p.text.split("\n")[0], "") for p in load_dataset("gsm8k")]
    return Sources(functions=fns[:max_functions], math=math)


def trace_job(tokenizer, ep: Episode, limit: int) -> Job | None:
    """The trace's first turn as a job carrying its later turns (None: the first does not fit)."""
    first = tokenizer.apply_chat_template([{"role": "user", "content": ep.turns[0].prompt}])
    ids = tokenizer.encode(first)
    if len(ids) > limit:
        return None
    later = tuple((t.kind, tuple(tokenizer.encode(f"{IM_END}\n" + message(i, t.prompt))))
                  for i, t in enumerate(ep.turns[1:], 1))
    return Job(ids, "agent", ep.turns[0].kind, later, limit)


def jobs(tokenizer, num_traces: int, limit: int, seed: int = 0) -> list[Job]:
    """num_traces traces (first turns; the rest follow in the loop), prompts at most `limit` tokens."""
    out = []
    for ep in episodes(sources(), num_traces * 2, seed):
        job = trace_job(tokenizer, ep, limit)
        if job is not None:
            out.append(job)
        if len(out) == num_traces:
            break
    return out


# ---- the per-phase report ---------------------------------------------------------------------
def phases(stats: Sequence[dict], **tags) -> list[dict]:
    """One row per task kind: τ, per-user decode tok/s, and draft / accepted tokens per drafter."""
    rows = []
    for kind in dict.fromkeys(s["domain"] for s in stats):
        mine = [s for s in stats if s["domain"] == kind]
        spec = speculation(mine)
        speeds = [s["decode_tokens_per_s"] for s in mine if s.get("decode_tokens_per_s")]
        rows.append({**tags, "kind": kind, "requests": len(mine), "tau": spec["tau"],
                     "tok_s": sum(speeds) / len(speeds) if speeds else None,
                     "completion_tokens": spec["completion_tokens"], "prompt_tokens": sum(s["prompt_tokens"] for s in mine),
                     "draft_by": _sum_by(mine, "draft_tokens_by"), "accepted_by": _sum_by(mine, "accepted_tokens_by")})
    return rows


def _sum_by(stats: Sequence[dict], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in stats:
        for name, n in s.get(key, {}).items():
            out[name] = out.get(name, 0) + n
    return out


def carried(row: dict) -> str:
    """Which drafter's tokens were accepted, as shares ('suffix 80%, dspark 20%'; '–' when none)."""
    acc = row["accepted_by"]
    total = sum(acc.values())
    if not total:
        return "–"
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(acc.items(), key=lambda kv: -kv[1]))


def markdown(rows: Sequence[dict], group: Sequence[str]) -> str:
    """The per-phase table: one line per (group..., kind)."""
    from dspark.report import cell, table

    head = [*group, "task kind", "requests", "mean prompt tokens", "τ", "per-user tok/s", "accepted tokens by drafter"]
    body = [[*(r[g] for g in group), r["kind"], r["requests"], round(r["prompt_tokens"] / max(1, r["requests"])),
             cell(r["tau"]), cell(r["tok_s"]), carried(r)] for r in rows]
    return table(head, body)
