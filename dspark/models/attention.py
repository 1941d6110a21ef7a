"""Attention over a flattened variable-length batch that reads a paged KV cache.

The engine concatenates the new tokens of many requests into one flat `[N]` batch (a
prefill chunk of one request, the decode token of another, the anchor and draft tokens
of a third). Projections run on the flat tensor; only attention regroups queries per
request, because each request attends to its own cached keys with its own causal offset.

`AttentionMetadata.build` is computed once per step and shared by all layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from dspark.device import upload


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each flat token sits, and which cache slots each request attends to.

    For R requests, N flat tokens, Q = max query length, K = max context length rounded up to
    whole blocks (B blocks of `block_size`):
    """

    positions: torch.Tensor  # [N] absolute position of each new token
    slot_mapping: torch.Tensor  # [N] cache slot each new token's K/V is written to
    query_index: torch.Tensor  # [R, Q] flat index of request r's i-th new token (0 = pad)
    query_rows: torch.Tensor  # [N] long: the valid entries of the flattened [R, Q] grid, in order
    kv_blocks: torch.Tensor  # [R, B] cache block of request r's j-th block of context (0 = pad)
    mask: torch.Tensor  # [R, 1, Q, K] bool, True where query i may attend to key j
    block_size: int = 16

    @staticmethod
    def build(
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str,
        causal: bool = True,
    ) -> AttentionMetadata:
        """context_lens[r] counts the request's cached tokens *including* its new ones.

        The new tokens of request r take positions context_lens[r]-query_lens[r] .. -1.
        With causal=False the new tokens also see each other in both directions (a draft
        block attending bidirectionally within itself, after its injected context).
        """
        if any(q < 1 or c < q for q, c in zip(query_lens, context_lens, strict=True)):
            raise ValueError("every request needs >= 1 new token and context_len >= query_len")
        qlens = torch.tensor(query_lens, dtype=torch.long)
        clens = torch.tensor(context_lens, dtype=torch.long)
        num_q, num_k = max(query_lens), max(context_lens)
        offs = torch.arange(num_q)
        query_valid = offs[None, :] < qlens[:, None]  # [R, Q]
        starts = torch.cumsum(qlens, 0) - qlens
        query_index = torch.where(query_valid, starts[:, None] + offs[None, :], 0)
        qpos = (clens - qlens)[:, None] + offs[None, :]  # [R, Q]
        positions = qpos[query_valid]  # [N]
        width = -(-num_k // block_size)  # the blocks attention reads: whole blocks up to the longest context
        if any(len(t) * block_size < c for t, c in zip(block_tables, context_lens, strict=True)):
            raise ValueError("a block table is shorter than its context")
        tables = torch.tensor([list(t[:width]) + [0] * (width - len(t[:width])) for t in block_tables],
                              dtype=torch.long)  # [R, B]
        keys = torch.arange(width * block_size)
        kv_valid = keys[None, :] < clens[:, None]  # [R, K]: a block's tail past the context, and padding, are masked
        qblock = tables.gather(1, torch.where(query_valid, qpos, 0) // block_size)  # [R, Q]
        slot_mapping = (qblock * block_size + qpos % block_size)[query_valid]
        mask = kv_valid[:, None, :].expand(-1, num_q, -1)
        if causal:
            mask = mask & (keys[None, None, :] <= qpos[:, :, None])
        mask = mask | ~query_valid[:, :, None] & (keys == 0)  # padded rows see key 0: no NaN
        return AttentionMetadata(
            positions=upload(positions, device),
            slot_mapping=upload(slot_mapping, device),
            query_index=upload(query_index, device),
            query_rows=upload(query_valid.flatten().nonzero()[:, 0], device),  # found on the host, not the device
            kv_blocks=upload(tables, device),
            mask=upload(mask[:, None], device),
            block_size=block_size,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def paged_attention(
    q: torch.Tensor,  # [N, H, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    meta: AttentionMetadata,
) -> torch.Tensor:  # [N, H, D]
    """Write the new K/V into their slots, then attend each request to its own context."""
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    heads, kv_heads = q.shape[1], k.shape[1]
    rep = heads // kv_heads
    qp = q[meta.query_index].transpose(1, 2)  # [R, H, Q, D]
    kp, vp = context_kv(k_cache, meta), context_kv(v_cache, meta)  # [R, Hkv, K, D]
    r, _, nq, d = qp.shape
    mask = meta.mask
    if rep > 1:  # GQA without copying K/V: fold each KV head's query group into the query axis
        qp = qp.reshape(r, kv_heads, rep * nq, d)
        mask = mask.repeat(1, 1, rep, 1)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)  # [R, Hkv, rep*Q, D]
    out = out.reshape(r, heads, nq, d)
    # a long index, not the bool mask: masking on the device must wait for it to count the rows
    return out.transpose(1, 2).reshape(r * nq, heads, d)[meta.query_rows]  # [N, H, D]


def context_kv(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[num_slots, Hkv, D] -> each request's context [R, Hkv, K, D], gathered whole blocks at a
    time (a block is one contiguous copy: at 64 requests this halves the gather's cost against
    indexing every slot)."""
    r, width = meta.kv_blocks.shape
    blocks = cache.view(-1, meta.block_size, *cache.shape[1:])  # [num_blocks, block_size, Hkv, D]
    picked = blocks.index_select(0, meta.kv_blocks.flatten())  # [R*B, block_size, Hkv, D]
    return picked.view(r, width * meta.block_size, *cache.shape[1:]).transpose(1, 2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention for training: q [B, T, H, D], k/v [B, T, Hkv, D] -> [B, T, H, D]."""
    heads, kv_heads = q.shape[2], k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
