"""`dspark bench offline`: accepted length per dataset (Table 1), conditional acceptance per
draft position (Fig. 2) and, for DSpark drafters, a confidence-threshold sweep (Fig. 5).

    dspark bench offline --drafters dspark,dflash,eagle3,mtp,ngram --temperature 0,1
    dspark bench offline --drafters /path/to/drafter,ngram --prompts my.jsonl --num-prompts 32
    dspark bench offline --quick          # a ~1 minute smoke run (never a speed claim)
    dspark bench offline --workload agent --drafters ngram,suffix,dspark,auto --num-prompts 4

Batch size 1: every drafter decodes the same chat-templated prompts one request at a time
(`--drafters none,...` adds plain decoding as the speed reference of the same run)
under `static:<gamma>` (the whole block verified, as in the paper's Table 1; MTP: static:1),
so tau measures the drafter alone. The sweep reruns the same prompts with `threshold:t`.
A named drafter whose checkpoint is not shipped is skipped and listed in the report.
`--workload agent` decodes --num-prompts multi-turn agent traces instead (agent.py: each turn
follows the last, rows per task kind, and a table of which drafter carried each kind).
Writes offline.json, offline.md, acceptance.png and threshold-<drafter>.png (agent: offline-agent.*).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from dspark import report
from dspark.bench import plots
from dspark.bench.prompts import DATASETS
from dspark.bench.summary import conditional_acceptance, macro, mean_curves, ratio, speculation
from dspark.bench.workload import (
    Job,
    drafter_gamma,
    drafter_kind,
    drafter_label,
    engine_config,
    follow,
    render,
    select,
    split_drafter,
)
from dspark.models.loader import model_label
from dspark.report import cell

THRESHOLDS = tuple(round(0.1 * i, 1) for i in range(10))  # 0.0 = the full block, as static:gamma


@dataclass(frozen=True)
class OfflineSettings:
    model: str | None = None
    drafters: tuple[str, ...] = ("dspark", "dflash", "eagle3", "mtp", "ngram")
    datasets: tuple[str, ...] = DATASETS
    prompts_file: str | None = None
    num_prompts: int = 16  # per dataset
    max_tokens: int = 256
    temperatures: tuple[float, ...] = (0.0,)
    gamma: int = 7
    seed: int = 0
    thresholds: tuple[float, ...] = THRESHOLDS
    device: str | None = None
    sweep: tuple[str, ...] | None = None  # drafters (as listed) with a threshold sweep; None: every DSpark one
    workload: str = "datasets"  # datasets | agent (num_prompts traces)


QUICK = dict(num_prompts=2, max_tokens=32, thresholds=(0.0, 0.5, 0.9))


def decode_each(engine, jobs: Sequence[Job], temperature: float, s: OfflineSettings, desc: str) -> list[dict]:
    """Batch size 1: each prompt alone, to completion; stats tagged with dataset and domain."""
    from dspark.sampling import SamplingParams

    engine.run_until_done([engine.add_request(jobs[0].ids, SamplingParams(temperature=0.0, max_tokens=4))])
    outs = []
    for i, job in enumerate(tqdm(jobs, desc=desc, disable=None, leave=False)):
        params = SamplingParams(temperature=temperature, max_tokens=s.max_tokens, seed=s.seed + i)
        turn: Job | None = job
        while turn is not None:  # a trace's later turns follow its first (agent workload)
            req = engine.add_request(turn.ids, params)
            out = engine.run_until_done([req])[0]
            outs.append({**out.stats, "dataset": turn.dataset, "domain": turn.domain})
            turn = follow(turn, out.token_ids, req.stop_ids)
    return outs


def dataset_rows(outs: Sequence[dict], **tags) -> list[dict]:
    """One row per dataset (per dataset and domain when a prompts file mixes domains): tau,
    acceptance, budget and per-position conditional acceptance."""
    rows = []
    groups = list(dict.fromkeys((o["dataset"], o["domain"]) for o in outs))
    for dataset, domain in groups:
        mine = [o for o in outs if (o["dataset"], o["domain"]) == (dataset, domain)]
        name = dataset if sum(g[0] == dataset for g in groups) == 1 else f"{dataset}:{domain}"
        spec = speculation(mine)
        seconds = sum(o["latency_s"] or 0.0 for o in mine)
        rows.append({**tags, "dataset": name, "domain": domain, "num_prompts": len(mine), **spec,
                     "accepted_per_round": ratio(spec["accepted_tokens"], spec["decode_rounds"]),
                     "conditional_acceptance": conditional_acceptance(mine),
                     "tokens_per_s": ratio(spec["completion_tokens"], seconds)})
    return rows


def run(s: OfflineSettings, out: str | Path) -> dict:
    from dspark.engine.factory import build_engine
    from dspark.models.loader import read_config, resolve_model_path
    from dspark.models.tokenizer import TextTokenizer

    path = resolve_model_path(s.model)
    tok, context = TextTokenizer.from_dir(path), read_config(path).max_position_embeddings
    limit = context - s.max_tokens - s.gamma - 2
    if s.workload == "agent":
        from dspark.bench import agent

        jobs = agent.jobs(tok, s.num_prompts, limit, s.seed)
    else:
        jobs = render(tok, select(list(s.datasets), s.prompts_file, s.num_prompts), limit)
    cfg = engine_config(path, 1, max(len(j.ids) for j in jobs) + s.max_tokens + s.gamma + 2, s.device)
    rows: list[dict] = []
    phases: list[dict] = []  # agent workload: per drafter, temperature and task kind
    sweeps: dict[str, list[dict]] = {}
    skipped = []
    for name in s.drafters:
        if name == "none":  # plain decoding in the same run: the speed reference
            engine = build_engine(path, None, "none", cfg, profile="off")
            for t in s.temperatures:
                outs = decode_each(engine, jobs, t, s, f"none T={t}")
                rows += dataset_rows(outs, drafter="none", kind="none", policy="none", gamma=0, temperature=t)
                phases += agent_phases(s, outs, drafter="none", temperature=t)
            continue
        native = drafter_gamma(name, path)
        if native is None:
            print(f"skipping drafter {name!r}: no checkpoint for this model")
            skipped.append(name)
            continue
        label, kind, g = drafter_label(name), drafter_kind(name, path), min(s.gamma, native)
        base, vocab = split_drafter(name)
        engine = build_engine(path, base, f"static:{g}", cfg, gamma=g, profile="off", draft_vocab=vocab)
        for t in s.temperatures:
            outs = decode_each(engine, jobs, t, s, f"{label} T={t}")
            rows += dataset_rows(outs, drafter=label, kind=kind, policy=f"static:{g}", gamma=g, temperature=t)
            phases += agent_phases(s, outs, drafter=label, temperature=t)
        if kind == "dspark" and s.thresholds and (name in s.sweep if s.sweep is not None else not vocab):
            sweeps[label] = []
            for th in tqdm(s.thresholds, desc=f"{label} threshold sweep", disable=None):
                engine = build_engine(path, base, f"threshold:{th}", cfg, gamma=g, profile="off", draft_vocab=vocab)
                outs = decode_each(engine, jobs, s.temperatures[0], s, f"threshold {th}")
                sweeps[label] += dataset_rows(outs, drafter=label, threshold=th, gamma=g, temperature=s.temperatures[0])
    payload = {"benchmark": "offline", "model": str(path), "settings": asdict(s), "skipped_drafters": skipped,
               "rows": rows, "threshold_sweep": [r for v in sweeps.values() for r in v],
               **({"phases": phases} if s.workload == "agent" else {})}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    name = "offline" if s.workload == "datasets" else f"offline-{s.workload}"
    figures = figures_for(rows, sweeps, s.temperatures[0], out, "" if s.workload == "datasets" else f"-{s.workload}")
    md = markdown(rows, sweeps, s, path, skipped, figures)
    if phases:
        from dspark.bench import agent

        md += ("\n## Per task kind (agent traces, batch size 1): which drafter carried it\n\n"
               + agent.markdown(phases, ["drafter", "temperature"]))
    report.write(out, name, payload, md)
    print(md)
    return payload


def agent_phases(s: OfflineSettings, outs: Sequence[dict], **tags) -> list[dict]:
    if s.workload != "agent":
        return []
    from dspark.bench import agent

    return agent.phases(outs, **tags)


def figures_for(rows, sweeps, temperature: float, out: Path, suffix: str = "") -> list[str]:
    first = [r for r in rows if r["temperature"] == temperature and r["kind"] != "none"]
    curves: dict[str, dict[str, list]] = {}
    for r in first:
        curves.setdefault(r["domain"], {}).setdefault(r["drafter"], []).append(r["conditional_acceptance"])
    names = []
    if curves:
        plots.acceptance_curves({d: {k: mean_curves(v) for k, v in by.items()} for d, by in curves.items()},
                                out / f"acceptance{suffix}.png")
        names.append(f"acceptance{suffix}.png")
    for label, sweep in sweeps.items():
        plots.threshold_sweep(sweep_by_domain(sweep), out / f"threshold-{label}{suffix}.png")
        names.append(f"threshold-{label}{suffix}.png")
    return names


SWEEP_KEYS = ("tau", "budget", "accepted_per_round", "acceptance_rate")


def sweep_by_domain(sweep: Sequence[dict]) -> dict[str, list[dict]]:
    """Per domain and threshold, the macro average over that domain's datasets."""
    out: dict[str, list[dict]] = {}
    for th in dict.fromkeys(r["threshold"] for r in sweep):
        at = [r for r in sweep if r["threshold"] == th]
        means = {k: macro(at, k) for k in SWEEP_KEYS}
        for domain in dict.fromkeys(r["domain"] for r in at):
            m = {k: means[k].get(domain) for k in SWEEP_KEYS}
            out.setdefault(domain, []).append({"threshold": th, **m, "verified_per_round": m["budget"]})
    return out


