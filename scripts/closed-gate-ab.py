"""Diagnostic (not a benchmark): what the speculative engine costs against plain decoding on
the same closed-loop load, with machine drift cancelled by stepping the two engines
alternately (one `none` step, one `dspark:dspark` step, ...), each keeping C requests in
flight from the same job list until it has served the same requests.

`dspark bench online` runs each configuration's whole pass in turn, so a noisy neighbour
that slows one pass moves its ratio by several percent; here both engines see the same
machine at every moment, so the ratio isolates the engine's own cost (gate, context
hand-over, probes). Prints per repeat: steps, ms per step, tokens/s, the ratio, and the
time of drafted steps.

    python scripts/closed-gate-ab.py --workload hostile --concurrency 4 --requests 16 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from dspark.bench.online import OnlineSettings, jobs_for
from dspark.bench.workload import engine_config
from dspark.engine.factory import build_engine
from dspark.models.loader import read_config, resolve_model_path
from dspark.models.tokenizer import TextTokenizer
from dspark.sampling import SamplingParams


class Clients:
    """C closed-loop clients on one engine, advanced one engine step at a time."""

    def __init__(self, engine, jobs, concurrency: int, total: int, max_tokens: int) -> None:
        self.engine, self.jobs, self.c, self.total, self.max_tokens = engine, jobs, concurrency, total, max_tokens
        self.sent, self.live, self.tokens = 0, [], 0
        self.times: list[float] = []
        self.drafted: list[bool] = []

    def step(self) -> bool:
        while len(self.live) < self.c and self.sent < self.total:
            job = self.jobs[self.sent % len(self.jobs)]
            params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, seed=self.sent)
            self.live.append(self.engine.add_request(job.ids, params))
            self.sent += 1
        if not self.live:
            return False
        runner = self.engine.runner
        before = getattr(runner, "drafted_steps", 0)
        t = time.perf_counter()
        self.engine.step()
        self.times.append(time.perf_counter() - t)
        self.drafted.append(getattr(runner, "drafted_steps", 0) > before)
        self.tokens += sum(len(v) for v in self.engine.last_step.tokens.values())
        for req in [r for r in self.live if r.is_finished]:
            self.engine.requests.pop(req.request_id, None)
        self.live = [r for r in self.live if not r.is_finished]
        return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=["mixed", "hostile"], default="hostile")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16, help="requests each engine serves per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    s = OnlineSettings(workload=args.workload, concurrency=(args.concurrency,))
    path = resolve_model_path(None)
    jobs = jobs_for(s, TextTokenizer.from_dir(path), read_config(path).max_position_embeddings)
    cfg = engine_config(path, args.concurrency, max(len(j.ids) for j in jobs) + s.max_tokens + 9, args.device)
    plain = build_engine(path, None, "none", cfg)
    spec = build_engine(path, "dspark", "dspark", cfg, profile="auto")
    ratios = []
    for rep in range(args.repeats):
        a = Clients(plain, jobs, args.concurrency, args.requests, s.max_tokens)
        b = Clients(spec, jobs, args.concurrency, args.requests, s.max_tokens)
        while a.step() | b.step():
            pass
        rate_a, rate_b = a.tokens / sum(a.times), b.tokens / sum(b.times)
        ratios.append(rate_b / rate_a)
        drafted = [t for t, d in zip(b.times, b.drafted, strict=True) if d]
        print(f"repeat {rep}: none {len(a.times)} steps {1e3 * statistics.mean(a.times):.2f} ms/step {rate_a:.1f} tok/s | "
              f"dspark:dspark {len(b.times)} steps {1e3 * statistics.mean(b.times):.2f} ms/step {rate_b:.1f} tok/s | "
              f"ratio {rate_b / rate_a:.3f} | drafted steps {len(drafted)} ({1e3 * sum(drafted):.0f} ms)", flush=True)
    print(f"{args.workload} C={args.concurrency}: dspark:dspark / none {statistics.mean(ratios):.3f} "
          f"(repeats: {', '.join(f'{r:.3f}' for r in ratios)}; the first repeat includes the gate's first probes)")


if __name__ == "__main__":
    main()
