"""Suffix drafter: context copy from the request's own tokens and from recent requests, with a
confidence per position (after SuffixDecoding, Oliaro et al. 2024; our own code).

Two indexes of continuation counts keyed by the n-grams (n = 1..`suffix_depth`) that precede
each token: one per request over its prompt and output, updated with the newly committed
tokens only (`extend`: O(new tokens x depth)), and one global store over the last
`suffix_store` tokens of finished requests (a request's tokens join it when it is freed; the
oldest leave it, their counts taken back). A draft walks left to right: at each position the
longest n-gram ending the context (drafted tokens included) found in either index gives the
counts of what followed it, summed over both; the most frequent continuation is proposed.

Its confidence is the continuation's empirical frequency, calibrated online: a table keyed by
(match length, frequency, occurrences) counts how often such a draft token was right, judged
against the tokens the request then committed. The draft distribution is one-hot, so the
probability of acceptance is exactly the target's probability of the drafted token, which is
also the probability that the committed token equals it, so every proposal with known tokens
is an unbiased observation whether or not it was verified. The block ends where the survival
product falls below `suffix_floor`, or past `suffix_alpha` x the match length (the speculation
length grows with the match's length and frequency). Deterministic, so verification is exact.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dspark.device import upload
from dspark.drafters.base import ContextRow, DraftBlock, Drafter, DrafterConfig, ProposeInput, copied_tokens
from dspark.sampling import SamplingRows

Counts = dict[tuple[int, ...], dict[int, int]]


def count(index: Counts, tokens: Sequence[int], i: int, depth: int, sign: int = 1) -> None:
    """Add (sign=1) or take back (-1) token i as the continuation of the n-grams ending at i - 1."""
    nxt = tokens[i]
    for n in range(1, min(depth, i) + 1):
        key = tuple(tokens[i - n : i])
        row = index.setdefault(key, {})
        left = row.get(nxt, 0) + sign
        if left > 0:
            row[nxt] = left
        else:
            row.pop(nxt, None)
            if not row:
                del index[key]


class Store:
    """Continuation counts over the last `capacity` tokens of finished requests."""

    def __init__(self, capacity: int, depth: int) -> None:
        self.capacity, self.depth = capacity, depth
        self.index: Counts = {}
        self.docs: deque[list[int]] = deque()
        self.size = 0

    def add(self, tokens: list[int]) -> None:
        if not self.capacity or len(tokens) < 2:
            return
        tokens = tokens[-self.capacity :]
        for i in range(1, len(tokens)):
            count(self.index, tokens, i, self.depth)
        self.docs.append(tokens)
        self.size += len(tokens)
        while self.size > self.capacity:
            old = self.docs.popleft()
            for i in range(1, len(old)):
                count(self.index, old, i, self.depth, -1)
            self.size -= len(old)


@dataclass
class Context:
    """One request's committed tokens, their counts, and its last proposal (to score it)."""

    tokens: list[int] = field(default_factory=list)
    index: Counts = field(default_factory=dict)
    proposal: tuple[int, list[int], list[tuple]] | None = None  # (position of x_1, tokens, buckets)
    served: bool = False  # filled by `extend` (a real request), not rebuilt from a caller's history


@dataclass
class Calibration:
    """Right / judged draft tokens per bucket, shrunk toward the raw frequency."""

    weight: float = 4.0
    decay: float = 0.999
    table: dict[tuple, list[float]] = field(default_factory=dict)

    @staticmethod
    def bucket(match: int, hits: int, total: int) -> tuple:
        freq = hits / total
        return (min(match, 3) if match <= 3 else 4 + (match > 6) + (match > 12),
                min(4, int(freq * 5)), min(total, 3))

    def confidence(self, bucket: tuple, hits: int, total: int, match: int) -> float:
        right, judged = self.table.get(bucket, (0.0, 0.0))
        prior = hits / (total + 1 / match)  # an unseen alternative, less likely after a longer match
        return min(0.99, max(0.01, (right + self.weight * prior) / (judged + self.weight)))

    def observe(self, bucket: tuple, right: bool) -> None:
        row = self.table.setdefault(bucket, [0.0, 0.0])
        row[0] = row[0] * self.decay + float(right)
        row[1] = row[1] * self.decay + 1.0


