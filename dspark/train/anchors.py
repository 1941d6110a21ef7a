"""Training blocks: sequences packed into a batch, random anchors with valid-prefix labels.

An anchor is a position p whose token and next token are both response tokens (at serving
time every anchor is a token the target produced). Its block predicts p+1..p+gamma; the
positions past the end of the sequence are masked out, so each block's labels are a
contiguous valid prefix. Many anchors per sequence share one target pass; the attention
mask of `drafters.block.block_mask` keeps every block to its own context.
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


def valid_anchor_range(prompt_len: int, length: int) -> tuple[int, int]:
    """[lo, hi) of anchor positions: response token whose successor is a response token."""
    return prompt_len, max(prompt_len, length - 1)


def make_batch(rows: list[dict], seq_len: int, gamma: int, anchors_per_seq: int, rng: np.random.Generator,
               pad_id: int = 0) -> BlockBatch:
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
            picks = rng.choice(np.arange(lo, hi), size=count, replace=False)
            anchors[i, :count] = torch.from_numpy(np.sort(picks))
            valid_rows[i, :count] = True
    offs = torch.arange(1, gamma + 1)
    pos = anchors[..., None] + offs  # [B, A, g]
    lens = torch.tensor(lengths)[:, None, None]
    valid = (pos < lens) & valid_rows[..., None]
    labels = tokens.gather(1, pos.clamp(max=seq_len - 1).flatten(1)).view_as(pos)
    labels = torch.where(valid, labels, 0)
    return BlockBatch(tokens, anchors, labels, valid, [r.get("domain", "") for r in rows])
