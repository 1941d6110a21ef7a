"""What every drafter with weights shares: the frozen target's embedding and LM head, and a
paged cache of per-request context entries (one per committed token).

Subclasses define `write_context` (turn new context features into cache entries) and
`propose`. The cache reserves gamma extra slots per request for the draft block's own
entries during `propose`; they are rolled back before `propose` returns.

A draft vocabulary (`restrict_vocab`, as FR-Spec / EAGLE-3's reduced LM head) makes the
drafter score only the most frequent tokens: its LM head computes those rows alone, draft
tokens come from that set, and the draft distribution handed to the verifier is zero
elsewhere. Verification accepts and resamples against the target's full distribution, so
the output distribution is unchanged; only acceptance (the mass outside the set) and the
proposal's cost move. Serving only: training always uses the full vocabulary.

The draft vocabulary is chosen per proposal (`select_vocab`): a batch of greedy requests drafts
over the reduced set, a batch where any request samples over every token. Greedy drafts are
argmaxes, which a frequent-token set nearly always holds; sampling at temperature 1 draws
from the tail too, and the 2,048-token set of dspark-small cost its DSpark drafter 7-10% of
its acceptance length there, more than the cheaper proposal saved (`docs/benchmarks.md`). A
checkpoint whose own LM head fixes its draft vocabulary (a d2t map) drafts over it always.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn

from dspark.device import upload
from dspark.drafters.base import ContextRow, Drafter, DrafterConfig
from dspark.kv_cache import PagedKVCache
from dspark.models.decoder import CausalLM
from dspark.models.fused import Product, fuse_projections
from dspark.sampling import SamplingRows, probabilities, sample


class NeuralDrafter(nn.Module, Drafter):
    cache_layers: int = 1  # layers whose K/V the cache holds

    def __init__(self, config: DrafterConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self._target: list[CausalLM] = []  # a list: the target is not a submodule (not saved, not trained)
        self.cache: PagedKVCache | None = None
        self.vocab_ids: torch.Tensor | None = None  # [N] token ids of the draft vocabulary (None: all)
        self.vocab_head: Product | None = None  # the product with the LM head's rows [N, d] for them
        self.narrow = True  # whether this proposal drafts over the draft vocabulary (`select_vocab`)
        self.held: bool | None = None  # a choice that overrides select_vocab's (`hold_vocab`; None: none)
        # a checkpoint's own LM head over its fixed draft vocabulary (EAGLE-3, speculators' d2t)
        self.own_head = nn.Linear(config.hidden_size, len(config.draft_vocab) or config.vocab_size, bias=False) \
            if config.own_lm_head else None

    # ---- the frozen target parts -----------------------------------------------------
    @property
    def target(self) -> CausalLM:
        if not self._target:
            raise RuntimeError("drafter is not bound to a target; call bind(target, ...)")
        return self._target[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.model.embed_tokens(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normed hidden [..., d] -> logits [..., V] (float32) with the target's LM head; [..., N]
        over the draft vocabulary when one is set."""
        if self.own_head is not None:
            return self.own_head(hidden).float()
        if self.vocab_head is not None and self.narrow:
            return self.vocab_head(hidden).float()
        return self.target.logits(hidden, normed=True)

    # ---- the draft vocabulary -------------------------------------------------------------
    def restrict_vocab(self, ids: Sequence[int] | None) -> None:
        """Draft from these token ids only (None: the whole vocabulary again). Needs bind().
        A checkpoint with its own draft vocabulary (`config.draft_vocab`) keeps it."""
        fixed = self.config.draft_vocab
        if self.own_head is not None and not fixed and ids is not None:
            raise ValueError("this drafter drafts with its own LM head over every token; --draft-vocab does not apply")
        if fixed and ids is not None and list(ids) != list(fixed):
            raise ValueError(f"this drafter's checkpoint fixes its draft vocabulary ({len(fixed)} tokens, its d2t "
                             "map); --draft-vocab does not apply to it")
        ids = ids if ids is not None or not fixed else fixed
        if ids is None:
            self.vocab_ids, self.vocab_head = None, None
            self.restrict_heads(None, None)
            return
        vocab = self.config.vocab_size
        if not ids or len(set(ids)) != len(ids) or not all(0 <= i < vocab for i in ids):
            raise ValueError(f"a draft vocabulary is distinct token ids in [0, {vocab})")
        self.vocab_ids = upload(list(ids), self.target.device, torch.long)
        rows = self.vocab_rows(self.vocab_ids).contiguous()
        self.vocab_head = Product(rows, None, [rows])
        self.restrict_heads(self.vocab_ids, rows)

    @property
    def fixed_vocab(self) -> bool:
        """Whether the checkpoint fixes the draft vocabulary (its own LM head over a d2t map)."""
        return bool(self.config.draft_vocab)

    @property
    def splits_vocab(self) -> bool:
        """Whether greedy and sampled batches draft over different vocabularies (`select_vocab`)."""
        return self.vocab_ids is not None and not self.fixed_vocab

    def select_vocab(self, rows: SamplingRows) -> None:
        """Draft this proposal over the draft vocabulary when every row is greedy, else over every
        token (a checkpoint's fixed draft vocabulary always); every proposal calls it first."""
        self.narrow = (rows.all_greedy or self.fixed_vocab) if self.held is None else self.held
        self.narrow_heads(self.narrow)

    @contextmanager
    def hold_vocab(self, narrow: bool):
        """Inside: every proposal drafts over the draft vocabulary (narrow) or over every token, whatever
        its rows (the step profile times the draft vocabulary's proposal with sampling rows)."""
        self.held = narrow or self.fixed_vocab
        try:
            yield
        finally:
            self.held = None

    def check_trainable(self) -> None:
        if self.vocab_ids is not None:
            raise RuntimeError("a drafter restricted to a draft vocabulary serves only; train it with every token")

    def vocab_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The LM head's rows [N, d] that score the draft vocabulary ids [N] (`lm_head`'s narrow product)."""
        return self.own_head.weight.detach() if self.own_head is not None else self.target.lm_head.weight.detach()[ids]

    def restrict_heads(self, ids: torch.Tensor | None, rows: torch.Tensor | None) -> None:
        """Subclasses with their own vocabulary-sized outputs restrict them here (rows [N, d]: the LM head's rows
        that score the draft vocabulary ids [N]; None with ids None)."""

    def narrow_heads(self, narrow: bool) -> None:
        """Subclasses with their own vocabulary-sized outputs follow `select_vocab` here."""

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Sampled positions in the vocabulary drafted over -> token ids."""
        return index if self.vocab_ids is None or not self.narrow else self.vocab_ids[index]

    def full_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """Draft distributions [..., N] over the draft vocabulary -> [..., V], zero outside it."""
        if self.vocab_ids is None or not self.narrow:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.config.vocab_size)
        return full.index_copy_(-1, self.vocab_ids, probs)

    # ---- drawing a block left to right ----------------------------------------------------
    def draw(self, logits: torch.Tensor, rows: SamplingRows, generators) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token per row of draft logits [R, V] (or [R, N]) -> (token ids [R], the
        distribution it was drawn from; None when every row is greedy: each token is certain, and
        the block carries no distributions, `block_probs`)."""
        index, p = self.pick(logits, rows, generators)
        return self.token_ids(index), p

    @staticmethod
    def pick(logits: torch.Tensor, rows: SamplingRows, generators) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`draw` before the draft vocabulary maps it: positions [R] in the logits' last axis."""
        if rows.all_greedy:
            return logits.argmax(-1), None
        p = probabilities(logits, rows)
        return sample(p, rows, generators), p

    def block_probs(self, probs: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
        """The block's draft distributions [R, gamma, V] from `draw`'s per-position results; None when
        every row is greedy (each token certain: `DraftBlock.distributions`)."""
        if any(p is None for p in probs):
            return None
        return self.full_probs(torch.stack(list(probs), 1))

    def bind(self, target: CausalLM, num_blocks: int, block_size: int) -> None:
        check_compatible(self.config, target)
        self._target = [target]
        self.to(device=target.device, dtype=target.dtype)
        fuse_projections(self)
        if self.config.draft_vocab:
            self.restrict_vocab(self.config.draft_vocab)
        from dspark.drafters.backbone import layer_config

        self.cache = PagedKVCache(layer_config(self.config, self.cache_layers), num_blocks, block_size,
                                  target.device, target.dtype)

    # ---- per-request cache bookkeeping ------------------------------------------------
    @property
    def pool(self):
        assert self.cache is not None, "bind() first"
        return self.cache.pool

    @torch.inference_mode()
    def extend(self, rows: Sequence[ContextRow]) -> None:
        rows = [r for r in rows if len(r.token_ids)]
        if not rows:
            return
        for r in rows:
            if self.pool.length(r.seq_id) != r.start:
                raise RuntimeError(f"drafter context of {r.seq_id} has {self.pool.length(r.seq_id)} tokens, got start {r.start}")
            self.pool.append(r.seq_id, len(r.token_ids))
        self.write_context(rows)

    def write_context(self, rows: Sequence[ContextRow]) -> None:
        raise NotImplementedError

    def free(self, seq_id: str) -> None:
        self.pool.free(seq_id)

    def cache_bytes_in_use(self) -> int:
        if self.cache is None:
            return 0
        return self.cache.bytes * self.pool.num_used_blocks // self.pool.num_blocks

    def slots_and_positions(self, rows: Sequence[ContextRow]) -> tuple[torch.Tensor, torch.Tensor]:
        slots = [s for r in rows for s in self.pool.slots(r.seq_id, r.start, len(r.token_ids))]
        pos = [p for r in rows for p in range(r.start, r.start + len(r.token_ids))]
        dev = self.target.device
        return upload(slots, dev), upload(pos, dev)


def check_compatible(cfg: DrafterConfig, target: CausalLM) -> None:
    """Refuse a drafter built for another target, with a message that says why."""
    t = target.config
    problems = []
    if cfg.vocab_size != t.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} != target's {t.vocab_size}")
    if cfg.hidden_size != t.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} != target's {t.hidden_size}")
    bad_taps = [i for i in cfg.taps if not -1 <= i < t.num_hidden_layers]
    if bad_taps:
        problems.append(f"tap layers {bad_taps} outside the target's {t.num_hidden_layers} layers")
    bad_vocab = [i for i in cfg.draft_vocab if not 0 <= i < t.vocab_size]
    if bad_vocab:
        problems.append(f"draft vocabulary ids {bad_vocab[:5]} outside the target's {t.vocab_size} tokens")
    if problems:
        raise ValueError(f"drafter ({cfg.kind}) does not match this target: " + "; ".join(problems))
