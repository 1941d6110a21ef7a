"""`dspark train regen`: the target answers the training prompts, so drafters learn the
target's own distribution rather than the dataset's (`docs/architecture.md`, Calibration and drafter training).

Chat-form records of every domain (math questions, code completion tasks, "explain"
prompts) are rendered with the chat template and answered through the project's own
batched engine at temperature 0.7, top-p 0.8, top-k 20 (the paper's settings), or with
`--temperature 0` greedily: a drafter that serves greedy requests is judged on the target's
greedy text, which is more predictable than its sampled text and differs from it (answers
from both can be concatenated into one training file). Output: JSONL rows `{"domain",
"prompt_ids", "response_ids", "finish_reason", "temperature"}`.

    dspark train regen --model dspark-tiny --corpus ~/.cache/dspark/corpus \
        --out ~/.cache/dspark/regen/train.jsonl --per-domain 2000 --max-tokens 256
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from dspark.train.corpus import chat_text, corpus_domains, read_records, shuffled
from dspark.train.styles import check_style, styled


def chosen_domains(corpus_dir: str | Path, split: str, domains: Sequence[str] | None = None) -> list[str]:
    """The corpus's domains for `split`, or those of `domains` (a clear error naming any the corpus lacks)."""
    have = corpus_domains(corpus_dir, split)
    if domains is None:
        return have
    missing = [d for d in domains if d not in have]
    if missing or not domains:
        raise ValueError(f"unknown domains {', '.join(missing) or '(none given)'} for the {split} split; "
                         f"the corpus has {', '.join(have)}")
    return [d for d in have if d in domains]


def chat_prompts(corpus_dir: str | Path, split: str, per_domain: int, seed: int = 0,
                 style: str = "corpus", domains: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """(domain, rendered prompt) pairs: up to per_domain chat-form records of each domain (every domain the
    corpus has, or `domains`), worded in `style` (`train/styles.py`)."""
    base = Path(corpus_dir).expanduser()
    rng = random.Random(seed)
    out = []
    for domain in chosen_domains(base, split, domains):
        records = [r for r in read_records(base / f"{domain}.{split}.jsonl") if "prompt" in r]
        out += [(domain, chat_text(styled(domain, r["prompt"], style, rng))) for r in shuffled(records, seed)[:per_domain]]
    return out


def answer_params(temperature: float, max_tokens: int, seed: int):
    """The sampling settings of one answer: greedy at temperature 0 (top-p / top-k and the seed then
    change nothing), else sampled with the paper's top-p / top-k. SamplingParams checks the temperature."""
    from dspark.sampling import SamplingParams

    return SamplingParams(temperature=temperature, top_p=0.8, top_k=20, max_tokens=max_tokens, seed=seed)


def regenerate(model: str, corpus_dir: str, out_path: str, split: str = "train", per_domain: int = 2000,
               max_tokens: int = 256, batch: int = 64, seed: int = 0, device: str = "cpu",
               temperature: float = 0.7, style: str = "corpus", domains: Sequence[str] | None = None) -> int:
    """Answer per_domain prompts of every domain (or of `domains`) into out_path (resuming where it stopped);
    the number of prompts. temperature 0: greedy answers, else sampled with top-p 0.8, top-k 20. style: the
    prompts' wording (`train/styles.py`)."""
    from dspark.config import EngineConfig
    from dspark.llm import LLM

    answer_params(temperature, max_tokens, seed)  # a bad temperature or style fails before the model loads
    check_style(style)
    prompts = chat_prompts(corpus_dir, split, per_domain, seed, style, domains)  # an unknown domain fails here too
    llm = LLM(model, EngineConfig(device=device, max_num_seqs=batch, max_num_batched_tokens=2048))
    limit = llm.engine.max_model_len - max_tokens
    out = Path(out_path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    done = sum(1 for _ in open(out)) if out.is_file() else 0  # resume an interrupted run
    with open(out, "a") as f, tqdm(total=len(prompts), initial=done, desc=f"regen {split}") as bar:
        for start in range(done, len(prompts), batch):
            chunk = prompts[start : start + batch]
            ids = [llm.tokenizer.encode(text)[-limit:] for _, text in chunk]
            params = [answer_params(temperature, max_tokens, seed + start + i) for i in range(len(chunk))]
            for (domain, _), p, o in zip(chunk, ids, llm.generate(ids, params), strict=True):
                f.write(json.dumps({"domain": domain, "prompt_ids": p, "response_ids": o.token_ids,
                                    "finish_reason": o.finish_reason, "temperature": temperature}) + "\n")
            f.flush()
            bar.update(len(chunk))
    return len(prompts)
