"""The flattened layout of one target forward: many requests' new tokens in one `[N]` row.

Request r contributes `query_lens[r]` tokens (a prefill chunk; the anchor; or the anchor
and its draft tokens), at offsets `cu_seqlens[r] .. cu_seqlens[r+1]`. Logits are computed
only for the last `num_logits[r]` tokens of each request (1 to sample, 1+l_r to verify).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.config import PAD_ROWS
from dspark.device import upload
from dspark.kv_cache import BlockPool
from dspark.models.attention import AttentionMetadata


@dataclass(frozen=True)
class BatchRow:
    """One request's part of the flat batch."""

    seq_id: str
    tokens: Sequence[int]  # new tokens fed this step
    context_len: int  # cached tokens after this step's tokens are written
    num_logits: int  # logits wanted for the last num_logits tokens


@dataclass(frozen=True)
class Batch:
    rows: tuple[BatchRow, ...]
    input_ids: torch.Tensor  # [N] long
    cu_seqlens: torch.Tensor  # [R+1] long, offsets of each request's tokens
    offsets: list[int]  # the same offsets on the host (reading the tensor would wait for the device)
    logits_indices: torch.Tensor  # [M] long, flat rows that need logits, request-major
    cu_logits: list[int]  # [R+1] offsets of each request's rows in the logits
    meta: AttentionMetadata

    @staticmethod
    def build(rows: Sequence[BatchRow], pool: BlockPool, device: torch.device | str, pad_rows: int = PAD_ROWS) -> Batch:
        qlens = [len(r.tokens) for r in rows]
        offsets = [0]
        for q in qlens:
            offsets.append(offsets[-1] + q)
        logits_idx = [i for r, end in zip(rows, offsets[1:], strict=True) for i in range(end - r.num_logits, end)]
        cu_logits = [0]
        for r in rows:
            cu_logits.append(cu_logits[-1] + r.num_logits)
        meta = AttentionMetadata.build(
            qlens, [r.context_len for r in rows], [pool.block_table(r.seq_id) for r in rows], pool.block_size, device,
            pad_rows=pad_rows,
        )
        return Batch(
            rows=tuple(rows),
            input_ids=upload([t for r in rows for t in r.tokens], device, torch.long),
            cu_seqlens=upload(offsets, device, torch.long),
            offsets=offsets,
            logits_indices=upload(logits_idx, device, torch.long),
            cu_logits=cu_logits,
            meta=meta,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
