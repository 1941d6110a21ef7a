"""Prompt-lookup (n-gram) drafter: no weights, proposes what followed the last earlier
occurrence of the sequence's current suffix.

For n from `ngram_max` down to `ngram_min`, the last n tokens (ending with the anchor)
are searched for in the earlier tokens; the gamma tokens that followed the most recent
match are proposed with a one-hot draft distribution (the proposal is deterministic, so
rejection sampling stays exact). Without a match nothing is proposed (`num_valid` = 0).
Each request has an index (`SuffixIndex`) from every n-gram to where its latest occurrence
ends, grown by the tokens added since the last proposal: a proposal costs O(new tokens),
not a scan of the whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.drafters.base import ContextRow, DraftBlock, Drafter, DrafterConfig, ProposeInput, copied_tokens
from dspark.sampling import SamplingRows


class SuffixIndex:
    """n-gram (n_min..n_max) -> end of its latest occurrence among a sequence's tokens
    before the last one (the anchor's own suffix is not an earlier occurrence)."""

    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.ends: dict[tuple[int, ...], int] = {}
        self.size = 0  # n-grams ending at or before this position are indexed

    def lookup(self, tokens: Sequence[int], gamma: int) -> list[int]:
        """Continuation (up to gamma tokens) of the latest earlier match of the longest suffix;
        `tokens` only ever grows between calls (the request's own list)."""
        last = len(tokens) - 1
        for end in range(self.size + 1, last + 1):  # index the n-grams ending at end (exclusive) < last + 1
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.ends[tuple(tokens[end - n : end])] = end
        self.size = max(self.size, last)
        for n in range(min(self.n_max, last), self.n_min - 1, -1):
            end = self.ends.get(tuple(tokens[last + 1 - n :]))
            if end is not None:
                return continuation(tokens, end, gamma)
        return []


def continuation(tokens: Sequence[int], begin: int, gamma: int) -> list[int]:
    """gamma tokens copied from `begin` on; a copy that reaches the end continues with the
    tokens it has just produced, so a loop of period p yields a full block, not p tokens."""
    out = list(tokens[begin : begin + gamma])
    period = len(tokens) - begin
    while len(out) < gamma:
        out.append(out[len(out) - period])
    return out


class NgramDrafter(Drafter):
    def __init__(self, config: DrafterConfig) -> None:
        self.config = config
        self.device: torch.device | str = "cpu"
        self.index: dict[str, SuffixIndex] = {}

    @property
    def bursty(self) -> bool:
        return True

    def bind(self, target, num_blocks: int, block_size: int) -> None:
        self.device = target.device

    def extend(self, rows: Sequence[ContextRow]) -> None:
        pass  # reads the request's tokens directly

    def free(self, seq_id: str) -> None:
        self.index.pop(seq_id, None)

    def _index(self, seq_id: str) -> SuffixIndex:
        if seq_id not in self.index:
            self.index[seq_id] = SuffixIndex(self.config.ngram_max, self.config.ngram_min)
        return self.index[seq_id]

    def propose(self, inputs: Sequence[ProposeInput], rows: SamplingRows, depth: int | None = None) -> DraftBlock:
        # a copy costs nothing per position: depth is ignored
        g = self.gamma
        conts = [self._index(i.seq_id).lookup(i.tokens, g) for i in inputs]
        tokens = copied_tokens(conts, [i.anchor for i in inputs], g, self.device)
        return DraftBlock(tokens, None, None, [len(c) for c in conts])
