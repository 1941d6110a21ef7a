"""Draft vocabularies: the target's tokens ranked by how often the target emits them.

`dspark draft-vocab --data FILE.jsonl [--model M]` counts the tokens of the target's own
answers (rows with `response_ids`, as `dspark train regen` writes them, or a `text` string,
tokenised) and writes `token_counts.json` into the model's directory. `--draft-vocab N`
(generate, serve, bench; `LLM(draft_vocab=N)`) then drafts from the N most frequent tokens
(`NeuralDrafter.restrict_vocab`): a cheaper proposal, the same output distribution.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from dspark.models.tokenizer import TextTokenizer

FILE = "token_counts.json"


def count_tokens(rows: Iterable[dict], tokenizer: TextTokenizer) -> Counter:
    """Token frequencies over rows with `response_ids` (token ids) or `text` (a string)."""
    counts: Counter = Counter()
    for i, row in enumerate(rows):
        if isinstance(row.get("response_ids"), list):
            counts.update(int(t) for t in row["response_ids"])
        elif isinstance(row.get("text"), str):
            counts.update(tokenizer.encode(row["text"]))
        else:
            raise ValueError(f"row {i}: needs `response_ids` (a list of token ids) or `text` (a string)")
    return counts


def write_counts(model_dir: Path, counts: Counter, source: str) -> Path:
    """token_counts.json: token ids most frequent first, with their counts."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    path = Path(model_dir) / FILE
    path.write_text(json.dumps({"source": source, "total": sum(counts.values()),
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
    cum, out, total = 0, {}, max(1, data["total"])
    wanted = sorted(set(sizes))
    for rank, c in enumerate(data["counts"], start=1):
        cum += c
        if wanted and rank == wanted[0]:
            out[wanted.pop(0)] = cum / total
    out.update({s: cum / total for s in wanted})
    return out
