"""`dspark bench steps`: the anatomy of an engine step, drafted against plain, in one run.

Each configuration (`none`, or `DRAFTER:POLICY`, optionally `@N` for an N-token draft vocabulary)
generates greedily for the same prompts (exactly `--max-tokens` tokens each, EOS ignored), with
the device synchronised after every step so a step's wall time is its real cost. A step either
ran the drafter (a drafted step: propose + schedule + verify + accept) or did not (a plain step:
one target forward). The report gives, per configuration, the median wall time of each kind of
step and the engine's own phase split, and two ratios against the plain step of the `none`
configuration measured in the same run:

- proposal / plain step: what a draft costs (the drafter's `propose`, the `draft` phase);
- drafted step / plain step: what one drafted step costs in target steps. Speculation pays
  when the tokens a drafted step emits (τ) exceed this ratio.

The configurations run in lockstep, one step each in turn, for `--repeats` passes over the prompts,
and every configuration shares one copy of the target's weights. `--concurrency C` runs C requests at a time (each step then
serves C requests; its τ counts the tokens of all of them).

    dspark bench steps --model dspark-small --configs 'none;dspark:static:7;dspark:static:7@2048'
    dspark bench steps --device cuda --concurrency 16          # the GPU diagnostic
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from dspark import report
from dspark.bench.prompts import ONE_PER_DOMAIN, load_prompt_texts
from dspark.config import EngineConfig, default_device
from dspark.engine.engine import LLMEngine
from dspark.engine.factory import build_engine
from dspark.models.loader import load_model, model_label, resolve_model_path
from dspark.sampling import SamplingParams

PHASES = ("draft", "schedule", "verify", "accept")


@dataclass(frozen=True)
class StepsSettings:
    model: str | None = None
    configs: tuple[str, ...] = ("none", "dspark:static:7", "dspark:dspark")
    num_prompts: int = 2  # per dataset
    max_tokens: int = 96
    repeats: int = 2
    device: str | None = None  # default: cuda when available
    concurrency: int = 1  # requests stepped together


def parse_config(name: str) -> tuple[str | None, str, int | None]:
    """'none' -> (None, 'none', 0); 'dspark:static:7@2048' -> ('dspark', 'static:7', 2048);
    without '@' the drafter's own draft vocabulary (None); '@0' every token."""
    spec, _, vocab = name.partition("@")
    if spec == "none":
        return None, "none", 0
    drafter, sep, policy = spec.partition(":")
    if not sep or not drafter or not policy:
        raise ValueError(f"config {name!r}: use none or DRAFTER:POLICY[@N], e.g. dspark:static:7@2048")
    if vocab and not vocab.isdigit():
        raise ValueError(f"config {name!r}: the draft vocabulary after @ must be a number of tokens")
    return drafter, policy, int(vocab) if vocab else None


