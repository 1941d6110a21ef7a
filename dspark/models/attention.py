"""Attention over a flattened variable-length batch that reads a paged KV cache.

The engine concatenates the new tokens of many requests into one flat `[N]` batch (a
prefill chunk of one request, the decode token of another, the anchor and draft tokens
of a third). Projections run on the flat tensor; only attention regroups queries per
request, because each request attends to its own cached keys with its own causal offset:
decode-shaped requests (a few new tokens each) are padded to one grid, longer prefill chunks
to grids of similar lengths, and each request's context is gathered whole blocks at a time.
One-token rows share the verify rows' grid while padding them costs little (`PAD_ROWS`), else
keep their own.

`AttentionMetadata.build` is computed once per step and shared by all layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn import functional as F

from dspark.config import PAD_ROWS
from dspark.device import upload
from dspark.models.buckets import bucket

SHORT_QUERY = 16  # requests with at most this many new tokens (decode, verify) share one padded grid
KEY_MULTIPLE = 64  # a grid's keys are a multiple of this many (`grid_blocks`)
FUSED_REQUESTS = 8  # on CPU a drafter's attention runs fused over at most this many requests (`fuses`)


@dataclass(frozen=True)
class AttentionGroup:
    """Requests whose queries are padded to one grid. For R requests of the group, Q = their
    longest query, K = their longest context rounded up to whole blocks (B of `block_size`, `grid_blocks`):"""

    query_index: torch.Tensor  # [R, Q] flat index of request r's i-th new token (0 = pad)
    query_rows: torch.Tensor  # [n] long: the valid entries of the flattened [R, Q] grid, in order
    kv_blocks: torch.Tensor  # [R, B] cache block of request r's j-th block of context (0 = pad)
    mask: torch.Tensor  # [R, 1, Q, K] bool, True where query i may attend to key j
    dense: bool = False  # every request has Q new tokens, the first R*Q flat rows in order: no gather needed
    first_block: int | None = None  # one request whose context blocks are consecutive from this one: read in place
    derived: dict = field(default_factory=dict, compare=False, repr=False)  # see `grid_mask`

    def head_blocks(self, heads: int, num_blocks: int) -> torch.Tensor:
        """[heads*R*B] long: kv_blocks of each KV head in turn, as blocks of a head-major cache viewed
        [heads*num_blocks, block_size, D]. Derived once per step and cache shape."""
        key = ("heads", heads, num_blocks)
        if key not in self.derived:
            flat = self.kv_blocks.flatten()
            self.derived[key] = torch.cat([flat + h * num_blocks for h in range(heads)])
        return self.derived[key]

    def grid_mask(self, rep: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The mask with each KV head's `rep` query heads folded into the query axis [R, 1, rep*Q, K], as
        0 / -inf in `dtype` (exact in any) to add to scores: float32 for the written-out products, the queries'
        dtype for the fused kernel (older PyTorch refuses a float32 mask beside bfloat16 queries). Derived once
        per step (every layer reads the same one; repeating it in each layer cost ~1.5 ms of a 30 ms step)."""
        key = (rep, dtype)
        if key not in self.derived:
            mask = self.mask.repeat(1, 1, rep, 1) if rep > 1 else self.mask
            self.derived[key] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, float("-inf"))
        return self.derived[key]


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each flat token sits, which cache slots it writes, and the attention groups.

    Padding every request to the step's longest query would make 63 decode tokens sharing a step
    with one 960-token prefill chunk cost 64 prefills; so the decode-shaped requests (at most
    `SHORT_QUERY` new tokens) form one group, and longer chunks are grouped by query length in
    powers of two (`query_bucket`).
    """

    positions: torch.Tensor  # [N] absolute position of each new token
    slot_mapping: torch.Tensor  # [N] cache slot each new token's K/V is written to
    groups: tuple[AttentionGroup, ...]
    order: torch.Tensor | None  # [N] row of flat token i in the groups' concatenated output (None: in order)
    block_size: int  # the cache's, to view its slots as blocks
    invariant: bool = True  # each row computed as it is alone (`_attend`): the target's; a drafter's need not be

    @staticmethod
    def build(
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str,
        causal: bool = True,
        pad_rows: int = PAD_ROWS,
        invariant: bool = True,
    ) -> AttentionMetadata:
        """context_lens[r] counts the request's cached tokens *including* its new ones.

        The new tokens of request r take positions context_lens[r]-query_lens[r] .. -1.
        With causal=False the new tokens also see each other in both directions (a draft
        block attending bidirectionally within itself, after its injected context). One-token rows
        join the verify rows' grid while that pads them by at most pad_rows query rows (`_buckets`).
        invariant=False lets reduced-precision attention run as one fused kernel, whose rows round by the rows
        beside them (`_attend`): a drafter's forward, whose proposals lossless verification does not depend on.
        """
        if any(q < 1 or c < q for q, c in zip(query_lens, context_lens, strict=True)):
            raise ValueError("every request needs >= 1 new token and context_len >= query_len")
        if any(len(t) * block_size < c for t, c in zip(block_tables, context_lens, strict=True)):
            raise ValueError("a block table is shorter than its context")
        starts, positions, slots = [], [], []
        for q, c, table in zip(query_lens, context_lens, block_tables, strict=True):
            starts.append(len(positions))
            positions.extend(range(c - q, c))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c - q, c))
        members = _buckets(query_lens, pad_rows)
        groups = tuple(_group([query_lens[r] for r in m], [context_lens[r] for r in m], [block_tables[r] for r in m],
                              [starts[r] for r in m], block_size, device, causal) for m in members)
        flat = [starts[r] + i for m in members for r in m for i in range(query_lens[r])]
        order = None if flat == list(range(len(flat))) else upload(_inverse(flat), device, torch.long)
        return AttentionMetadata(upload(positions, device, torch.long), upload(slots, device, torch.long),
                                 groups, order, block_size, invariant)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def query_bucket(num_queries: int) -> int:
    """Requests in one bucket share a padded grid: one-token decode rows, verify rows of up to
    SHORT_QUERY tokens, then (16, 32], (32, 64], ...: padding at most doubles a bucket's queries.
    Decode rows have a bucket of their own, which `_buckets` merges into the verify rows' while padding
    them is cheap (`PAD_ROWS`): padded to the verify rows beside them under load (a probe drafting for
    two of 64 requests, a policy verifying a few requests' drafts), every request's attention cost a
    verify row's, and such a step cost about what drafting for all of them did."""
    if num_queries == 1:
        return -1
    return 0 if num_queries <= SHORT_QUERY else (num_queries - 1).bit_length()


def _buckets(query_lens: Sequence[int], pad_rows: int = PAD_ROWS) -> list[list[int]]:
    """Request indices grouped by `query_bucket`, shortest queries first; the one-token rows joined to the
    verify rows' bucket when their padding adds at most pad_rows query rows (one-token rows x (longest verify
    row - 1)), in request order. A second grid is a fixed cost per layer (its own gathers, products and
    softmax); padding costs per padded row. dspark-small on 2 CPU cores, bfloat16, at a 256-token context
    (`docs/results/profile/pad/`): one 2-token verify row beside 3 / 12 one-token rows cost 4.5 / 5.5 ms over the
    plain step in two grids, 0.8 / 1.9 ms in one; half of 9 / 13 rows verifying 8 tokens, 39.4 / 46.4 ms against
    35.6 / 41.8. Past the bound padding costs more than the grid it saves: every one-token row pays a verify
    row's attention (`query_bucket`)."""
    buckets: dict[int, list[int]] = {}
    for r, q in enumerate(query_lens):
        buckets.setdefault(query_bucket(q), []).append(r)
    if -1 in buckets and 0 in buckets:
        longest = max(query_lens[r] for r in buckets[0])
        if len(buckets[-1]) * (longest - 1) <= pad_rows:
            buckets[0] = sorted(buckets.pop(-1) + buckets[0])
    return [buckets[b] for b in sorted(buckets)]


def _inverse(permutation: Sequence[int]) -> list[int]:
    """inverse[permutation[i]] = i."""
    inverse = [0] * len(permutation)
    for row, token in enumerate(permutation):
        inverse[token] = row
    return inverse


def grid_blocks(exact: int, block_size: int) -> int:
    """Blocks of a grid whose longest context fills `exact` blocks: those, a few more so that the grid's
    shape recurs (`models/buckets.py`), and keys a multiple of KEY_MULTIPLE. The masked keys past a row's context
    must leave its sum over the keys unchanged, and a batched bfloat16 product sums its keys in chunks that
    depend on how many there are: on an AMX CPU (Intel Xeon, family 6, model 167) 48, 112 and 240 keys are
    chunked differently from the multiples of 32 around them, so a verify row whose grid was 112 keys wide
    rounded differently from the plain step at 96 it stands for, and greedy output left plain decoding
    (`tests/test_row_invariance.py`). Multiples of 32 and of 64 summed the same on every context tried there."""
    per = KEY_MULTIPLE // math.gcd(KEY_MULTIPLE, block_size)  # blocks per KEY_MULTIPLE keys
    return -(-bucket(exact) // per) * per


def _group(query_lens: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
           starts: Sequence[int], block_size: int, device, causal: bool) -> AttentionGroup:
    """The padded grid of some requests whose new tokens start at flat offsets `starts`. Built in NumPy on
    the host: the same two dozen small array operations as torch ops cost about 0.1 ms more per grid, twice
    in a drafted step (the target's grid and the drafter's)."""
    qlens, clens = np.asarray(query_lens, dtype=np.int64), np.asarray(context_lens, dtype=np.int64)
    num_q = int(qlens.max())
    exact = -(-int(clens.max()) // block_size)  # whole blocks up to the longest context
    width = grid_blocks(exact, block_size)
    offs = np.arange(num_q)
    query_valid = offs[None, :] < qlens[:, None]  # [R, Q]
    query_index = np.where(query_valid, np.asarray(starts, dtype=np.int64)[:, None] + offs[None, :], 0)
    qpos = (clens - qlens)[:, None] + offs[None, :]  # [R, Q]
    tables = np.zeros((len(block_tables), width), dtype=np.int64)  # [R, B]
    for r, table in enumerate(block_tables):
        row = table[:width]
        tables[r, : len(row)] = row
    keys = np.arange(width * block_size)
    mask = (keys[None, :] < clens[:, None])[:, None, :]  # [R, 1, K]: a block's tail past the context, and padding
    if causal:
        mask = mask & (keys[None, None, :] <= qpos[:, :, None])
    mask = mask | ~query_valid[:, :, None] & (keys == 0)  # [R, Q, K]; padded rows see key 0: no NaN
    dense = all(n == num_q for n in query_lens) and list(starts) == [i * num_q for i in range(len(starts))]
    first = block_tables[0][0] if len(block_tables) == 1 else None
    consecutive = first is not None and list(block_tables[0][:exact]) == list(range(first, first + exact))
    return AttentionGroup(
        dense=dense,
        first_block=first if consecutive else None,
        query_index=upload(query_index, device),
        query_rows=upload(np.flatnonzero(query_valid), device),  # found on the host, not the device
        kv_blocks=upload(tables, device),
        mask=upload(np.ascontiguousarray(mask[:, None]), device),
    )


def paged_attention(
    q: torch.Tensor,  # [N, H, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [Hkv, num_slots, D]
    v_cache: torch.Tensor,  # [Hkv, num_slots, D]
    meta: AttentionMetadata,
) -> torch.Tensor:  # [N, H, D]
    """Write the new K/V into their slots, then attend each request to its own context."""
    write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
    outs = [group_attention(q, k_cache, v_cache, g, meta.block_size, meta.invariant) for g in meta.groups]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out if meta.order is None else out[meta.order]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store the K/V [N, Hkv, D] of N tokens into their cache slots [N] (caches [Hkv, num_slots, D])."""
    k_cache[:, slots] = k.transpose(0, 1)
    v_cache[:, slots] = v.transpose(0, 1)


def group_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup,
                    block_size: int, invariant: bool = True) -> torch.Tensor:
    """One group's queries (flat q [N, H, D]) against their contexts -> [n, H, D], group order.

    The head-major cache gathers every (KV head, request) context contiguous, so the batched products
    read it in place: over [R, Hkv] of a slot-major cache they first copied the whole context into
    head-major order (K twice: once transposed) in every layer, most of a decode step's attention.
    invariant=False (a drafter's forward) runs reduced precision through the fused kernel where `fuses`."""
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    rep = heads // kv_heads
    r, nq = group.query_index.shape
    qp = q[: r * nq].view(r, nq, *q.shape[1:]) if group.dense else q[group.query_index]  # [R, Q, H, D]
    d = qp.shape[-1]
    # GQA without copying K/V: each KV head's query group on the query axis [Hkv, R, rep*Q, D]
    qp = qp.view(r, nq, kv_heads, rep, d).permute(2, 0, 3, 1, 4).reshape(kv_heads, r, rep * nq, d)
    kp, vp = context_kv(k_cache, group, block_size), context_kv(v_cache, group, block_size)  # [Hkv, R, K, D]
    fused = qp.dtype == torch.float32 or (not invariant and fuses(qp))
    mask = group.grid_mask(rep, qp.dtype if fused else torch.float32)[:, 0]
    out = _attend(qp, kp, vp, mask, fused=fused)  # [Hkv, R, rep*Q, D]
    out = out.view(kv_heads, r, rep, nq, d).permute(1, 3, 0, 2, 4).reshape(r * nq, heads, d)  # [R*Q, H, D]
    # a long index, not the bool mask: masking on the device must wait for it to count the rows
    return out if group.dense else out[group.query_rows]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, tile: int = 256,
            fused: bool = False) -> torch.Tensor:
    """q [Hkv, R, M, D] against k, v [Hkv, R, K, D] -> [Hkv, R, M, D]; `mask` [R, M, K] (every head's) is
    0 / -inf added to the scores (the same as filling -inf; made once per step, where a bool mask
    made float32's fused kernel convert it in every layer), float32 unless fused. In reduced precision it is written as two
    batched matrix products with the softmax in float32, over tiles of query rows: a fused kernel blocks
    its work by the number of queries, so a row's result depended on how many rows shared its forward (a
    verify row rounded differently from the plain step it replaces, a prefill chunk from the same tokens
    chunked otherwise) and greedy outputs drifted. Written out, every row is computed the same way whatever
    the others are; tiles bound the scores held at once. float32 (fused=True) keeps the fused kernel, and so
    does a drafter's forward where it is faster (`group_attention`, `fuses`): its proposals only decide what the
    target verifies."""
    if fused:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None])
    h, r, m, d = q.shape
    kt, vb = k.flatten(0, 1).transpose(1, 2), v.flatten(0, 1)  # views: [Hkv*R, D, K], [Hkv*R, K, D]
    outs = []
    for i in range(0, m, tile):
        qi = q[:, :, i : i + tile].reshape(h * r, -1, d)
        scores = torch.bmm(qi, kt).float().view(h, r, qi.shape[1], -1) * d**-0.5
        probs = torch.softmax(scores + mask[:, i : i + tile], dim=-1)
        outs.append(torch.bmm(probs.to(v.dtype).flatten(0, 1), vb).view(h, r, -1, d))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def fuses(q: torch.Tensor) -> bool:
    """Whether a drafter's reduced-precision attention over q [Hkv, R, M, D] runs as the fused kernel: on CUDA
    always, on CPU over at most FUSED_REQUESTS requests. On 2 cores of an AMD EPYC (bfloat16, 2 KV heads of 64
    dimensions, 256-512 keys) the fused kernel took 43 against 175 µs for one request's 7-slot block and 73 against
    157 µs for four requests' single queries, level around 8-12 requests, and 871 against 400 µs for 64 single queries."""
    return q.device.type != "cpu" or q.shape[1] <= FUSED_REQUESTS


def context_kv(cache: torch.Tensor, group: AttentionGroup, block_size: int) -> torch.Tensor:
    """[Hkv, num_slots, D] -> each request's context [Hkv, R, K, D], a contiguous copy gathered whole blocks at a
    time (a block is one contiguous copy: at 64 requests this halves the gather's cost against indexing
    every slot), every head's in one gather along the first axis (along the second it ran 25% slower).
    A lone request whose blocks are consecutive is read in place (a decode step at one request copied
    its whole context twice per layer)."""
    r, width = group.kv_blocks.shape
    heads, d = cache.shape[0], cache.shape[-1]
    start = -1 if group.first_block is None else group.first_block * block_size
    if 0 <= start and start + width * block_size <= cache.shape[1]:  # one request in consecutive blocks: a view
        return cache[:, start : start + width * block_size].unsqueeze(1)
    blocks = cache.view(-1, block_size, d)  # [Hkv * num_blocks, block_size, D]
    picked = blocks.index_select(0, group.head_blocks(heads, blocks.shape[0] // heads))  # [Hkv*R*B, block_size, D]
    return picked.view(heads, r, width * block_size, d)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention for training: q [B, T, H, D], k/v [B, T, Hkv, D] -> [B, T, H, D]."""
    heads, kv_heads = q.shape[2], k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
