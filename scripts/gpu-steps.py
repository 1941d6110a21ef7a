"""Diagnostic (not a benchmark): where the time of an engine step goes, per policy, at one
concurrency, with the device synchronized at the end of every step so each step's wall time is
real. Prints steps, tokens/s, and mean ms of drafted and undrafted steps with their phase split
(draft / schedule / verify launch / accept), and the gate's state. Two passes per policy; the
second is reported (the first pays one-time costs).

    python scripts/gpu-steps.py --device cuda --concurrency 16 --policies none,static:7,dspark
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark.bench.prompts import load_prompt_texts
from dspark.config import EngineConfig
from dspark.engine.factory import build_engine
from dspark.engine.speculative import SpeculativeRunner
from dspark.sampling import SamplingParams


def one_pass(engine, prompts, max_tokens: int, sync) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    rows, tokens, t_start = [], 0, time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        step = engine.step()
        sync()
        wall = time.perf_counter() - t
        if not step.ran:
            continue
        tokens += sum(len(v) for v in step.new_tokens.values())
        rows.append((step.drafter_ran, wall, dict(step.times)))
    total = time.perf_counter() - t_start
    assert all(r.is_finished for r in reqs)
    out = {"steps": len(rows), "tok_s": tokens / total}
    for flag, name in ((True, "drafted"), (False, "plain")):
        sel = [r for r in rows if r[0] == flag]
        if sel:
            phases = {k: 1e3 * statistics.mean(r[2].get(k, 0.0) for r in sel) for k in ("draft", "schedule", "verify", "accept")}
            out[name] = {"n": len(sel), "ms": 1e3 * statistics.mean(r[1] for r in sel),
                         **{k: round(v, 2) for k, v in phases.items()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--policies", default="none,static:7,dspark",
                    help="policies of the shipped dspark drafter; POLICY@N drafts from the N most frequent tokens")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    prompts = load_prompt_texts(["gsm8k", "humaneval", "mt-bench"], 8)[: args.concurrency]
    while len(prompts) < args.concurrency:
        prompts += prompts[: args.concurrency - len(prompts)]
    for name in args.policies.split(","):
        policy, _, vocab = name.partition("@")
        engine = build_engine("dspark-tiny", policy=policy, cfg=EngineConfig(device=args.device),
                              draft_vocab=int(vocab or 0))
        one_pass(engine, prompts, args.max_tokens, sync)
        res = one_pass(engine, prompts, args.max_tokens, sync)
        gate = engine.runner.gate if isinstance(engine.runner, SpeculativeRunner) else None
        state = "" if gate is None else f" gate open={gate.open} interval={gate.interval}"
        print(f"{name:10s} C={args.concurrency}: {res}{state}", flush=True)


if __name__ == "__main__":
    main()
