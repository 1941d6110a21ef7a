"""SamplingParams and the logits processing shared by the target and every drafter.

The same `probabilities(logits, temperature, top_p, top_k)` turns target logits and draft
logits into distributions, so verification compares like with like (DESIGN.md §3.3).
Temperature 0 means greedy: a one-hot distribution on the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    max_tokens: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob + top-k alternatives

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
            (isinstance(self.temperature, int | float) and 0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be >= 0 (or -1 to disable)"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(
    logits: torch.Tensor,  # [M, V] float32
    temperature: torch.Tensor,  # [M]
    top_p: torch.Tensor,  # [M]
    top_k: torch.Tensor,  # [M] long, 0 = off
) -> torch.Tensor:  # [M, V]
    """Temperature, top-k, top-p (in that order), then softmax; greedy rows are one-hot."""
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    vocab = logits.shape[-1]
    if bool((top_p >= 1.0).all()) and bool((top_k <= 0).all()):
        return _with_greedy(scaled.softmax(-1), logits, greedy)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs_sorted = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays)
    before = probs_sorted.cumsum(-1) - probs_sorted
    drop = drop | ((before >= top_p[:, None]) & (ranks > 0))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.empty_like(scaled).scatter_(-1, order, sorted_logits.softmax(-1))
    return _with_greedy(probs, logits, greedy)


def _with_greedy(probs: torch.Tensor, logits: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    if not bool(greedy.any()):
        return probs
    onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, probs)


def sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [M, V]; row i uses generators[i] (per-request seed).
    One-hot (greedy) rows take their argmax; unseeded rows share one batched draw."""
    out = probs.argmax(-1)
    greedy = (probs.max(-1).values >= 1.0).tolist()  # one host read for the batch, not one per row
    free = [i for i, g in enumerate(generators) if g is None and not greedy[i]]
    if free:
        idx = torch.tensor(free, device=probs.device)
        out[idx] = torch.multinomial(probs[idx], 1)[:, 0]
    for i, gen in enumerate(generators):
        if gen is not None and not greedy[i]:
            out[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
    return out
