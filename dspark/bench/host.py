"""`dspark bench host`: does the engine's per-step host work grow with the sequence?

One request generates `--max-tokens` (default 4,000) tokens greedily, with a stop string that
never matches (so the per-token stop-string search runs), under plain decoding and under
speculative decoding with each drafter named. Every step is timed, and so are the parts that
are model work: the target's forward (a forward hook on the target) and the drafter's calls
(`extend`, `propose`). Host time = step time - model work: scheduling, batch and metadata
building, verification bookkeeping, emitting, detokenization, stop strings. It is compared
between the steps near the start (output tokens 100-600) and near the end (the last 500).
Times are the thread's CPU time (`time.thread_time`, torch on one thread), so other load on
the machine does not count as the engine's work.

dspark-tiny holds 1,024 positions, too few for 4,000 tokens, so the benchmark builds its own
target: dspark-tiny's tokenizer and a small random-weight Qwen3 (2 layers, d = 64) with
`max_position_embeddings` 8,192, and untrained drafters for it. Random weights are fine here:
the figure is host time per step, not acceptance or text quality.

    dspark bench host [--max-tokens 4000] [--drafters eagle3,dspark,ngram] [--out docs/results/host]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from dspark import report
from dspark.config import EngineConfig, ModelConfig
from dspark.drafters.registry import new_config, new_drafter
from dspark.engine.engine import LLMEngine
from dspark.engine.factory import assemble
from dspark.models.decoder import CausalLM
from dspark.models.loader import resolve_model_path
from dspark.models.tokenizer import TextTokenizer
from dspark.sampling import SamplingParams

PROMPT = "def fibonacci(n):\n    "
START = (100, 600)  # output tokens of the "start" window
END_SPAN = 500  # the "end" window: the last this many output tokens


@dataclass(frozen=True)
class HostSettings:
    max_tokens: int = 4000
    drafters: tuple[str, ...] = ("eagle3", "dspark", "ngram")
    gamma: int = 4
    seed: int = 0


class ModelClock:
    """Seconds spent in the target's forward and the drafter's calls (the model work)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = 0.0
        self._t0 = 0.0
        engine.model.register_forward_pre_hook(lambda *_: self._start())
        engine.model.register_forward_hook(lambda *_: self._stop())
        if engine.drafter is not None:
            for name in ("extend", "propose"):
                setattr(engine.drafter, name, self._timed(getattr(engine.drafter, name)))

    def _start(self) -> None:
        self._t0 = time.thread_time()

    def _stop(self) -> None:
        self.seconds += time.thread_time() - self._t0

    def _timed(self, fn):
        def call(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - t0
        return call


def long_context_target(tokenizer: TextTokenizer, seed: int) -> CausalLM:
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
    torch.manual_seed(seed)
    return CausalLM(cfg).eval()


def run_one(net: CausalLM, tok: TextTokenizer, drafter: str | None, s: HostSettings) -> dict:
    """Per-step (output length, step seconds, host seconds) of one long generation."""
    d = None
    if drafter:
        torch.manual_seed(s.seed)
        d = new_drafter(new_config(drafter, net.config, tok.token_id("<|mask|>") or 0, gamma=s.gamma))
    engine = assemble(net, tok, EngineConfig(device="cpu", dtype="float32"), drafter=d,
                       policy=f"static:{s.gamma}" if d else "none")
    clock = ModelClock(engine)
    params = SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True, stop=("\x00never\x00",))
    req = engine.add_request(PROMPT, params)
    steps = []
    while not req.is_finished:
        before, model0, t0 = len(req.output_ids), clock.seconds, time.thread_time()
        engine.step()
        total = time.thread_time() - t0
        steps.append((before, total, total - (clock.seconds - model0)))
    out = engine.output(req)
    assert len(out.token_ids) == s.max_tokens and out.text == tok.decode(out.token_ids)
    return summarize(drafter or "none (plain)", steps, s.max_tokens)


def summarize(name: str, steps: list[tuple[int, float, float]], max_tokens: int) -> dict:
    start = [st for st in steps if START[0] <= st[0] < START[1]]
    end = [st for st in steps if st[0] >= max_tokens - END_SPAN]
    med = lambda rows, i: statistics.median(r[i] for r in rows) * 1e3  # noqa: E731
    row = {"config": name, "steps": len(steps), "steps_start": len(start), "steps_end": len(end),
           "host_ms_start": med(start, 2), "host_ms_end": med(end, 2),
           "step_ms_start": med(start, 1), "step_ms_end": med(end, 1)}
    row["host_ratio"] = row["host_ms_end"] / row["host_ms_start"]
    return row


def run(s: HostSettings, out_dir: str) -> list[dict]:
    torch.set_num_threads(1)
    tok = TextTokenizer.from_dir(resolve_model_path(None))
    net = long_context_target(tok, s.seed)
    rows = [run_one(net, tok, drafter, s) for drafter in (None, *s.drafters)]
    headers = ["config", "steps", "host ms/step (start)", "host ms/step (end)", "end/start",
               "step ms (start)", "step ms (end)"]
    table = report.table(headers, [[r["config"], r["steps"], r["host_ms_start"], r["host_ms_end"], r["host_ratio"],
                                     r["step_ms_start"], r["step_ms_end"]] for r in rows])
    markdown = (f"# Per-step host time over a {s.max_tokens}-token generation\n\n" + __doc__.split("\n\n    dspark")[0]
                + f"\n\nMedians over the steps that began at output tokens {START[0]}-{START[1]} (start) and in the "
                f"last {END_SPAN} (end); speculative rows use `static:{s.gamma}`. One torch thread.\n\n" + table)
    report.write(out_dir, "host-steps", {"settings": s.__dict__, "rows": rows}, markdown)
    print(table)
    return rows
