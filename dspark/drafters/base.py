"""The drafter interface the engine calls, and the config every drafter checkpoint carries.

A drafter keeps per-request state (its own caches of the target's context features) and
offers three calls, all batched over the running requests:
- `extend(rows)`: context features (tapped target hidden states) of newly committed tokens;
- `propose(inputs, sampling)`: a `DraftBlock` of gamma tokens per request, the draft
  distribution each was sampled from, and a confidence per position where it has a head;
- `free(seq_id)`: forget the request (finished, aborted, or preempted: it is recomputed).

There is no rollback: a drafter's caches only ever receive committed tokens (draft entries
live in temporary slots during `propose`), and a preempted request starts over from `free`.
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.sampling import SamplingRows

KINDS = ("dspark", "dflash", "eagle3", "mtp", "ngram", "suffix", "auto")
HEADS = ("markov", "gated", "rnn", "mlp", "none")
LAYER_TYPES = ("qwen3", "llama")


@dataclass(frozen=True)
class DrafterConfig:
    kind: str = "dspark"
    gamma: int = 7
    taps: tuple[int, ...] = ()  # target layers whose outputs form the context features
    num_layers: int = 2
    hidden_size: int = 256
    intermediate_size: int = 768
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    vocab_size: int = 8192
    mask_token_id: int = 0
    head: str = "markov"  # sequential head: markov | gated | rnn | mlp | none
    rank: int = 64  # low rank r of the sequential head
    confidence: bool = True
    sts_temperatures: tuple[float, ...] = ()  # per-position STS temperatures (empty: raw)
    sts_greedy: tuple[float, ...] = ()  # the same for greedy requests, fitted on greedy rollouts (empty:
    #                                     sts_temperatures): a greedy draft token survives when it is the
    #                                     target's argmax, a sampled one with probability min(1, p/q)
    ngram_max: int = 4  # n-gram drafter: longest suffix matched
    ngram_min: int = 1
    # ---- what published checkpoint formats mean (dspark/drafters/formats/); defaults: dspark's own ----
    layer_type: str = "qwen3"  # the drafter's decoder layers: qwen3 (q/k-norm) | llama
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    block_size: int = 0  # slots in a parallel block (0: gamma, +1 without the anchor slot); a larger
    #                      block is run whole and its first gamma proposals kept, as its trainer did
    anchor_slot: bool = True  # the anchor's own slot predicts x_1 (DSpark); False: slot k predicts x_k (DFlash)
    confidence_markov: bool = True  # the confidence head reads [h_k; W1[x_{k-1}]]; False: h_k alone
    context_residual: bool = False  # every block slot starts from its embedding + W_r H_ctx of the position before
    #                                 the anchor (dspark, dflash): the feature EAGLE-3 feeds its residual stream
    causal_block: bool = False  # block slots see the slots before them, not after (dspark, dflash): the first k
    #                             proposals do not depend on how many are drafted, so a step may draft fewer
    refine: int = 0  # dspark/dflash with a causal block: greedy proposals run the block up to this many times more,
    #                  each pass with the previous pass's draft in its slots, stopping where a pass changes nothing; the
    #                  last pass's draft is kept up to its first token that differs from the one before (the last token
    #                  whose slots read what the pass itself drafted before it)
    anchor_mlp: int = 0  # dspark: width of a gated MLP only the anchor slot runs on its final hidden (0: none), the
    #                      first position's own parameters where every other weight serves the whole block
    slot_mlp: int = 0  # dspark: width of a gated MLP each block slot runs on its own after every backbone layer (0:
    #                    none; `drafters/slots.py`): per-slot weights inside the backbone, whose layers the slots share
    exit_mlp: int = 0  # dspark with a causal block: a one-position proposal runs a decoder layer of the drafter's own
    #                    whose MLP is this wide (0: no exit; `drafters/exit.py`) ...
    exit_layer: int = 0  # ... on the anchor slot after this many backbone layers (0: on the block's input)
    draft_vocab: tuple[int, ...] = ()  # a fixed draft vocabulary (token ids) from the checkpoint's d2t map
    serve_vocab: int = 0  # draft vocabulary size used unless the caller names one (--draft-vocab; 0: every token)
    own_lm_head: bool = False  # the LM head is the drafter's own weight (rows: draft_vocab, or all), not the target's
    split_entry: bool = False  # EAGLE-3 as published: attention reads [norm(emb); norm(g)], g the residual
    norm_before_residual: bool = False  # EAGLE-3 (split_entry): the residual is norm(g), not g
    suffix_depth: int = 12  # suffix drafter: longest n-gram matched
    suffix_store: int = 16384  # tokens of finished requests it also matches against (0: none)
    suffix_floor: float = 0.05  # a block ends where its survival product falls below this
    suffix_alpha: float = 2.0  # ... or past this many tokens per matched token

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown drafter kind {self.kind!r}; expected one of {KINDS}")
        if self.head not in HEADS:
            raise ValueError(f"unknown sequential head {self.head!r}; expected one of {HEADS}")
        if self.gamma < 1:
            raise ValueError("gamma must be >= 1")
        if self.confidence and self.confidence_markov and self.head == "none":
            raise ValueError("the confidence head reads the sequential head's W1: it needs a head")
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"unknown layer_type {self.layer_type!r}; expected one of {LAYER_TYPES}")
        for name in ("taps", "sts_temperatures", "sts_greedy", "draft_vocab"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.rope_scaling is not None:
            scaling = self.rope_scaling.items() if isinstance(self.rope_scaling, dict) else self.rope_scaling
            object.__setattr__(self, "rope_scaling", tuple(sorted((k, v) for k, v in scaling)))
        for name in ("context_residual", "causal_block"):  # auto: the router's copy of its neural drafter's config
            if getattr(self, name) and self.kind not in ("dspark", "dflash", "auto"):
                raise ValueError(f"{name} is a block-backbone option (dspark, dflash), not {self.kind}'s")
        if self.refine < 0 or (self.refine and not self.refinable):
            raise ValueError(f"refine={self.refine}: refining passes (>= 0) need a causal block whose anchor slot "
                             f"predicts x_1 (dspark, dflash with causal_block), not {self.kind} with "
                             f"causal_block={self.causal_block}, anchor_slot={self.anchor_slot}")
        if self.anchor_mlp and (self.kind not in ("dspark", "auto") or not self.anchor_slot):
            raise ValueError(f"anchor_mlp runs on a DSpark block's anchor slot, which a {self.kind} drafter "
                             f"(anchor_slot={self.anchor_slot}) does not predict from")
        if self.slot_mlp and self.kind not in ("dspark", "auto"):
            raise ValueError(f"slot_mlp gives each slot of a DSpark block its own MLP, not a {self.kind} drafter's")
        if (self.exit_mlp or self.exit_layer) and (self.kind not in ("dspark", "auto") or not self.refinable
                                                   or not 0 <= self.exit_layer < self.num_layers or self.exit_mlp < 1):
            raise ValueError(f"exit_mlp={self.exit_mlp}, exit_layer={self.exit_layer}: an early exit is a layer of "
                             f"a DSpark causal block's own (exit_mlp >= 1) on the anchor slot after fewer than its "
                             f"{self.num_layers} backbone layers (got {self.kind}, causal_block={self.causal_block})")
        if self.block_size and self.block_size < self.gamma + (0 if self.anchor_slot else 1):
            raise ValueError(f"block_size {self.block_size} has too few slots for gamma {self.gamma}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> DrafterConfig:
        raw: dict[str, Any] = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def replace(self, **changes: Any) -> DrafterConfig:
        return dataclasses.replace(self, **changes)

    @property
    def refinable(self) -> bool:
        """Whether its block can read a draft in its slots (fed blocks in training, `refine` at serving): a causal
        block whose anchor slot predicts x_1, so slot k reads x_1..x_k and predicts x_{k+1}."""
        return self.kind in ("dspark", "dflash", "auto") and self.causal_block and self.anchor_slot

    @property
    def slots(self) -> int:
        """Slots of one parallel block: the anchor's, then masks."""
        return self.block_size or self.gamma + (0 if self.anchor_slot else 1)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None