class SuffixDrafter(Drafter):
    def __init__(self, config: DrafterConfig) -> None:
        self.config = config
        self.device: torch.device | str = "cpu"
        self.seqs: dict[str, Context] = {}
        self.store = Store(config.suffix_store, config.suffix_depth)
        self.calibration = Calibration()

    @property
    def has_confidence(self) -> bool:
        return True

    @property
    def bursty(self) -> bool:
        return True

    def bind(self, target, num_blocks: int, block_size: int) -> None:
        self.device = target.device

    # ---- the per-request index -------------------------------------------------------------
    def extend(self, rows: Sequence[ContextRow]) -> None:
        for r in rows:
            seq = self.seqs.setdefault(r.seq_id, Context())
            if r.start != len(seq.tokens):
                raise RuntimeError(f"suffix index of {r.seq_id} has {len(seq.tokens)} tokens, got start {r.start}")
            self._append(seq, r.token_ids)
            seq.served = True

    def _append(self, seq: Context, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            seq.tokens.append(int(t))
            if len(seq.tokens) > 1:
                count(seq.index, seq.tokens, len(seq.tokens) - 1, self.config.suffix_depth)

    def _sequence(self, inp: ProposeInput) -> Context:
        """The request's index, rebuilt from its history when the caller skipped `extend`."""
        seq = self.seqs.get(inp.seq_id)
        if seq is None or len(seq.tokens) != inp.context_len:
            seq = self.seqs[inp.seq_id] = Context()
            self._append(seq, inp.tokens[: inp.context_len])
        return seq

    def free(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None and seq.served:  # never the throw-away contexts of a profile measurement
            self.store.add(seq.tokens)

    def forget(self) -> None:
        self.store = Store(self.config.suffix_store, self.config.suffix_depth)

    # ---- drafting ---------------------------------------------------------------------------
    def lookup(self, seq: Context, tail: list[int]) -> tuple[int, dict[int, int]]:
        """(match length, continuation counts) of the longest n-gram ending `tail` in either index."""
        for n in range(min(self.config.suffix_depth, len(tail)), 0, -1):
            key = tuple(tail[-n:])
            own, shared = seq.index.get(key), self.store.index.get(key)
            if own or shared:
                merged = dict(own or {})
                for t, c in (shared or {}).items():
                    merged[t] = merged.get(t, 0) + c
                return n, merged
        return 0, {}

    def walk(self, seq: Context, anchor: int) -> tuple[list[int], list[float], list[tuple]]:
        """Draft tokens, their confidences and calibration buckets for one request."""
        cfg, tail = self.config, seq.tokens[-self.config.suffix_depth :] + [anchor]
        tokens, conf, buckets, survival = [], [], [], 1.0
        while len(tokens) < self.gamma:
            match, counts = self.lookup(seq, tail)
            if not match or len(tokens) >= cfg.suffix_alpha * match:
                break
            token, hits = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))
            total = sum(counts.values())
            bucket = Calibration.bucket(match, hits, total)
            c = self.calibration.confidence(bucket, hits, total, match)
            survival *= c
            if survival < cfg.suffix_floor:
                break
            tokens.append(token)
            conf.append(c)
            buckets.append(bucket)
            tail = tail[1:] + [token] if len(tail) > cfg.suffix_depth else tail + [token]
        return tokens, conf, buckets

    def judge(self, seq: Context, anchor: int) -> None:
        """Score the last proposal against the tokens committed since (the anchor included)."""
        if seq.proposal is None:
            return
        start, tokens, buckets = seq.proposal
        known = len(seq.tokens) + 1  # positions 0..len(tokens): committed tokens, then the anchor
        for k, (tok, bucket) in enumerate(zip(tokens, buckets, strict=True)):
            pos = start + k
            if pos >= known:
                break
            truth = seq.tokens[pos] if pos < len(seq.tokens) else anchor
            self.calibration.observe(bucket, truth == tok)
            if truth != tok:
                break
        seq.proposal = None

    def propose(self, inputs: Sequence[ProposeInput], rows: SamplingRows, depth: int | None = None) -> DraftBlock:
        # a copy costs nothing per position: depth is ignored
        g = self.gamma
        drafts, confs = [], []
        for inp in inputs:
            seq = self._sequence(inp)
            self.judge(seq, inp.anchor)
            tokens, conf, buckets = self.walk(seq, inp.anchor)
            seq.proposal = (inp.context_len + 1, tokens, buckets) if tokens else None
            drafts.append(tokens)
            confs.append(conf)
        tokens = copied_tokens(drafts, [i.anchor for i in inputs], g, self.device)
        conf = upload([c + [0.01] * (g - len(c)) for c in confs], self.device, torch.float32)
        return DraftBlock(tokens, None, conf, [len(d) for d in drafts])
