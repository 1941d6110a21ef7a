"""Training blocks: sequences packed into a batch, random anchors with valid-prefix labels.

An anchor is a position p whose token and next token are both response tokens (at serving
time every anchor is a token the target produced). Its block predicts p+1..p+gamma; the
positions past the end of the sequence are masked out, so each block's labels are a
contiguous valid prefix. Many anchors per sequence share one target pass; the attention
mask of `drafters.block.block_mask` keeps every block to its own context.

A row may carry `walk`: the positions a greedy run's rounds start from along it (`dspark train walk`).
With `walked` > 0 that share of its anchors is drawn from those, the rest uniformly: uniform anchors
weigh the easy stretches a run crosses in a few long rounds as much as the hard ones where it spends
most of its rounds, and a round start is a token the drafter did not propose.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class BlockBatch:
    tokens: torch.Tensor  # [B, T] long, right-padded
    anchors: torch.Tensor  # [B, A] long positions
    labels: torch.Tensor  # [B, A, g] long, tokens at p+1..p+g (0 where invalid)
    valid: torch.Tensor  # [B, A, g] bool
    domains: list[str]
    fed: torch.Tensor | None = None  # [B, A] bool: blocks whose slots read the text's tokens, not masks (None: none)


def valid_anchor_range(prompt_len: int, length: int) -> tuple[int, int]:
    """[lo, hi) of anchor positions: response token whose successor is a response token."""
    return prompt_len, max(prompt_len, length - 1)


def pick_anchors(row: dict, lo: int, hi: int, count: int, walked: float, rng: np.random.Generator) -> np.ndarray:
    """`count` distinct sorted positions in [lo, hi): a `walked` share from the row's round starts (as many as
    it has), the rest uniformly from the others."""
    walk = np.array([p for p in row.get("walk", ()) if lo <= p < hi], dtype=np.int64)
    take = min(len(walk), round(count * walked))
    first = rng.choice(walk, size=take, replace=False) if take else np.zeros(0, dtype=np.int64)
    rest = rng.choice(np.setdiff1d(np.arange(lo, hi), first), size=count - take, replace=False)
    return np.sort(np.concatenate([first, rest]))


def make_batch(rows: list[dict], seq_len: int, gamma: int, anchors_per_seq: int, rng: np.random.Generator,
               pad_id: int = 0, walked: float = 0.0) -> BlockBatch:
    b = len(rows)
    tokens = torch.full((b, seq_len), pad_id, dtype=torch.long)
    anchors = torch.zeros(b, anchors_per_seq, dtype=torch.long)
    valid_rows = torch.zeros(b, anchors_per_seq, dtype=torch.bool)
    lengths = []
    for i, row in enumerate(rows):
        seq = (list(row["prompt_ids"]) + list(row["response_ids"]))[:seq_len]
        tokens[i, : len(seq)] = torch.tensor(seq)
        lengths.append(len(seq))
        lo, hi = valid_anchor_range(len(row["prompt_ids"]), len(seq))
        if hi > lo:
            count = min(anchors_per_seq, hi - lo)
            anchors[i, :count] = torch.from_numpy(pick_anchors(row, lo, hi, count, walked, rng))
            valid_rows[i, :count] = True
    offs = torch.arange(1, gamma + 1)
    pos = anchors[..., None] + offs  # [B, A, g]
    lens = torch.tensor(lengths)[:, None, None]
    valid = (pos < lens) & valid_rows[..., None]
    labels = tokens.gather(1, pos.clamp(max=seq_len - 1).flatten(1)).view_as(pos)
    labels = torch.where(valid, labels, 0)
    return BlockBatch(tokens, anchors, labels, valid, [r.get("domain", "") for r in rows])
