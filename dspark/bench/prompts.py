"""Evaluation prompts: the shipped subsets (`assets/prompts/`) or any user JSONL file.

A prompts file has one JSON object per line with `turns` (a list; the first turn is the
prompt) or `prompt` (a string), and optionally `domain` (math, code, chat, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "assets" / "prompts"
DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
ONE_PER_DOMAIN = ("gsm8k", "humaneval", "mt-bench")  # math, code, chat: the single-stream and step benchmarks' set


@dataclass(frozen=True)
class Prompt:
    text: str
    dataset: str
    domain: str


def read_prompts(path: str | Path, dataset: str | None = None) -> list[Prompt]:
    path = Path(path)
    name = dataset or path.stem
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            text = row["turns"][0] if "turns" in row else row.get("prompt")
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{n}: needs a non-empty 'turns' list or 'prompt' string")
            out.append(Prompt(text, name, row.get("domain", "custom")))
    return out


def load_dataset(name: str) -> list[Prompt]:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; shipped: {', '.join(DATASETS)} (or use --prompts FILE)")
    return read_prompts(PROMPTS_DIR / f"{name}.jsonl", name)


def load_prompt_texts(datasets: list[str], per_dataset: int) -> list[str]:
    """Interleaved prompt texts, per_dataset from each dataset (math, code, chat mixed)."""
    lists = [[p.text for p in load_dataset(d)[:per_dataset]] for d in datasets]
    return [row[i] for i in range(per_dataset) for row in lists if i < len(row)]
