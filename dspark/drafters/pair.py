"""Two neural drafters as one: one-position proposals from a cheap drafter, deeper ones from the block (`dspark+mtp`).

Under load the gate drafts one position per request or none (each extra token verified costs about what a plain one
does, and only the first draft is likely enough to pay). There the DSpark block still runs both its backbone
layers over every anchor slot, where MTP-1 runs one layer: side by side at 16 and 64 requests, one DSpark position
was accepted as often as MTP's and ran 5-6% slower (`docs/models/dspark-small.md`, stage 18). An early exit trained
onto the block matched the target's argmax less often than MTP's layer did, which lost more than its cheaper
proposal saved. This pairs the shipped drafters instead: a proposal of one position is the second drafter's (`MTP`,
any drafter that cuts exactly), every deeper one the first's (`DSpark`, a causal block). The step profile times the
pair at one position, two and the whole block (`Drafter.exits`), so the gate prices depth 1 at the cheap drafter's
cost and the depths from two on along the block's line.

Both drafters read their own target layers: the target taps the union of the two (in layer order) and each drafter's
context rows carry its own columns. A part receives a request's context when it next drafts for it (the rows wait
here, as the engine's own wait for a drafting step), so a step drafted by one part does no work for the other.

Measured side by side with the DSpark drafter alone (`docs/results/online/pair/`, `docs/results/avx2/online/pair/`):
ahead at 16 requests on both CPUs, level at 64, behind at 4: the gate's acceptance record is shared by the two parts,
and rounds of one position teach it nothing about the deeper ones. Not the default.
Each block is verified against the distribution it was drawn from (the one-position drafter's has no confidence
head: the policy reads the observed acceptance there), so the output distribution is the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack, contextmanager

import torch

from dspark.drafters.base import (
    ContextRow,
    DraftBlock,
    Drafter,
    DrafterConfig,
    ProposeInput,
    Waiting,
    widened,
)
from dspark.drafters.neural import NeuralDrafter
from dspark.sampling import SamplingRows


def columns(union: Sequence[int], taps: Sequence[int]) -> list[int]:
    """Where each of taps sits in the union's features (the target concatenates tapped layers in layer order)."""
    return [list(union).index(t) for t in taps]


class PairedDrafter(Drafter):
    """deep: a drafter that cuts exactly (a causal DSpark block) for proposals of two or more positions; shallow:
    one that cuts exactly too (MTP-1, EAGLE-3) for proposals of one position."""

    def __init__(self, deep: NeuralDrafter, shallow: NeuralDrafter) -> None:
        for part in (deep, shallow):
            if not part.cuts_exactly:
                raise ValueError(f"a pair needs drafters whose first positions do not depend on the depth asked; the "
                                 f"{part.config.kind} drafter's block runs whole (a bidirectional block)")
        if deep.gamma < 2:
            raise ValueError(f"the first drafter of a pair proposes the blocks of two or more positions; the "
                             f"{deep.config.kind} drafter proposes {deep.gamma} (name it second: DEEP+ONE)")
        self.deep, self.shallow = deep, shallow
        self.union = tuple(sorted(set(deep.taps) | set(shallow.taps)))  # -1 (the embeddings) first, as tapped
        self.parts = ((deep, columns(self.union, deep.taps)), (shallow, columns(self.union, shallow.taps)))
        self.waiting = {id(deep): Waiting(), id(shallow): Waiting()}  # context each part has not received
        self._config = self.joined(deep.config)

    def joined(self, deep: DrafterConfig) -> DrafterConfig:
        """The deep drafter's config (its kind and depth name the pair's proposals) over both drafters' taps."""
        return deep.replace(taps=self.union)

    @property
    def config(self) -> DrafterConfig:
        return self._config

    @config.setter
    def config(self, value: DrafterConfig) -> None:  # build_engine's --gamma: the block's depth
        self.deep.config = self.deep.config.replace(gamma=value.gamma)
        self._config = self.joined(self.deep.config)

    @property
    def has_confidence(self) -> bool:
        return self.deep.has_confidence

    @property
    def cuts_exactly(self) -> bool:
        return True

    @property
    def exits(self) -> bool:
        return True

    @property
    def pool(self):
        return self.deep.pool

    @property
    def splits_vocab(self) -> bool:
        return self.deep.splits_vocab or self.shallow.splits_vocab

    def restrict_vocab(self, ids: Sequence[int] | None) -> None:
        for part, _ in self.parts:
            part.restrict_vocab(ids)

    @contextmanager
    def hold_vocab(self, narrow: bool):
        with ExitStack() as stack:
            for part, _ in self.parts:
                stack.enter_context(part.hold_vocab(narrow))
            yield

    def bind(self, target: torch.nn.Module, num_blocks: int, block_size: int) -> None:
        for part, _ in self.parts:
            part.bind(target, num_blocks, block_size)

    def extend(self, rows: Sequence[ContextRow]) -> None:
        for part, _ in self.parts:  # each part's columns are cut when it takes them (a part that never drafts: never)
            self.waiting[id(part)].add(rows)

    def propose(self, inputs: Sequence[ProposeInput], rows: SamplingRows, depth: int | None = None) -> DraftBlock:
        part, cols = self.parts[1] if depth == 1 and self.gamma > 1 else self.parts[0]
        missed = self.waiting[id(part)].take([i.seq_id for i in inputs])  # what it missed while the other drafted
        part.extend([own_columns(r, cols, len(self.union)) for r in missed])
        block = widened(part.propose(inputs, rows, depth), self.gamma)
        block.sources = [part.config.kind] * len(inputs)
        return block

    def free(self, seq_id: str) -> None:
        for part, _ in self.parts:
            self.waiting[id(part)].drop(seq_id)
            part.free(seq_id)

    def cache_bytes_in_use(self) -> int:
        return sum(part.cache_bytes_in_use() for part, _ in self.parts)


def own_columns(row: ContextRow, cols: Sequence[int], width: int) -> ContextRow:
    """row with only the features of these taps (of `width` tapped layers side by side)."""
    if row.features is None or len(cols) == width:
        return row
    n, size = row.features.shape[0], row.features.shape[1] // width
    if list(cols) == list(range(cols[0], cols[-1] + 1)):  # side by side already: one slice
        feats = row.features[:, cols[0] * size : (cols[-1] + 1) * size].contiguous()
    else:
        feats = row.features.view(n, width, size)[:, list(cols)].reshape(n, -1)
    return ContextRow(row.seq_id, row.start, row.token_ids, feats)
