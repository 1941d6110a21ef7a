"""Prompt-lookup (n-gram) drafter: no weights, proposes what followed the last earlier
occurrence of the sequence's current suffix.

For n from `ngram_max` down to `ngram_min`, the last n tokens (ending with the anchor)
are searched for in the earlier tokens; the gamma tokens that followed the most recent
match are proposed with a one-hot draft distribution (the proposal is deterministic, so
rejection sampling stays exact). Without a match nothing is proposed (`num_valid` = 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.device import upload
from dspark.drafters.base import ContextRow, DraftBlock, Drafter, DrafterConfig, ProposeInput
from dspark.sampling import SamplingRows


def lookup(tokens: Sequence[int], gamma: int, n_max: int, n_min: int) -> list[int]:
    """Continuation (up to gamma tokens) of the latest earlier match of the longest suffix."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = list(tokens[size - n :])
        for start in range(size - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                return continuation(list(tokens), start + n, gamma)
    return []


def continuation(tokens: list[int], begin: int, gamma: int) -> list[int]:
    """gamma tokens copied from `begin` on; a copy that reaches the end continues with the
    tokens it has just produced, so a loop of period p yields a full block, not p tokens."""
    ext = list(tokens)
    for i in range(gamma):
        ext.append(ext[begin + i])
    return ext[len(tokens) :]


class NgramDrafter(Drafter):
    def __init__(self, config: DrafterConfig) -> None:
        self.config = config
        self.vocab_size = config.vocab_size
        self.device: torch.device | str = "cpu"

    def bind(self, target, num_blocks: int, block_size: int) -> None:
        self.vocab_size = target.config.vocab_size
        self.device = target.device

    def extend(self, rows: Sequence[ContextRow]) -> None:
        pass  # reads the token history directly

    def free(self, seq_id: str) -> None:
        pass

    def propose(self, inputs: Sequence[ProposeInput], rows: SamplingRows) -> DraftBlock:
        g = self.gamma
        conts = [lookup([*i.history, i.anchor], g, self.config.ngram_max, self.config.ngram_min) for i in inputs]
        padded = [c + [c[-1] if c else i.anchor] * (g - len(c)) for c, i in zip(conts, inputs, strict=True)]
        tokens = upload(padded, self.device, torch.long)  # [R, g]
        probs = torch.zeros(len(inputs), g, self.vocab_size, device=self.device)
        probs.scatter_(-1, tokens[..., None], 1.0)
        return DraftBlock(tokens, probs, None, [len(c) for c in conts])