@dataclass
class DraftBlock:
    """gamma draft tokens per request, in request order of the `propose` call."""

    tokens: torch.Tensor  # [R, gamma] long, x_1..x_gamma
    probs: torch.Tensor | None  # [R, gamma, V] float32, the distribution each x_k was sampled from; None: each
    # x_k was certain (greedy rows, copied drafts), a one-hot that `distributions` builds only where sampling needs it
    confidence: torch.Tensor | None = None  # [R, gamma] in (0, 1): P(x_k accepted | prefix accepted)
    num_valid: list[int] | None = None  # per request, how many positions are real proposals
    confidence_logits: torch.Tensor | None = None  # [R, gamma] raw head logits (before STS)
    sources: list[str] | None = None  # per request, the drafter that proposed it (None: this drafter's kind)
    num_drafted: int | None = None  # requests the profiled (costly) drafter ran for (None: all of them)

    def distributions(self, vocab: int) -> torch.Tensor:
        """[R, gamma, V]: `probs`, or the one-hot on each token where the block holds none."""
        if self.probs is not None:
            return self.probs
        return torch.zeros(*self.tokens.shape, vocab, device=self.tokens.device).scatter_(-1, self.tokens[..., None], 1.0)


@dataclass(frozen=True)
class ContextRow:
    """Newly committed tokens of one request and their tapped target features."""

    seq_id: str
    start: int  # position of the first of these tokens
    token_ids: Sequence[int]  # [n]
    features: torch.Tensor | None  # [n, m*d] tapped hidden states (None for weight-free drafters)


