"""`dspark train eval-target`: the numbers and samples of a target's model card.

For one model directory it measures
- held-out loss per domain: next-token cross-entropy on evenly spaced windows of the
  held-out token streams (`dspark train tokenizer --tokens`);
- greedy behaviour per domain on held-out chat-form prompts rendered as ChatML, generated
  in one batch by the engine: how often it stops with EOS, how long it runs, and how often
  it falls into a repetition loop (`is_repetition_loop`); for math, how often the answer
  marker `####` appears;
- agent tasks: the share of held-out agent prompts whose greedy answer solves the task
  (`dspark.agent.tasks.check`: exact match for code edits, equal JSON for JSON kinds) and
  the share that is valid JSON where the answer is JSON, per task kind;
- samples: greedy and temperature-1 (fixed seed) outputs for one prompt per domain.

`evaluate` returns everything as a dict (written as JSON), `render_markdown` turns it into
the model card's sections.

    dspark train eval-target --model ~/.cache/dspark/export/dspark-tiny-target --out eval.json
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.train.corpus import chat_text, corpus_domains, read_records
from dspark.train.target import lm_loss
from dspark.train.tokens import heldout_windows, load_streams

ANSWER_MARKER = "####"  # GSM8K's final-answer line


@dataclass(frozen=True)
class EvalSettings:
    num_prompts: int = 50  # per domain
    max_tokens: int = 256
    loss_windows: int = 32  # per domain
    loss_seq_len: int = 512
    loss_batch: int = 4  # windows per forward (bounds the [B, T, vocab] logits)
    loop_window: int = 96
    loop_max_period: int = 32
    seed: int = 0  # of the temperature-1 samples
    device: str = "cpu"
    dtype: str = "float32"


# ---- repetition loops -----------------------------------------------------------------
def loop_period(tokens: Sequence[int], window: int = 96, max_period: int = 32) -> int | None:
    """Smallest p <= max_period with tokens[-window:] periodic of period p, else None.

    A period must fit at least twice in the window, so p <= window // 2 as well.
    """
    if window < 2 or max_period < 1:
        raise ValueError("window must be >= 2 and max_period >= 1")
    if len(tokens) < window:
        return None
    tail = [int(t) for t in tokens[-window:]]
    for p in range(1, min(max_period, window // 2) + 1):
        if tail[p:] == tail[:-p]:  # t[i] == t[i + p] for every i in the window
            return p
    return None


def is_repetition_loop(tokens: Sequence[int], window: int = 96, max_period: int = 32) -> bool:
    """True when the last `window` tokens repeat exactly with some period <= max_period."""
    return loop_period(tokens, window, max_period) is not None


# ---- held-out loss --------------------------------------------------------------------
@torch.no_grad()
def stream_loss(net, stream: np.ndarray, seq_len: int, windows: int, batch: int) -> dict[str, float | int]:
    """Mean next-token cross-entropy over evenly spaced windows, `batch` windows a forward."""
    seq_len = min(seq_len, net.config.max_position_embeddings, int(stream.size) - 1)
    rows = heldout_windows(stream, seq_len, windows)
    if int(rows.max()) >= net.config.vocab_size:
        raise ValueError("held-out token ids exceed the model's vocabulary: streams from another tokenizer?")
    total = 0.0
    for chunk in rows.split(batch):
        total += float(lm_loss(net, chunk.to(net.device))) * len(chunk)  # equal-length windows
    loss = total / len(rows)
    return {"loss": loss, "perplexity": math.exp(loss), "windows": len(rows), "seq_len": seq_len}


def heldout_losses(net, tokens_dir: str | Path, s: EvalSettings) -> dict[str, dict[str, float | int]]:
    streams = load_streams(tokens_dir, "heldout")
    return {d: stream_loss(net, stream, s.loss_seq_len, s.loss_windows, s.loss_batch) for d, stream in streams.items()}


# ---- generations ----------------------------------------------------------------------
def heldout_records(corpus_dir: str | Path, domain: str, engine, s: EvalSettings) -> list[dict]:
    """`num_prompts` evenly spaced chat-form held-out records whose answers fit the context."""
    path = Path(corpus_dir).expanduser() / f"{domain}.heldout.jsonl"
    budget = engine.max_model_len - s.max_tokens
    records = [r for r in read_records(path)
               if "prompt" in r and len(engine.tokenizer.encode(chat_text(r["prompt"]))) <= budget]
    n = min(s.num_prompts, len(records))
    return [records[i * len(records) // n] for i in range(n)]


def agent_rates(records: list[dict], outs: list) -> dict[str, dict[str, float | int]]:
    """Per task kind: how many prompts, the share solved and the share of valid JSON answers."""
    from dspark.agent.tasks import check, valid_json

    kinds: dict[str, list[tuple[bool, bool]]] = {}
    for r, o in zip(records, outs, strict=True):
        kinds.setdefault(r["kind"], []).append((check(r["kind"], r["response"], o.text), valid_json(o.text)))
    return {k: {"prompts": len(v), "solved": sum(a for a, _ in v) / len(v), "valid_json": sum(b for _, b in v) / len(v)}
            for k, v in sorted(kinds.items())}


def generate(engine, prompts: list[str], params: list) -> list:
    """ChatML-rendered prompts, one SamplingParams each, in one engine batch."""
    reqs = [engine.add_request(chat_text(p), sp) for p, sp in zip(prompts, params, strict=True)]
    return engine.run_until_done(reqs)


def generation_stats(outs: list, domain: str, s: EvalSettings) -> dict[str, Any]:
    """Loop / stop rates and mean length; an output that stopped with EOS is never a loop."""
    periods = [None if o.finish_reason == "stop" else loop_period(o.token_ids, s.loop_window, s.loop_max_period)
               for o in outs]
    n = max(1, len(outs))
    stats: dict[str, Any] = {
        "prompts": len(outs),
        "loop_rate": sum(p is not None for p in periods) / n,
        "stop_rate": sum(o.finish_reason == "stop" for o in outs) / n,
        "mean_tokens": sum(len(o.token_ids) for o in outs) / n,
        "per_prompt": [{"tokens": len(o.token_ids), "finish": o.finish_reason, "loop_period": p}
                       for o, p in zip(outs, periods, strict=True)],
    }
    if domain == "math":
        stats["answer_marker_rate"] = sum(ANSWER_MARKER in o.text for o in outs) / n
    return stats


def evaluate(model: str | Path, corpus_dir: str | Path, tokens_dir: str | Path,
             s: EvalSettings = EvalSettings()) -> dict[str, Any]:
    from dspark.config import EngineConfig
    from dspark.engine.factory import assemble
    from dspark.models.loader import load_model
    from dspark.sampling import SamplingParams

    net, tok = load_model(model, s.device, s.dtype)
    engine = assemble(net, tok, EngineConfig(device=s.device, dtype=s.dtype, seed=s.seed,
                                              max_num_seqs=max(64, s.num_prompts)))
    greedy = SamplingParams(temperature=0.0, max_tokens=s.max_tokens)
    result: dict[str, Any] = {"model": str(model), "settings": asdict(s),
                              "heldout_loss": heldout_losses(net, tokens_dir, s), "generation": {}, "samples": []}
    firsts = []
    for domain in corpus_domains(corpus_dir, "heldout"):
        records = heldout_records(corpus_dir, domain, engine, s)
        if not records:
            continue
        prompts = [r["prompt"] for r in records]
        outs = generate(engine, prompts, [greedy] * len(prompts))
        result["generation"][domain] = generation_stats(outs, domain, s)
        if domain == "agent":
            result["agent_tasks"] = agent_rates(records, outs)
        firsts.append((domain, prompts[0], outs[0]))
    # one seed per domain (seed, seed+1, ...): the same seed would replay one random stream
    sampled = [SamplingParams(temperature=1.0, max_tokens=s.max_tokens, seed=s.seed + i) for i in range(len(firsts))]
    hot = generate(engine, [p for _, p, _ in firsts], sampled)
    for (domain, prompt, cold), warm, sp in zip(firsts, hot, sampled, strict=True):
        result["samples"].append({
            "domain": domain, "prompt": prompt,
            "greedy": {"text": cold.text, "finish": cold.finish_reason, "tokens": len(cold.token_ids)},
            "temperature_1": {"text": warm.text, "finish": warm.finish_reason, "tokens": len(warm.token_ids),
                              "seed": sp.seed},
        })
    return result


# ---- the model card's sections --------------------------------------------------------
def _fence(text: str) -> str:
    """A code fence longer than any backtick run inside text (outputs contain ```python)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}\n{text}\n{ticks}"


def render_markdown(result: dict[str, Any]) -> str:
    from dspark.report import table

    s = result["settings"]
    losses = result["heldout_loss"]
    out = ["### Held-out loss\n",
           "Next-token cross-entropy (nats per token) on evenly spaced windows of each domain's held-out "
           f"token stream (up to {s['loss_windows']} windows of {s['loss_seq_len']} tokens).\n",
           table(["domain", "loss", "perplexity", "windows × tokens"],
                 [[d, v["loss"], v["perplexity"], f"{v['windows']} × {v['seq_len']}"] for d, v in losses.items()]),
           "### Greedy generations: stops and repetition loops\n",
           f"Up to {s['num_prompts']} held-out chat prompts per domain in the ChatML template, greedy, at most "
           f"{s['max_tokens']} new tokens, all of a domain in one engine batch. A generation is in a repetition "
           f"loop when it did not stop with EOS, has at least {s['loop_window']} tokens and its last "
           f"{s['loop_window']} tokens repeat exactly with a period of at most {s['loop_max_period']} tokens.\n"]
    gen = result["generation"]
    rows = [[d, g["prompts"], g["loop_rate"], g["stop_rate"], g["mean_tokens"],
             g["answer_marker_rate"] if "answer_marker_rate" in g else "–"] for d, g in gen.items()]
    out.append(table(["domain", "prompts", "loop rate", "stop (EOS) rate", "mean new tokens",
                      f"contains `{ANSWER_MARKER}`"], rows))
    if "agent_tasks" in result:
        out.append("### Agent tasks\n")
        out.append("Greedy answers to the held-out agent prompts above, by task kind: solved (`dspark.agent.tasks.check`: "
                   "exact match for code edits, equal JSON for logs, JSON edits and tool calls, at least five words "
                   "for plans) and valid JSON.\n")
        out.append(table(["kind", "prompts", "solved", "valid JSON"],
                         [[k, v["prompts"], v["solved"], v["valid_json"]] for k, v in result["agent_tasks"].items()]))
    out.append("### Samples\n")
    out.append(f"One held-out prompt per domain; greedy, and temperature 1 (seeds from {s['seed']}, one per "
               f"domain); at most {s['max_tokens']} new tokens.\n")
    for sample in result["samples"]:
        out.append(f"#### {sample['domain']}\n\nPrompt:\n\n{_fence(sample['prompt'])}\n")
        for key, name in (("greedy", "Greedy"), ("temperature_1", "Temperature 1")):
            g = sample[key]
            seed = f", seed {g['seed']}" if "seed" in g else ""
            out.append(f"{name} ({g['tokens']} tokens, finish: {g['finish']}{seed}):\n\n{_fence(g['text'])}\n")
    return "\n".join(out)
