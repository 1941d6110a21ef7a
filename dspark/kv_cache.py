"""Paged KV cache: a preallocated pool of fixed-size blocks and per-request block tables.

`BlockPool` is the bookkeeping (pure Python, property-tested): append n tokens to a
request (allocating blocks as needed), **truncate** a request to length n (the rollback of
rejected draft tokens frees whole blocks past the new end), free a request. `PagedKVCache`
adds the per-layer K/V tensors, sized from a memory budget, that attention reads through
the block tables (`models/attention.py`). The drafters' own caches reuse `BlockPool`.
Freed blocks go back to the front of the free list, so a request that rolls back and grows
again (every speculative step, every proposal's temporary slots) takes the same blocks back
and a lone request's context stays in consecutive blocks, which attention reads in place.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

import torch

from dspark.config import ModelConfig


class OutOfBlocks(RuntimeError):
    """Raised when an append needs more free blocks than the pool has."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV pool needs at least one block of at least one token")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[Hashable, list[int]] = {}
        self.lengths: dict[Hashable, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, length: int) -> int:
        return -(-length // self.block_size)

    def extra_blocks(self, seq: Hashable, n: int) -> int:
        """Blocks an append of n tokens to `seq` would take from the pool."""
        length = self.lengths.get(seq, 0)
        return self.blocks_needed(length + n) - len(self.tables.get(seq, []))

    def can_append(self, seq: Hashable, n: int) -> bool:
        return self.extra_blocks(seq, n) <= len(self._free)

    def append(self, seq: Hashable, n: int) -> None:
        """Grow `seq` by n tokens; all-or-nothing (raises OutOfBlocks, changing nothing)."""
        need = self.extra_blocks(seq, n)
        if need > len(self._free):
            raise OutOfBlocks(f"need {need} blocks, {len(self._free)} free")
        table = self.tables.setdefault(seq, [])
        table.extend(self._free.popleft() for _ in range(need))
        self.lengths[seq] = self.lengths.get(seq, 0) + n

    def truncate(self, seq: Hashable, length: int) -> None:
        """Shrink `seq` to its first `length` tokens, returning blocks past the end."""
        current = self.lengths.get(seq, 0)
        if not 0 <= length <= current:
            raise ValueError(f"cannot truncate a sequence of {current} tokens to {length}")
        table = self.tables.get(seq, [])
        keep = self.blocks_needed(length)
        self._free.extendleft(reversed(table[keep:]))  # first in line again: the next append takes them back
        del table[keep:]
        self.lengths[seq] = length

    def free(self, seq: Hashable) -> None:
        self._free.extendleft(reversed(self.tables.pop(seq, [])))
        self.lengths.pop(seq, None)

    def length(self, seq: Hashable) -> int:
        return self.lengths.get(seq, 0)

    def block_table(self, seq: Hashable) -> list[int]:
        return self.tables.get(seq, [])

    def slots(self, seq: Hashable, start: int, n: int) -> list[int]:
        """Cache slots of positions start .. start+n-1 of `seq` (already appended)."""
        table, bs = self.tables[seq], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class PagedKVCache:
    """Per-layer K/V tensors [Hkv, num_blocks * block_size, D] (head-major) plus their BlockPool.

    `cfg` gives the layer count and K/V shape; drafters pass their own (smaller) config.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        slots = num_blocks * block_size
        shape = (cfg.num_key_value_heads, slots, cfg.head_dim)  # head-major: a head's context gathers contiguous
        self.layers = [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in range(cfg.num_hidden_layers)
        ]
        self.bytes = 2 * len(self.layers) * slots * cfg.num_key_value_heads * cfg.head_dim * self.layers[0][0].element_size() if self.layers else 0

    @classmethod
    def from_budget(cls, cfg: ModelConfig, budget_bytes: int, block_size: int,
                    device: torch.device | str, dtype: torch.dtype) -> PagedKVCache:
        num_blocks = budget_bytes // bytes_per_block(cfg, block_size, dtype)
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens")
        return cls(cfg, num_blocks, block_size, device, dtype)

    @property
    def block_size(self) -> int:
        return self.pool.block_size
