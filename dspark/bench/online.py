"""`dspark bench online`: closed-loop serving load per configuration and concurrency -- the
throughput-interactivity frontier (Fig. 7) and the verification budget under load (Fig. 8).

    dspark bench online --configs "none;mtp:static:1;dspark:static:7;dspark:dspark;dspark:dspark-async" \
        --concurrency 1,2,4,8,16,32,64 --requests-per-client 4
    dspark bench online --workload hostile --configs "none;dspark:dspark"   # never slower than none?
    dspark bench online --lockstep --configs "none;dspark:dspark" --repeats 4  # drift cancelled
    dspark bench online --lockstep --configs "none;none;dspark:dspark"       # none#2: the run's own noise
    dspark bench online --url http://127.0.0.1:8000,http://127.0.0.1:8001  # running servers
    dspark bench online --quick                                              # ~1 minute smoke run
    dspark bench online --workload agent --configs "ngram:dspark;suffix:dspark;auto:dspark" --num-prompts 8
    dspark bench online --lockstep --trace --configs "none;dspark:dspark" --concurrency 16  # steps by load

A configuration is `none` or `drafter:policy`; each is one engine in this process, loaded by
engine/factory.py and warmed up; then, at every C in turn, each engine is driven by C
closed-loop clients (loop.py), the configurations interleaved in an order that rotates per C,
so machine drift does not land on one configuration; with `--lockstep` the configurations'
engines instead take one step each in turn within every run, each timed on its own clock, so
a noisy neighbour slows all of them alike (loop.py). Workloads: `mixed` (math, code and chat
prompts interleaved, chat-templated), `hostile` (random token strings: drafts are almost
always rejected) and `agent` (multi-turn agent traces, --num-prompts of them, agent.py; the
report adds τ, per-user tok/s and the drafter that carried each task kind). With `--url` every URL is one configuration (its /v1/models card names
drafter and policy) and the load goes over HTTP (http_loop.py). Writes online.json, online.md, frontier.png and budget.png (a hostile
run: online-hostile.json, ...), with ratios against `none` (or the first configuration)
measured in the same run. `--trace` also keeps every engine step (online-steps.jsonl) and adds a
table of steps by kind and requests per step (steptrace.py); under a gated policy each step also
carries the gate's state, counted in a second table and drawn in gate.png (`plots.gate_timeline`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from dspark import report
from dspark.bench import frontier, plots, steptrace
from dspark.bench.loop import ClosedLoop, LoopResult, closed_loop, run_loops
from dspark.bench.prompts import DATASETS
from dspark.bench.summary import latency, speculation
from dspark.bench.workload import (
    Job,
    Spec,
    drafter_gamma,
    engine_config,
    hostile,
    interleave,
    parse_configs,
    render,
    select,
    split_drafter,
    split_options,
)
from dspark.models.loader import model_label
from dspark.report import cell

CONFIGS = "none;mtp:static:1;dspark:static:7;dspark:dspark;dspark:dspark-async"
MiB = 1024 * 1024


@dataclass(frozen=True)
class OnlineSettings:
    model: str | None = None
    configs: str = CONFIGS
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    requests_per_client: int | None = 4
    duration_s: float | None = None  # instead of requests_per_client: send until this many seconds
    repeats: int = 1  # runs per configuration and concurrency (rotating order), merged into one row
    lockstep: bool = False  # step every configuration's engine in turn within one run (loop.py) instead of whole runs in turn
    workload: str = "mixed"  # mixed | hostile | agent
    datasets: tuple[str, ...] = DATASETS
    prompts_file: str | None = None
    num_prompts: int = 64  # per dataset (mixed), in all (hostile), traces (agent)
    hostile_prompt_tokens: int = 128
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0  # nucleus sampling (sampled requests only)
    ignore_eos: bool = False
    gamma: int | None = None  # None: each drafter's own block size
    seed: int = 0
    profile: str = "auto"  # step profile for dspark policies: auto | refresh | off
    url: str | None = None  # comma-separated server URLs: benchmark those instead
    slas: tuple[float, ...] | None = None  # per-user tok/s levels (default: the reference's points)
    device: str | None = None
    trace: bool = False  # keep every engine step: online-steps.jsonl and a table by load (`steptrace`)


def quick_configs(model: str | None) -> str:
    """The --quick configurations: shipped drafters when present, else the weight-free n-gram."""
    from dspark.models.loader import resolve_model_path

    path = resolve_model_path(model)
    if drafter_gamma("dspark", path) is not None:
        return "none;mtp:static:1;dspark:dspark" if drafter_gamma("mtp", path) else "none;dspark:static:7;dspark:dspark"
    return "none;ngram:static:7;ngram:dspark"


def jobs_for(s: OnlineSettings, tok, context: int) -> list[Job]:
    if s.workload == "hostile":
        return hostile(tok, s.num_prompts, min(s.hostile_prompt_tokens, context // 2), s.seed)
    limit = context - s.max_tokens - (s.gamma or 7) - 2
    if s.workload == "agent":
        from dspark.bench import agent

        return agent.jobs(tok, agent_traces(s), limit, s.seed)
    if s.workload != "mixed":
        raise ValueError(f"unknown workload {s.workload!r}; expected mixed, hostile or agent")
    return interleave(render(tok, select(list(s.datasets), s.prompts_file, s.num_prompts), limit))


def agent_traces(s: OnlineSettings) -> int:
    """Traces the agent workload needs: fresh ones for every concurrency level (a trace run again
    would find its own earlier turns in the suffix drafter's store of finished requests) and two
    for the warm-up; with --duration, num_prompts of them, reused."""
    if s.duration_s:
        return s.num_prompts
    return sum(c * (s.requests_per_client or 1) for c in s.concurrency) + 2


def level_jobs(s: OnlineSettings, jobs: list[Job]) -> tuple[list[Job], dict[int, list[Job]]]:
    """(warm-up jobs, the jobs of each concurrency level): the same list everywhere, except the
    agent workload's own traces per level (agent_traces)."""
    if s.workload != "agent" or s.duration_s or len(jobs) < agent_traces(s):
        return jobs, {c: jobs for c in s.concurrency}
    levels, start = {}, 0
    for c in s.concurrency:
        n = c * (s.requests_per_client or 1)
        levels[c], start = jobs[start : start + n], start + n
    return jobs[start:], levels


def per_client(s: OnlineSettings) -> int | None:
    return None if s.duration_s else s.requests_per_client


def row_for(config: str, c: int, res: LoopResult, extra: dict) -> dict:
    spec = speculation(res.outputs)
    return {"config": config, "concurrency": c, **latency(res.outputs, res.wall_s),
            "budget": spec["budget"], "tau": spec["tau"], "acceptance_rate": spec["acceptance_rate"],
            "completion_tokens": spec["completion_tokens"], "verified_tokens": spec["verified_tokens"],
            "accepted_tokens": spec["accepted_tokens"], "steps": res.steps,
            "peak_rss_mib": None if res.peak_rss_bytes is None else res.peak_rss_bytes / MiB,
            "rss_scope": res.rss_scope, "peak_kv_blocks": res.peak_kv_blocks,
            "peak_drafter_cache_mib": None if res.peak_drafter_cache_bytes is None else res.peak_drafter_cache_bytes / MiB,
            "peak_gpu_mib": None if res.peak_gpu_bytes is None else res.peak_gpu_bytes / MiB, **extra}


def measure(s: OnlineSettings, entries: list[tuple[Spec, object]], c: int, jobs: list[Job], params) -> list[dict]:
    """The given configurations at concurrency c, each with its own C closed-loop clients, run
    together in lockstep (one engine step of each in turn; a single one simply runs alone),
    then one row of the table per configuration."""
    loops, before, bars = [], [], []
    for sp, engine in entries:
        before.append((engine.num_drafted_steps, engine.num_steps))
        bar = tqdm(total=(per_client(s) or 0) * c or None, desc=f"{sp.label} C={c}", leave=False, disable=None)
        bars.append(bar)
        loops.append(ClosedLoop(engine, jobs, c, params, per_client(s), s.duration_s, bar.update, s.trace))
    results = run_loops(loops)
    rows = []
    for (sp, engine), res, (drafted0, steps0), bar in zip(entries, results, before, bars, strict=True):
        bar.close()
        steps = engine.num_steps - steps0
        drafted = (engine.num_drafted_steps - drafted0) / steps if steps else None
        kv_block_mib = engine.kv.bytes / engine.kv.pool.num_blocks / MiB
        rows.append(row_for(sp.label, c, res, {
            "drafter": sp.drafter, "policy": sp.policy, "gamma": engine.drafter.gamma if engine.drafter else 0,
            "kv_pool_blocks": engine.kv.pool.num_blocks, "peak_kv_mib": res.peak_kv_blocks * kv_block_mib,
            "drafted_step_fraction": drafted if engine.drafter else None}))
        if s.workload == "agent":
            from dspark.bench import agent

            rows[-1]["phases"] = agent.phases(res.outputs, config=sp.label, concurrency=c)
        if res.trace is not None:
            rows[-1]["trace"] = [{"config": sp.label, "concurrency": c, **rec} for rec in res.trace]
    return rows


COUNTS = ("requests", "completion_tokens", "verified_tokens", "accepted_tokens", "steps")


def merge_runs(runs: list[dict]) -> dict:
    """One row from repeated runs of a configuration at one concurrency: counts summed, peaks
    maximal, rates averaged, and every run's throughput kept (`throughput_runs`) to show spread."""
    if len(runs) == 1:
        return {**runs[0], "repeats": 1, "throughput_runs": [runs[0]["throughput_tok_s"]]}
    row = dict(runs[0])
    for key, value in runs[0].items():
        values = [r[key] for r in runs]
        if key in COUNTS:
            row[key] = sum(values)
        elif key in ("phases", "trace"):  # one line per run and task kind, or per step
            row[key] = [p for v in values for p in v]
        elif key.startswith("peak_") and all(v is not None for v in values):
            row[key] = max(values)
        elif isinstance(value, float) and all(isinstance(v, int | float) for v in values):
            row[key] = sum(values) / len(values)
    return {**row, "repeats": len(runs), "throughput_runs": [r["throughput_tok_s"] for r in runs]}


def warm_up(engine, jobs: list[Job], s: OnlineSettings, params) -> None:
    """Untimed requests before any run. On a GPU, one full-length request per client at the
    highest concurrency: the first pass through each batch shape and context length pays for
    allocator growth and library set-up (a one-request GPU run without it measured `none` at
    13 tok/s against 87 warm, `docs/results/gpu-h200/`). On a CPU a short pass suffices."""
    if engine.model.device.type == "cuda":
        c = max(s.concurrency)
        closed_loop(engine, jobs, c, params, per_client=1)
    else:
        closed_loop(engine, jobs[:2], 2, lambda i: params(i, 8), per_client=1)


def run_local(s: OnlineSettings, jobs: list[Job], path: Path,
              on_level=lambda rows, skipped: None) -> tuple[list[dict], list[str]]:
    """Every configuration at every concurrency; `on_level(rows, skipped)` after each level (the
    rows so far), so a run cut short still leaves the levels it finished."""
    from dspark.engine.factory import build_engine
    from dspark.engine.gate import GateConfig
    from dspark.models.loader import load_model
    from dspark.sampling import SamplingParams

    def params(i: int, max_tokens: int = s.max_tokens) -> SamplingParams:
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=max_tokens, seed=s.seed + i,
                              ignore_eos=s.ignore_eos)

    specs: list[Spec] = parse_configs(s.configs)
    gammas = {sp.label: drafter_gamma(sp.drafter, path) if sp.drafter else 0 for sp in specs}
    skipped = [label for label, g in gammas.items() if g is None]
    for label in skipped:
        print(f"skipping config {label!r}: no drafter checkpoint for this model")
    longest = max(max(len(j.ids), j.limit) for j in jobs) + s.max_tokens + max(g or 0 for g in gammas.values()) + 2
    warm, levels = level_jobs(s, jobs)
    cfg = engine_config(path, max(s.concurrency), longest, s.device)
    loaded = load_model(path, cfg.device, cfg.dtype)  # one copy of the target's weights, as one deployment has
    engines = {}
    for sp in specs:  # every engine is built and warmed up first, then the runs interleave
        native = gammas[sp.label]
        if native is None:
            continue
        gamma = min(s.gamma, native) if s.gamma and sp.drafter else None
        drafter, vocab = split_drafter(sp.drafter) if sp.drafter else (None, 0)
        gate, changes = split_options(sp.options)
        engine = build_engine(path, drafter, sp.policy, cfg.replace(**changes), gamma=gamma, profile=s.profile,
                              loaded=loaded, draft_vocab=vocab, gate=GateConfig.parse(gate))
        warm_up(engine, warm, s, params)
        engines[sp.label] = (sp, engine)
    rows = []
    labels = list(engines)
    order = {label: i for i, label in enumerate(labels)}
    for level, c in enumerate(tqdm(s.concurrency, desc="concurrency", disable=None)):
        runs: dict[str, list[dict]] = {label: [] for label in labels}
        for rep in range(s.repeats):
            shift = (level + rep) % len(labels) if labels else 0
            turn = labels[shift:] + labels[:shift]  # the order rotates, so drift hits every config alike
            for group in [turn] if s.lockstep else [[label] for label in turn]:
                for row in measure(s, [engines[label] for label in group], c, levels[c], params):
                    runs[row["config"]].append(row)
        rows += [merge_runs(r) for r in runs.values()]
        rows.sort(key=lambda r: (order[r["config"]], s.concurrency.index(r["concurrency"])))
        if level + 1 < len(s.concurrency):
            on_level(rows, skipped)
    return rows, skipped


