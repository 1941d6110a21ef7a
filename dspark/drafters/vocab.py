"""Draft vocabularies: the target's tokens ranked by how often the target emits them.

`dspark draft-vocab --data FILE.jsonl [--model M]` counts the tokens of the target's own
answers (rows with `response_ids`, as `dspark train regen` writes them, or a `text` string,
tokenised) and writes `token_counts.json` into the model's directory. `--expected` counts
instead what the target expects at temperature 1: its full next-token distribution summed
over every answer position (answers sampled at a lower temperature, or with top-p, undercount
the tail that temperature-1 sampling draws from). `--draft-vocab N`
(generate, serve, bench; `LLM(draft_vocab=N)`) then drafts from the N most frequent tokens
(`NeuralDrafter.restrict_vocab`): a cheaper proposal, the same output distribution.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from itertools import accumulate
from pathlib import Path

import torch

from dspark.models.decoder import CausalLM
from dspark.models.tokenizer import TextTokenizer

FILE = "token_counts.json"


def answer(row: dict, i: int, tokenizer: TextTokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of row i: `prompt_ids` (optional) + `response_ids`, or a `text`
    string (all answer, no prompt)."""
    if isinstance(row.get("response_ids"), list):
        return [int(t) for t in row.get("prompt_ids", [])], [int(t) for t in row["response_ids"]]
    if isinstance(row.get("text"), str):
        return [], tokenizer.encode(row["text"])
    raise ValueError(f"row {i}: needs `response_ids` (a list of token ids) or `text` (a string)")


def count_tokens(rows: Iterable[dict], tokenizer: TextTokenizer) -> Counter:
    """Token frequencies over the rows' answers (see `answer`)."""
    counts: Counter = Counter()
    for i, row in enumerate(rows):
        counts.update(answer(row, i, tokenizer)[1])
    return counts


@torch.inference_mode()
def expected_counts(rows: Iterable[dict], model: CausalLM, tokenizer: TextTokenizer) -> Counter:
    """The target's next-token probabilities (temperature 1) summed over the answer positions:
    rows with `prompt_ids` + `response_ids` (the answer's positions) or `text` (every position)."""
    total = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    limit = model.config.max_position_embeddings
    for i, row in enumerate(rows):
        prompt, ids = answer(row, i, tokenizer)
        seq = (prompt + ids)[:limit]
        first = max(len(prompt) - 1, 0)  # the distribution that predicts the answer's first token
        if len(seq) - 1 <= first:
            continue
        hidden, _ = model.forward_dense(torch.tensor([seq], device=model.device))
        probs = model.logits(hidden[0, first : len(seq) - 1], normed=True).softmax(-1)
        total += probs.sum(0).double().cpu()
    return Counter({t: float(c) for t, c in enumerate(total.tolist()) if c > 0})


def write_counts(model_dir: Path, counts: Counter, source: str, kind: str = "sampled") -> Path:
    """token_counts.json: token ids most frequent first, with their counts (sampled tokens, or the
    target's expected counts)."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    path = Path(model_dir) / FILE
    path.write_text(json.dumps({"source": source, "kind": kind, "total": sum(counts.values()),
                                "ids": [t for t, _ in ranked], "counts": [c for _, c in ranked]}))
    return path


def read_counts(model_dir: Path) -> dict:
    path = Path(model_dir) / FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {FILE} in {model_dir}: count the target's tokens first "
                                f"(dspark draft-vocab --model {model_dir} --data ANSWERS.jsonl)")
    return json.loads(path.read_text())


def top_ids(model_dir: Path, size: int) -> list[int]:
    """The `size` most frequent token ids of the model's counts."""
    ranked = read_counts(model_dir)["ids"]
    if not 1 <= size <= len(ranked):
        raise ValueError(f"draft vocabulary size must be in 1..{len(ranked)} (the tokens counted in {FILE})")
    return ranked[:size]


def coverage(model_dir: Path, sizes: Iterable[int]) -> dict[int, float]:
    """Share of the counted tokens inside the top-`size` set, per size."""
    data = read_counts(model_dir)
    cum, total = list(accumulate(data["counts"])), max(1, data["total"])
    return {s: cum[min(s, len(cum)) - 1] / total if cum else 0.0 for s in sorted(set(sizes))}