def _domain_table(rows: Sequence[dict], key: str) -> tuple[list[str], list[list]]:
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    table = []
    for drafter in dict.fromkeys(r["drafter"] for r in rows):
        mine = [r for r in rows if r["drafter"] == drafter]
        by_ds = {r["dataset"]: r[key] for r in mine}
        dom = macro(mine, key)
        avg = sum(dom.values()) / len(dom) if dom else None
        table.append([drafter, *(cell(by_ds.get(d)) for d in datasets), *(cell(dom.get(d)) for d in domains), cell(avg)])
    return ["drafter", *datasets, *domains, "mean (domains)"], table


def markdown(rows, sweeps, s: OfflineSettings, path: Path, skipped: list[str], figures: list[str]) -> str:
    load = (f"{s.num_prompts} prompts per dataset (chat template)" if s.workload == "datasets" else
            f"{s.num_prompts} multi-turn agent traces (each turn a request; rows per task kind)")
    md = [f"# Offline acceptance: model `{model_label(path)}` (Table 1, Fig. 2, Fig. 5 analogs)\n",
          f"Batch size 1, policy `static:γ` (γ = {s.gamma}; MTP: 1), {load}, "
          f"max {s.max_tokens} new tokens, seed {s.seed}. τ = emitted tokens per decode "
          "round, bonus/recovered token included (the prefill round left out); per-domain columns are "
          "macro averages over that domain's datasets.\n"]
    if skipped:
        md.append(f"Skipped (no checkpoint for this model): {', '.join(skipped)}.\n")
    for t in s.temperatures:
        at = [r for r in rows if r["temperature"] == t]
        if not at:
            continue
        head, table = _domain_table(at, "tau")
        md += [f"\n## τ at temperature {t}\n", report.table(head, table)]
        md.append(ratio_table(at))
        head, table = _domain_table(at, "tokens_per_s")
        md += [f"\nSingle-stream decoding speed at temperature {t} (tok/s, the same runs; draft cost included, "
               "nothing else running):\n\n", report.table(head, table)]
    first = [r for r in rows if r["temperature"] == s.temperatures[0] and r["kind"] != "none"]
    if first:
        md.append(f"\n## Conditional acceptance per draft position (temperature {s.temperatures[0]})\n")
        md.append("P(x_k accepted | x_1..x_{k-1} accepted), macro-averaged over the domain's datasets.\n\n")
        width = max(len(r["conditional_acceptance"]) for r in first)
        table = []
        for drafter in dict.fromkeys(r["drafter"] for r in first):
            for domain in dict.fromkeys(r["domain"] for r in first):
                cs = [r["conditional_acceptance"] for r in first if r["drafter"] == drafter and r["domain"] == domain]
                table.append([drafter, domain, *(cell(v) for v in mean_curves(cs) + [None] * width)][: 2 + width])
        md.append(report.table(["drafter", "domain", *(f"k={k + 1}" for k in range(width))], table))
    for label, sweep in sweeps.items():
        md.append(f"\n## Threshold sweep: `{label}` (policy threshold:t, temperature {s.temperatures[0]})\n\n")
        table = [[d, p["threshold"], cell(p["tau"]), cell(p["verified_per_round"]), cell(p["accepted_per_round"]),
                  cell(p["acceptance_rate"])] for d, pts in sweep_by_domain(sweep).items() for p in pts]
        md.append(report.table(["domain", "t", "τ", "verified / round", "accepted / round", "acceptance rate"], table))
    md += ["\n" + "".join(f"![{f}]({f})\n" for f in figures)]
    return "".join(md)


def ratio_table(rows: Sequence[dict]) -> str:
    """τ of the first DSpark-kind drafter over every other drafter, per domain."""
    ref = next((r["drafter"] for r in rows if r["kind"] == "dspark"), None)
    if ref is None:
        return ""
    base = macro([r for r in rows if r["drafter"] == ref], "tau")
    domains = list(base)
    table = []
    for drafter in dict.fromkeys(r["drafter"] for r in rows if r["drafter"] != ref):
        other = macro([r for r in rows if r["drafter"] == drafter], "tau")
        table.append([f"{ref} / {drafter}", *(cell(ratio(base.get(d), other.get(d))) for d in domains)])
    return "\n" + report.table(["τ ratio", *domains], table) if table else ""