@dataclass(frozen=True)
class ProposeInput:
    seq_id: str
    anchor: int  # x0: the last emitted token, not yet in any cache
    context_len: int  # committed tokens before the anchor (= the anchor's position)
    tokens: Sequence[int]  # the request's own prompt + output, the anchor last (read, never copied); n-gram uses it
    generator: torch.Generator | None = None


class Drafter(ABC):
    """Base class: subclasses hold weights (torch modules) or none (n-gram)."""

    config: DrafterConfig

    @property
    def gamma(self) -> int:
        return self.config.gamma

    @property
    def taps(self) -> tuple[int, ...]:
        return self.config.taps

    @property
    def has_confidence(self) -> bool:
        return False

    @property
    def bursty(self) -> bool:
        """Whether its acceptance comes and goes within a request (a copy drafter: a match now, none
        later), so that a request's failed rounds say little about its next ones. The gate judges a
        steady drafter's requests by their own records too, a bursty one's by everyone's."""
        return False

    @property
    def cuts_exactly(self) -> bool:
        """Whether a proposal of depth d < gamma is the first d positions of the full block's, for less
        (an autoregressive drafter, a causal block): then the gate may draft fewer positions under load."""
        return False

    @property
    def exits(self) -> bool:
        """Whether a one-position proposal takes a path of its own (an early exit, a paired drafter), off the
        line from two positions to the whole block: the step profile then times two positions too."""
        return False

    @property
    def measured(self) -> Drafter:
        """The drafter whose proposals the step profile times (a router: its neural part)."""
        return self

    def bind(self, target: torch.nn.Module, num_blocks: int, block_size: int) -> None:  # noqa: B027
        """Attach the (frozen) target and allocate caches; weight-free drafters need nothing."""

    def set_profile(self, profile) -> None:  # noqa: B027
        """The engine's step profile, for drafters that weigh costs themselves (the router)."""

    @abstractmethod
    def extend(self, rows: Sequence[ContextRow]) -> None: ...

    @abstractmethod
    def propose(self, inputs: Sequence[ProposeInput], rows: SamplingRows, depth: int | None = None) -> DraftBlock:
        """A draft block for each input; rows holds each request's sampling settings (one row per input).
        depth: positions wanted (None: gamma); a drafter that `cuts_exactly` proposes only those (the
        block keeps gamma columns, `num_valid` caps the rest), any other may ignore it."""

    @abstractmethod
    def free(self, seq_id: str) -> None: ...

    def cache_bytes_in_use(self) -> int:
        return 0

    def forget(self) -> None:  # noqa: B027 (optional: most drafters keep nothing across requests)
        """Drop what was learned from finished requests' tokens (a copy drafter's store), so the next
        request is drafted as if it came first (benchmarks that run one prompt several times)."""