def lockstep(engines: dict[str, LLMEngine], prompts: list[str], max_tokens: int, sync,
             concurrency: int = 1) -> dict[str, list[tuple[bool, float, dict, int]]]:
    """(drafted?, wall seconds, phase seconds, tokens emitted) of every step each engine ran, `concurrency`
    prompts at a time. The engines take turns step by step (each round starting with the next one), so
    a slow spell of a shared machine falls on every configuration alike, not on whichever pass it hit."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows: dict[str, list] = {name: [] for name in engines}
    names, turn = list(engines), 0
    for i in range(0, len(prompts), concurrency):
        for engine in engines.values():
            for prompt in prompts[i : i + concurrency]:
                engine.add_request(prompt, params)
        while any(engine.has_unfinished() for engine in engines.values()):
            turn += 1
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                row = timed_step(engines[name], sync) if engines[name].has_unfinished() else None
                if row is not None:
                    rows[name].append(row)
    return rows


def timed_step(engine: LLMEngine, sync) -> tuple[bool, float, dict, int] | None:
    """One engine step, the device synchronised after it; None when it ran nothing."""
    t = time.perf_counter()
    step = engine.step()
    sync()
    if not step.ran:
        return None
    emitted = sum(len(v) for v in step.new_tokens.values())
    return step.drafter_ran, time.perf_counter() - t, dict(step.times), emitted


def summarize(rows: list[tuple[bool, float, dict, int]]) -> dict:
    out: dict = {"steps": len(rows), "tokens": sum(r[3] for r in rows), "seconds": sum(r[1] for r in rows)}
    out["tok_s"] = out["tokens"] / out["seconds"] if out["seconds"] else 0.0
    for flag, kind in ((True, "drafted"), (False, "plain")):
        sel = [r for r in rows if r[0] == flag]
        if sel:
            out[kind] = {"n": len(sel), "ms": 1e3 * statistics.median(r[1] for r in sel),
                         "tau": sum(r[3] for r in sel) / len(sel),
                         **{p: 1e3 * statistics.median(r[2].get(p, 0.0) for r in sel) for p in PHASES}}
    return out


def ratios(res: dict, plain_ms: float | None) -> dict:
    d = res.get("drafted")
    if not d or not plain_ms:
        return {"proposal_over_plain": None, "drafted_over_plain": None}
    return {"proposal_over_plain": d["draft"] / plain_ms, "drafted_over_plain": d["ms"] / plain_ms}


def run(settings: StepsSettings, out_dir: str) -> dict:
    if "none" not in settings.configs:
        raise ValueError("--configs must include none: every ratio is against its plain step in the same run")
    specs = {name: parse_config(name) for name in settings.configs}
    device = settings.device or default_device()
    cfg = EngineConfig(device=device)
    path = resolve_model_path(settings.model)
    loaded = load_model(path, cfg.device, cfg.dtype)
    engines = {name: build_engine(path, drafter, policy, cfg, loaded=loaded, draft_vocab=vocab)
               for name, (drafter, policy, vocab) in specs.items()}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    prompts = load_prompt_texts(list(ONE_PER_DOMAIN), settings.num_prompts)
    c = settings.concurrency
    if c < 1:
        raise ValueError("--concurrency must be at least 1")
    prompts = (prompts * -(-c // len(prompts)))[: max(c, len(prompts) // c * c)]  # whole batches of c
    lockstep(engines, prompts[:1], 16, sync)  # warm-up: one-time costs stay out of the figures
    rows: dict[str, list] = {name: [] for name in engines}
    for _ in range(settings.repeats):
        for name, rs in lockstep(engines, prompts, settings.max_tokens, sync, c).items():
            rows[name] += rs
    results = {name: summarize(rs) for name, rs in rows.items()}
    plain_ms = results["none"].get("plain", {}).get("ms")
    for res in results.values():
        res.update(ratios(res, plain_ms), speedup=res["tok_s"] / results["none"]["tok_s"])
    payload = {"settings": settings.__dict__ | {"configs": list(settings.configs)}, "model": model_label(path),
               "plain_step_ms": plain_ms, "results": results}
    report.write(out_dir, "steps", payload, markdown(payload))
    return payload


def markdown(payload: dict) -> str:
    s = payload["settings"]
    head = (f"# Step anatomy: model `{payload['model']}`\n\n"
            f"{s.get('concurrency', 1)} request(s) per step, greedy, exactly {s['max_tokens']} tokens for each of {s['num_prompts']} prompts from "
            f"{', '.join(ONE_PER_DOMAIN)} (chat template), {s['repeats']} passes with the configurations stepping in turn; medians per step, device "
            "synchronised after every step. Ratios are against the plain step of `none` in this run "
            f"({report.cell(payload['plain_step_ms'], 2)} ms). A drafted step pays when its τ (tokens it emits) "
            "exceeds drafted / plain.\n\n")
    rows = []
    for name, r in payload["results"].items():
        d, p = r.get("drafted", {}), r.get("plain", {})
        rows.append([f"`{name}`", r["tok_s"], r["speedup"], d.get("n", 0), d.get("tau"), d.get("ms"), d.get("draft"),
                     d.get("verify"), d.get("accept"), p.get("n", 0), p.get("ms"), r["proposal_over_plain"],
                     r["drafted_over_plain"]])
    return head + report.table(["config", "tok/s", "× none", "drafted steps", "τ drafted", "drafted ms", "propose ms",
                                "verify ms", "accept ms", "plain steps", "plain ms", "proposal / plain",
                                "drafted / plain"], rows)
