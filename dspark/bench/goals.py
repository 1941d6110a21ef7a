"""`dspark bench goals`: the project's benchmark goals checked against committed results.

Reads the results tree (one folder per benchmark: steps/steps.json, offline/offline.json, peers/peers.json,
online/online.json, online/online-hostile.json, online/online-agent.json, and the sampled single
stream in online/c1-six-t1/online.json; each written by its own `dspark bench` command in one
run, so every ratio compares configurations measured side by side) and writes goals/goals.json
and goals/goals.md: each goal's measured value, its bar, met or missed, and the file it came
from. Nothing is measured here; a missing file leaves its goals "not measured".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark import report
from dspark.bench.frontier import curve, speed_at_throughput
from dspark.bench.summary import macro, ratio
from dspark.report import cell

SPEC = "dspark:dspark"


@dataclass(frozen=True)
class Check:
    goal: str
    bar: float  # the measured value must be >= bar (at_most: <= bar)
    value: float | None  # None: not measured (file or configuration missing)
    source: str
    detail: str = ""
    at_most: bool = False  # a cost: the bar is a ceiling

    @property
    def status(self) -> str:
        if self.value is None:
            return "not measured"
        return "met" if (self.value <= self.bar if self.at_most else self.value >= self.bar) else "missed"

    @property
    def bar_text(self) -> str:
        return f"{'≤' if self.at_most else '≥'} {self.bar}"


def _load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def steps_checks(res: dict | None, config: str = "dspark:static:7") -> list[Check]:
    """The step anatomy at one request (`dspark bench steps`): what a γ = 7 DSpark proposal and a whole drafted
    step cost in plain steps of the same run, each a ceiling; the default policy's value beside it."""
    res = res or {}
    runs = res.get("results", {}) if res.get("settings", {}).get("concurrency", 1) == 1 else {}
    row, spec = runs.get(config, {}), runs.get(SPEC, {})
    return [Check(f"one request: a γ = 7 DSpark {what} / a plain step ({config})", bar, row.get(key),
                  "steps/steps.json", f"{SPEC}: {cell(spec.get(key))}", at_most=True)
            for what, key, bar in (("proposal", "proposal_over_plain", 0.15), ("drafted step", "drafted_over_plain", 1.3))]


def offline_checks(res: dict | None) -> list[Check]:
    rows = [r for r in (res or {}).get("rows", []) if r.get("temperature") == 1.0]

    def mean_tau(drafter: str) -> float | None:
        dom = macro([r for r in rows if r["drafter"] == drafter], "tau")
        return sum(dom.values()) / len(dom) if dom else None

    taus = {d: mean_tau(d) for d in ("dspark", "eagle3", "dflash")}
    return [Check(f"offline τ (T = 1, γ = 7, domain macro): dspark / {other}", bar,
                  ratio(taus["dspark"], taus[other]), "offline/offline.json",
                  f"dspark {cell(taus['dspark'])}, {other} {cell(taus[other])}")
            for other, bar in (("eagle3", 1.25), ("dflash", 1.15))]


def peers_checks(res: dict | None) -> list[Check]:
    res = res or {}
    spec = next((r for r in res.get("rows", []) if r["system"].endswith(f" {SPEC}")), None)
    by_domain = {r["domain"]: r for r in res.get("domain_rows", []) if spec and r["system"] == spec["system"]}
    checks = [Check(f"single stream, {d}: {SPEC} / none", 2.0, by_domain.get(d, {}).get("vs_dspark_none"),
                    "peers/peers.json") for d in ("math", "code")]
    checks.append(Check(f"single stream: {SPEC} / transformers generate()", 2.0,
                        spec["vs_transformers"] if spec else None, "peers/peers.json"))
    return checks


def sampled_checks(res: dict | None, source: str = "online/c1-six-t1/online.json") -> list[Check]:
    """Single stream at temperature 1: one closed-loop client's throughput over plain decoding's."""
    res = res or {}
    goal = f"single stream, temperature 1: {SPEC} / none"
    if res.get("settings", {}).get("temperature") != 1.0:
        return [Check(goal, 1.3, None, source, "no run at temperature 1" if res else "")]
    row = next((r for r in res.get("ratios", []) if r["config"] == SPEC and r["concurrency"] == 1), None)
    return [Check(goal, 1.3, row["throughput_ratio"] if row else None, source, "one client")]


def load_checks(res: dict | None, source: str) -> list[Check]:
    rows = (res or {}).get("rows", [])
    if not rows:
        return []
    concurrencies = sorted({r["concurrency"] for r in rows})
    low = concurrencies[0]
    at = {(r["config"], r["concurrency"]): r for r in rows}
    statics = sorted({r["config"] for r in rows if ":static:" in r["config"]})

    def best_static(c: int, key: str) -> tuple[str | None, float | None]:
        vals = [(at[s, c][key], s) for s in statics if (s, c) in at]
        return (max(vals)[1], max(vals)[0]) if vals else (None, None)

    def mine(c: int, key: str) -> float | None:
        return at.get((SPEC, c), {}).get(key)

    def over_none(c: int) -> tuple[float | None, str]:
        return ratio(mine(c, "throughput_tok_s"), at.get(("none", c), {}).get("throughput_tok_s")), ""

    def over_static(c: int) -> tuple[float | None, str]:
        name, best = best_static(c, "throughput_tok_s")
        return ratio(mine(c, "throughput_tok_s"), best), f" ({name})"

    name_u, best_u = best_static(low, "per_user_tok_s_mean")
    checks = [
        Check(f"C = {low}: {SPEC} aggregate / none", 1.3, over_none(low)[0], source),
        every_concurrency(f"every C: {SPEC} aggregate / best static:k", concurrencies, over_static, source),
        every_concurrency(f"every C: {SPEC} aggregate / none", concurrencies, over_none, source),
        Check(f"C = {low}: {SPEC} per-user / best static:k", 0.95, ratio(mine(low, "per_user_tok_s_mean"), best_u),
              source, f"best static: {name_u}"),
    ]
    mtp = "mtp:static:1"
    if any(r["config"] == mtp for r in rows):
        checks.append(matched_check(rows, mtp, source))
    return checks