class Waiting:
    """Context rows a drafter has not received yet, per request, handed over merged (one row each) when it next
    drafts for them: a part of a pair or a router's neural drafter that sits out a step does no work for it."""

    def __init__(self) -> None:
        self.rows: dict[str, list[ContextRow]] = {}

    def add(self, rows: Sequence[ContextRow]) -> None:
        for r in rows:
            if len(r.token_ids):
                self.rows.setdefault(r.seq_id, []).append(r)

    def take(self, seq_ids: Sequence[str]) -> list[ContextRow]:
        """One row per request that has any (features concatenated), removed from the queue."""
        merged = []
        for sid in seq_ids:
            rows = self.rows.pop(sid, [])
            if len(rows) == 1:
                merged.append(rows[0])
            elif rows:
                feats = [r.features for r in rows]
                merged.append(ContextRow(sid, rows[0].start, [t for r in rows for t in r.token_ids],
                                         None if feats[0] is None else torch.cat(feats)))
        return merged

    def drop(self, seq_id: str) -> None:
        self.rows.pop(seq_id, None)

    def __len__(self) -> int:
        """The requests with rows waiting."""
        return len(self.rows)


def save_drafter(module: torch.nn.Module, config: DrafterConfig, out_dir: str | Path) -> None:
    """config.json + model.safetensors (only the drafter's own weights)."""
    from safetensors.torch import save_file

    from dspark.models.fused import owned

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config.to_json())
    state = {k: owned(v.detach()) for k, v in module.state_dict().items()}
    if state:
        save_file(state, str(out / "model.safetensors"))


def depth_of(drafter: Drafter, depth: int | None) -> int:
    """The positions a proposal computes: depth where the drafter cuts exactly, else gamma."""
    return min(depth, drafter.gamma) if depth and drafter.cuts_exactly else drafter.gamma


def widened(block: DraftBlock, gamma: int) -> DraftBlock:
    """A block of d < gamma positions as gamma columns: the rest repeat the last token with no draft
    probability and no confidence, and `num_valid` keeps every request's proposal to d."""
    r, d = block.tokens.shape
    if d == gamma:
        return block
    pad = gamma - d

    def more(x: torch.Tensor | None, fill: float) -> torch.Tensor | None:
        return None if x is None else torch.cat([x, x.new_full((r, pad, *x.shape[2:]), fill)], dim=1)

    tokens = torch.cat([block.tokens, block.tokens[:, -1:].expand(r, pad)], dim=1)
    valid = [d] * r if block.num_valid is None else [min(v, d) for v in block.num_valid]
    return dataclasses.replace(block, tokens=tokens, probs=more(block.probs, 0.0), confidence=more(block.confidence, 0.0),
                               confidence_logits=more(block.confidence_logits, -30.0), num_valid=valid)


def copied_tokens(drafts: Sequence[list[int]], anchors: Sequence[int], gamma: int,
                  device: torch.device | str) -> torch.Tensor:
    """Tokens [R, gamma] of copy drafters (n-gram, suffix), each certain (the block's `probs` is None):
    each draft padded to gamma with its last token (the anchor when empty); only its first
    len(draft) positions count (`DraftBlock.num_valid`)."""
    from dspark.device import upload

    padded = [d + [d[-1] if d else a] * (gamma - len(d)) for d, a in zip(drafts, anchors, strict=True)]
    return upload(padded, device, torch.long)
