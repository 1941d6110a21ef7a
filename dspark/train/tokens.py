"""Tokenised corpus streams: one uint16 array per domain and split, sampled as windows.

`encode_corpus` renders every record (corpus.render) and concatenates the token ids;
`WindowSampler` draws training windows whose order depends only on (seed, step), so a
resumed run sees exactly the batches the killed run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from dspark.train.corpus import DOMAINS, corpus_domains, read_records, render


def encode_corpus(corpus_dir: str | Path, tokenizer: Tokenizer, out_dir: str | Path) -> dict[str, dict[str, int]]:
    """Write `{out}/{domain}.{split}.npy`; returns tokens per domain and split (domains without
    files, e.g. `agent` in a corpus built before it existed, are left out)."""
    corpus_dir, out = Path(corpus_dir).expanduser(), Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, dict[str, int]] = {}
    for domain in corpus_domains(corpus_dir, "train"):
        counts[domain] = {}
        for split in ("train", "heldout"):
            texts = [render(r) for r in read_records(corpus_dir / f"{domain}.{split}.jsonl")]
            ids = [i for enc in tokenizer.encode_batch(texts) for i in enc.ids]
            arr = np.asarray(ids, dtype=np.uint16)
            np.save(out / f"{domain}.{split}.npy", arr)
            counts[domain][split] = int(arr.size)
    return counts


def load_streams(tokens_dir: str | Path, split: str) -> dict[str, np.ndarray]:
    base = Path(tokens_dir).expanduser()
    return {d: np.load(base / f"{d}.{split}.npy", mmap_mode="r") for d in DOMAINS if (base / f"{d}.{split}.npy").is_file()}


@dataclass(frozen=True)
class WindowSampler:
    """Random windows of seq_len+1 tokens, domain chosen by weight, fixed by (seed, step)."""

    seq_len: int
    batch_size: int
    weights: tuple[float, ...]  # per domain, in DOMAINS order (fewer weights: the first domains only)
    seed: int = 0

    def batch(self, streams: dict[str, np.ndarray], step: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, step])
        probs = np.asarray(self.weights) / sum(self.weights)
        rows = []
        for _ in range(self.batch_size):
            domain = DOMAINS[rng.choice(len(probs), p=probs)]
            stream = streams[domain]
            start = int(rng.integers(0, stream.size - self.seq_len - 1))
            rows.append(np.asarray(stream[start : start + self.seq_len + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))  # [B, T+1]


def heldout_windows(stream: np.ndarray, seq_len: int, count: int) -> torch.Tensor:
    """`count` evenly spaced windows of a held-out stream: [count, seq_len+1]."""
    count = max(1, min(count, (stream.size - 1) // seq_len))
    starts = np.linspace(0, stream.size - seq_len - 1, count).astype(np.int64)
    return torch.from_numpy(np.stack([np.asarray(stream[s : s + seq_len + 1], dtype=np.int64) for s in starts]))