def every_concurrency(goal: str, concurrencies: list[int], measure: Callable[[int], tuple[float | None, str]],
                      source: str) -> Check:
    """A bar of 1.0 at every concurrency, judged at the lowest; measure(c) -> (value, a note on it)."""
    got = {c: measure(c) for c in concurrencies}
    seen = {c: v for c, v in got.items() if v[0] is not None}
    if not seen:
        return Check(goal, 1.0, None, source)
    worst = min(seen, key=lambda c: seen[c][0])
    return Check(goal, 1.0, seen[worst][0], source, f"lowest at C = {worst}; all: "
                 + ", ".join(f"{c}: {v:.3f}{note}" for c, (v, note) in seen.items()))


def matched_check(rows: list[dict], base: str, source: str) -> Check:
    """Per-user speed over `base`'s at the throughput levels both curves reach (the worst level)."""
    mine, theirs = curve(rows, SPEC), curve(rows, base)
    ratios = [ratio(speed_at_throughput(mine, t), speed_at_throughput(theirs, t)) for _, t in theirs]
    ratios = [r for r in ratios if r is not None]
    return Check(f"matched aggregate throughput: {SPEC} per-user / {base}", 1.5, min(ratios) if ratios else None,
                 source, f"lowest over {len(ratios)} of {base}'s throughput levels")


def never_a_loss(res: dict | None, source: str) -> list[Check]:
    ratios = [r for r in (res or {}).get("ratios", []) if r["config"] == SPEC and r["throughput_ratio"] is not None]
    if not ratios:
        return [Check(f"never a loss ({source}): {SPEC} / none, every C", 0.97, None, source)]
    worst = min(ratios, key=lambda r: r["throughput_ratio"])
    return [Check(f"never a loss ({source}): {SPEC} / none, every C", 0.97, worst["throughput_ratio"], source,
                  f"lowest at C = {worst['concurrency']}; all: "
                  + ", ".join(f"{r['concurrency']}: {r['throughput_ratio']:.3f}" for r in ratios))]


def agent_checks(res: dict | None, source: str = "online/online-agent.json") -> list[Check]:
    """The router against the better of its two drafters alone, at every concurrency."""
    at = {(r["config"], r["concurrency"]): r["throughput_tok_s"] for r in (res or {}).get("rows", [])}
    out = []
    for c in sorted({c for _, c in at}):
        alone = [at.get((k, c)) for k in (SPEC, "suffix:dspark")]
        best = max((x for x in alone if x is not None), default=None)
        out.append(Check(f"agent workload, C = {c}: auto:dspark / the better of {SPEC} and suffix:dspark", 1.2,
                         ratio(at.get(("auto:dspark", c)), best), source))
    return out or [Check("agent workload: auto:dspark / the better alone", 1.2, None, source)]


SECTIONS: list[tuple[str, Callable[[dict | None], list[Check]]]] = [  # (results file, its checks)
    ("steps/steps", steps_checks),
    ("offline/offline", offline_checks),
    ("peers/peers", peers_checks),
    ("online/c1-six-t1/online", sampled_checks),
    ("online/online", lambda r: load_checks(r, "online/online.json")),
    ("online/online", lambda r: never_a_loss(r, "online/online.json")),
    ("online/online-hostile", lambda r: never_a_loss(r, "online/online-hostile.json")),
    ("online/online-agent", agent_checks),
]


def machines_note(machines: dict[str, str]) -> str:
    """Which machine ran each source: one line where all agree, else one per machine (a ratio stays within
    its own run, but goals read off different machines are not one snapshot)."""
    groups: dict[str, list[str]] = {}
    for name, line in machines.items():
        groups.setdefault(line, []).append(f"`{name}.json`")
    if len(groups) <= 1:
        return "".join(f"Every source ran on {line}.\n\n" for line in groups)
    return "Sources ran on different machines: " + "; ".join(
        f"{line}: {', '.join(names)}" for line, names in groups.items()) + ".\n\n"


def run(results: str | Path) -> dict:
    results = Path(results)
    loaded = {name: _load(results, name) for name, _ in SECTIONS}
    checks = [c for name, fn in SECTIONS for c in fn(loaded[name])]
    sources = {name: (res or {}).get("date") for name, res in loaded.items()}
    machines = {name: report.machine_line(res["machine"]) for name, res in loaded.items()
                if res and "machine" in res}
    payload = {"benchmark": "goals", "results": str(results), "sources": sources, "machines": machines,
               "checks": [{**asdict(c), "status": c.status} for c in checks]}
    md = ["# Benchmark goals against the committed results\n\n",
          "Read from the JSON files next to this one by `dspark bench goals`; each ratio comes from one run of "
          "one benchmark command, configurations side by side; this command measures nothing, so the machine in the "
          "header only read the files, and the machines that ran them are named below. Source dates: "
          + ", ".join(f"`{n}.json` {d or 'missing'}" for n, d in sources.items()) + ".\n\n",
          machines_note(machines),
          report.table(["goal", "bar", "measured", "status", "source", "detail"],
                       [[c.goal, c.bar_text, cell(c.value), c.status, c.source, c.detail] for c in checks])]
    report.write(results / "goals", "goals", payload, "".join(md))
    print("".join(md))
    return payload