def run_http(s: OnlineSettings, jobs: list[Job]) -> list[dict]:
    from dspark.bench import http_loop

    rows = []
    for url in [u.strip() for u in (s.url or "").split(",") if u.strip()]:
        card = http_loop.server_info(url)
        label = f"{card.get('drafter') or 'none'}:{card.get('policy') or 'none'}"
        label = "none" if card.get("policy") in (None, "none") else label
        if any(r["config"] == label for r in rows):
            label = f"{label}@{url.split('//')[-1]}"
        body = {"model": card.get("id"), "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                "ignore_eos": s.ignore_eos, "seed": s.seed}
        http_loop.closed_loop(url, jobs[:2], 1, {**body, "max_tokens": 8}, per_client=1)  # warm-up
        for c in tqdm(s.concurrency, desc=label, disable=None):
            res = http_loop.closed_loop(url, jobs, c, body, per_client(s), s.duration_s)
            rows.append(row_for(label, c, res, {"url": url, "drafter": card.get("drafter"), "policy": card.get("policy")}))
    return rows


def run(s: OnlineSettings, out: str | Path) -> dict:
    """Run the benchmark and write its report; while it runs, the report is rewritten after every
    concurrency level (`"complete": false`), so a run that is stopped keeps what it measured."""
    from dspark.models.loader import read_config, resolve_model_path
    from dspark.models.tokenizer import TextTokenizer

    if s.lockstep and s.url:
        raise ValueError("--lockstep steps in-process engines; it cannot pace servers given with --url")
    if s.trace and s.url:
        raise ValueError("--trace keeps the steps of in-process engines; it cannot see inside --url servers")
    if s.workload == "agent" and s.url:
        raise ValueError("the agent workload's later turns follow in-process requests; it cannot drive --url servers")
    path = resolve_model_path(s.model)
    jobs = jobs_for(s, TextTokenizer.from_dir(path), read_config(path).max_position_embeddings)
    if s.url:
        rows, skipped = run_http(s, jobs), []
    else:
        rows, skipped = run_local(s, jobs, path, lambda done, sk: write(s, path, done, sk, out, complete=False))
    payload, md = write(s, path, rows, skipped, out, complete=True)
    print(md)
    return payload


def write(s: OnlineSettings, path: Path, rows: list[dict], skipped: list[str], out: str | Path,
          complete: bool) -> tuple[dict, str]:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    reference = "none" if "none" in configs else (configs[0] if configs else "none")
    summary = frontier.summarize(rows, reference, s.slas)
    ratios = frontier.ratios_by_concurrency(rows, reference)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if s.workload == "mixed" else f"-{s.workload}"  # a hostile run keeps the mixed one
    if rows:
        plots.frontier(rows, out / f"frontier{suffix}.png", f"{model_label(path)}, {s.workload} workload")
        plots.budget(rows, out / f"budget{suffix}.png")
    phases = [p for r in rows for p in r.get("phases", [])]
    steps = [t for r in rows for t in r.get("trace", [])]
    rows = [{k: v for k, v in r.items() if k not in ("phases", "trace")} for r in rows]
    payload = {"benchmark": "online", "model": str(path), "settings": asdict(s), "complete": complete,
               "reference": reference, "skipped_configs": skipped, "rows": rows, "ratios": ratios,
               "frontier": summary, **({"phases": phases} if s.workload == "agent" else {})}
    md = markdown(rows, ratios, summary, s, path, skipped, suffix)
    if phases:
        from dspark.bench import agent

        md += ("\n## Per task kind (agent traces; τ and per-user tok/s of that kind's turns, and the share of "
               "accepted draft tokens each drafter proposed)\n\n" + agent.markdown(phases, ["config", "concurrency"]))
    if steps:
        (out / f"online{suffix}-steps.jsonl").write_text("".join(json.dumps(t) + "\n" for t in steps))
        md += ("\n## Steps by load (`--trace`; every step in `online" + suffix + "-steps.jsonl`)\n\nEach configuration's "
               "engine steps grouped by kind (plain; drafted for every request; partial: for some, e.g. a probe; "
               "prefill: chunks shared the forward) and requests per step.\n\n" + steptrace.markdown(steptrace.summarize(steps)))
        if runs := steptrace.gate_runs(steps):
            plots.gate_timeline(runs, out / f"gate{suffix}.png")
            md += ("\nThe never-slower gate, per configuration and load: the steps it judged drafting to pay (open), its "
                   "probes, how often it closed and opened again, and the first step it judged closed (every step's state "
                   f"is in the same file; step by step in `gate{suffix}.png`).\n\n" + steptrace.gate_markdown(steptrace.gate_summary(runs)))
    if not complete:
        md = "**Partial: the run was still going (or was stopped) after these levels.**\n\n" + md
    report.write(out, f"online{suffix}", payload, md)
    return payload, md


def _runs(values: list[float | None] | None) -> str:
    return "–" if not values else ", ".join("–" if v is None else f"{v:.2f}" for v in values)


def _kv(r: dict) -> str:
    if r["peak_kv_blocks"] is None:
        return "–"
    return str(r["peak_kv_blocks"]) + (f" ({r['peak_kv_mib']:.2f})" if r.get("peak_kv_mib") is not None else "")


def _cell(entry: dict, config: str) -> str:
    v, r = entry["values"][config], entry["ratio_vs_reference"][config]
    return "–" if v is None else f"{v:.1f}" + ("" if r is None else f" ({r:.2f}×)")


def markdown(rows, ratios, summary, s: OnlineSettings, path: Path, skipped: list[str], suffix: str = "") -> str:
    load = f"{s.requests_per_client} requests per client" if s.duration_s is None else f"{s.duration_s} s of sending"
    if s.repeats > 1:
        load += (f", {s.repeats} runs per configuration and concurrency in rotating order (a row merges them: rates "
                 "averaged, counts summed; tok/s of each run in the last column)")
    if s.lockstep:
        load += ("; **lockstep**: within a run every configuration's engine takes one step in turn, each timed on its "
                 "own clock that runs only while it works (so all see the same machine at every moment)")
    md = [f"# Online closed-loop serving: model `{model_label(path)}`, `{s.workload}` workload (Figs. 7-8 analogs)\n\n",
          f"{'Servers ' + s.url if s.url else 'In-process engine'}; C closed-loop clients, {load}; "
          f"max {s.max_tokens} new tokens{' (EOS ignored)' if s.ignore_eos else ''}, temperature {s.temperature}"
          f"{f', top-p {s.top_p}' if s.top_p < 1.0 else ''}. "
          "Budget = draft tokens verified per request per decode round (the target sees 1 + budget); "
          "per-user tok/s = a request's tokens after the first over the time since its first token. "
          "Peak RSS is the whole process (every configuration's engine is resident, as the runs interleave, all on one copy of the target's weights: "
          "weights, preallocated KV pools, Python); the KV blocks and the drafter's cache are what the load really occupied.\n"]
    if skipped:
        md.append(f"\nSkipped (no drafter checkpoint for this model): {', '.join(skipped)}.\n")
    head = ["config", "C", "tok/s", "per-user mean", "per-user p50", "TTFT mean s", "TTFT p50 s", "budget", "τ",
            "accept rate", "peak RSS MiB", "peak KV blocks (MiB)", "drafter cache MiB", "tok/s per run"]
    table = [[r["config"], r["concurrency"], cell(r["throughput_tok_s"]), cell(r["per_user_tok_s_mean"]),
              cell(r["per_user_tok_s_p50"]), cell(r["ttft_mean_s"]), cell(r["ttft_p50_s"]), cell(r["budget"]), cell(r["tau"]),
              cell(r["acceptance_rate"]), cell(r["peak_rss_mib"]),
              _kv(r), cell(r["peak_drafter_cache_mib"]),
              " / ".join("–" if t is None else f"{t:.0f}" for t in r.get("throughput_runs", [r["throughput_tok_s"]]))] for r in rows]
    md += ["\n## Per configuration and concurrency\n\n", report.table(head, table)]
    ref = summary["reference"]
    if ratios:
        md += [f"\n## Ratios vs `{ref}` at the same concurrency\n\n",
               report.table(["config", "C", "throughput ×", "per-user ×", "throughput × per repeat"],
                            [[r["config"], r["concurrency"], cell(r["throughput_ratio"]), cell(r["per_user_ratio"]),
                              _runs(r.get("throughput_ratio_runs"))] for r in ratios])]
        for config in dict.fromkeys(r["config"] for r in ratios):
            worst = min((r for r in ratios if r["config"] == config and r["throughput_ratio"] is not None),
                        key=lambda r: r["throughput_ratio"], default=None)
            if worst is not None:
                row = next(r for r in rows if r["config"] == config and r["concurrency"] == worst["concurrency"])
                drafted = row.get("drafted_step_fraction")
                md.append(f"\n- `{config}`: lowest throughput ratio vs `{ref}` {worst['throughput_ratio']:.3f} "
                          f"(C = {worst['concurrency']})"
                          + ("" if drafted is None else f"; the drafter ran on {100 * drafted:.0f}% of its steps"))
        md.append("\n")
    for key, title, unit in (("sla", "Aggregate tok/s at per-user speed SLAs", "per-user tok/s ≥"),
                             ("matched", "Per-user tok/s at matched aggregate throughput", "aggregate tok/s ≥")):
        entries = summary[key]
        if entries:
            md.append(f"\n## {title} (× `{ref}`; – = the curve never gets there)\n\n")
            md.append(report.table(["config", *(f"{unit} {e['level']:.1f}" for e in entries)],
                                   [[c, *(_cell(e, c) for e in entries)] for c in entries[0]["values"]]))
    md.append(f"\n![frontier](frontier{suffix}.png)\n![budget](budget{suffix}.png)\n")
    return "".join(md)
