"""DSpark's sequential heads and confidence head (`docs/architecture.md`, The DSpark drafter; paper §3.1-3.2.1).

A sequential head adds a prefix-dependent bias B_k to the backbone's base logits U_k, so
draft token x_k depends on the tokens sampled before it in the block:
- markov: B = W1[x_{k-1}] W2 (low rank r);
- gated:  g = sigmoid(Wg [h_k; W1[x_{k-1}]] + b), B = W2 (g * W1[x_{k-1}]);
- rnn:    z = [s_{k-1}; W1[x_{k-1}]; h_k] -> gate/candidate/output, B = tanh(o) W2;
- mlp:    the markov bias plus a correction of the hidden state read through the target's LM head E:
          B = W1[x_{k-1}] W2 + E W_o silu(W_i [h_k; W1[x_{k-1}]]) (W_o starts at zero: the markov head it grows from).
          Logit-space heads learn their W2 from zero over the vocabulary; this one moves h_k in the space the
          LM head already reads, and x_{k-1} and h_k meet through a nonlinearity (not a bias added after).
`step` is the one code path used both when sampling left to right and when teacher-forcing
in training (`teacher` loops `step` over the block), so the two cannot drift apart.
The confidence head reads [h_k; W1[x_{k-1}]], known before x_k is drawn (non-anticipating).
Serving over a draft vocabulary, the markov bias after a draft token is a row of the table
W1 W2^T over that vocabulary (`transitions`): one gather per position instead of a lookup
and a product; so is the bias after the anchor when the anchor is one of its tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from dspark.device import upload
from dspark.models.fused import Fused, Product, refresh

TABLE_BYTES = 64 << 20  # the largest transition table a markov head keeps (N x N float32)


class SequentialHead(nn.Module):
    def __init__(self, kind: str, vocab: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.kind = kind
        self.w1 = nn.Embedding(vocab, rank)  # W1: previous token -> r
        self.w2 = nn.Linear(rank, vocab, bias=False)  # W2: r -> vocabulary bias
        nn.init.normal_(self.w1.weight, std=0.02)
        nn.init.zeros_(self.w2.weight)  # start as the plain parallel drafter
        if kind == "gated":
            self.gate = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.cell = nn.Linear(2 * rank + hidden, 3 * rank)
        elif kind == "mlp":
            self.mix_in = nn.Linear(hidden + rank, hidden)
            self.mix_out = nn.Linear(hidden, hidden, bias=False)
            nn.init.zeros_(self.mix_out.weight)  # adds nothing until training moves it
        self.rank = rank
        self.rows: Product | None = None  # the product with W2's rows for a draft vocabulary (serving), or None
        self.fused: Fused | None = None  # W2's product over every token, serving (`out`)
        self.table: torch.Tensor | None = None  # markov over a draft vocabulary: [N, N] bias after each draft token
        self.row_of: dict[int, int] = {}  # token id -> its row of the table (the draft vocabulary's tokens)
        self.narrow = True  # whether this proposal biases the draft vocabulary alone (`NeuralDrafter.select_vocab`)
        self.project = None  # mlp: the drafter's LM head (hidden [..., d] -> float32 logits over what it scores)

    def restrict(self, ids: torch.Tensor | None) -> None:
        """Bias only the draft vocabulary's tokens (ids [N]); None: every token again."""
        self.rows, self.table, self.row_of = None, None, {}
        if ids is None:
            return
        rows = self.w2.weight.detach()[ids].contiguous()
        self.rows = Product(rows, None, [rows])
        if self.kind == "markov" and len(ids) ** 2 * 4 <= TABLE_BYTES:
            self.table = transitions(self.w1.weight.detach()[ids], rows)
            self.row_of = {token: row for row, token in enumerate(ids.tolist())}

    @property
    def active_table(self) -> torch.Tensor | None:
        """The transition table when this proposal drafts over the draft vocabulary, else None."""
        return self.table if self.narrow else None

    def table_rows(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """The table rows [R] of these token ids (host ints) when this proposal reads the table and every one
        is in the draft vocabulary, else None: a block's first bias is then one row lookup, not a product."""
        if self.active_table is None or any(t not in self.row_of for t in tokens):
            return None
        return upload([self.row_of[t] for t in tokens], self.active_table.device)

    def out(self, x: torch.Tensor) -> torch.Tensor:
        """[..., r] -> vocabulary bias [..., V] (or [..., N] over the draft vocabulary)."""
        if self.rows is not None and self.narrow:
            return self.rows(x)
        if torch.is_grad_enabled():
            return self.w2(x)
        # W2 as a product that keeps oneDNN's blocked copy on CPU (`models/fused.py`), made on first use and
        # anew after a `.to()`, in every drafter alike: a sampled block draws every position over all V
        # tokens, and the plain product re-blocked the weight in each
        self.fused = refresh(self.fused, self.w2)
        return self.fused(x)[0]

    def step(self, h: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None):
        """h [..., d], prev [...] long -> (bias [..., V], W1[prev] [..., r], new state)."""
        e = self.w1(prev)
        if self.kind == "markov":
            return self.out(e), e, state
        if self.kind == "gated":
            g = torch.sigmoid(self.gate(torch.cat([h, e], dim=-1)))
            return self.out(g * e), e, state
        if self.kind == "mlp":
            assert self.project is not None, "an mlp head reads through its drafter's LM head (set `project`)"
            fix = self.mix_out(nn.functional.silu(self.mix_in(torch.cat([h, e.to(h.dtype)], dim=-1))))
            return self.out(e).float() + self.project(fix), e, state
        s = state if state is not None else torch.zeros_like(e)
        gate, cand, out = self.cell(torch.cat([s, e, h], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(gate)
        s = g * s + (1 - g) * torch.tanh(cand)
        return self.out(torch.tanh(out)), e, s

    def teacher(self, h: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced biases: h [..., gamma, d], prev [..., gamma] (x_0..x_{gamma-1})
        -> bias [..., gamma, V], W1[prev] [..., gamma, r]."""
        biases, embs, state = [], [], None
        for k in range(h.shape[-2]):
            b, e, state = self.step(h[..., k, :], prev[..., k], state)
            biases.append(b)
            embs.append(e)
        return torch.stack(biases, dim=-2), torch.stack(embs, dim=-2)


def transitions(w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """W1 [N, r], W2 [N, r] over a draft vocabulary -> [N, N] float32: row i is the markov bias after
    draft token i, rounded to the weights' dtype as the product `out` rounds it."""
    return (w1.float() @ w2.float().T).to(w1.dtype).float()


def greedy_walk(base: torch.Tensor, table: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Greedy drafting along the markov table: base logits [R, depth, N] float32, the table [N, N] and each
    row's first table row [R] -> draft positions [R, depth], x_k = argmax(base_k + table[x_{k-1}]).
    On CPU the walk runs in NumPy over the tensors' own memory (no copy): three small vector operations
    per position cost about a quarter of what three torch calls' dispatch does, and the result is the
    same (float32 sums, the first maximum on ties)."""
    return (host_walk if base.device.type == "cpu" else device_walk)(base, table, first)


def host_walk(base: torch.Tensor, table: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """`greedy_walk` in NumPy (CPU tensors)."""
    b, t, index = base.numpy(), table.numpy(), first.numpy()
    out = np.empty(base.shape[:2], dtype=np.int64)
    for k in range(base.shape[1]):
        index = (b[:, k] + t[index]).argmax(-1)
        out[:, k] = index
    return torch.from_numpy(out)


def device_walk(base: torch.Tensor, table: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """`greedy_walk` in torch operations (any device; nothing is copied to the host)."""
    picks, index = [], first
    for k in range(base.shape[1]):
        index = (base[:, k] + table.index_select(0, index)).argmax(-1)
        picks.append(index)
    return torch.stack(picks, 1) if picks else first.new_zeros(len(first), 0)


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(w^T [h_k; W1[x_{k-1}]] + b); returns the logit (STS scales it). rank 0: [h_k] alone."""

    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1)

    def forward(self, h: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor:
        """prev_emb None: a head that reads h_k alone (DeepSpec's confidence_head_with_markov=false)."""
        x = h if prev_emb is None else torch.cat([h, prev_emb], dim=-1)
        return self.proj(x).squeeze(-1).float()


def calibrated(conf_logits: torch.Tensor, greedy: tuple[bool, ...], sampled_t: tuple[float, ...],
               greedy_t: tuple[float, ...]) -> torch.Tensor:
    """conf_logits [R, g] -> confidences, each row with its own kind's temperatures: greedy rows
    (greedy[r]) with greedy_t where there are any, the others with sampled_t."""
    if greedy_t and all(greedy):
        return apply_sts(conf_logits, greedy_t)
    sampled = apply_sts(conf_logits, sampled_t)
    if not greedy_t or not any(greedy):
        return sampled
    fitted = apply_sts(conf_logits, greedy_t)
    return torch.where(upload(greedy, conf_logits.device, torch.bool)[:, None], fitted, sampled)


def apply_sts(conf_logits: torch.Tensor, temperatures: tuple[float, ...]) -> torch.Tensor:
    """Calibrated confidences: sigmoid(logit_k / T_k) per position k (last dim = gamma)."""
    if not temperatures:
        return torch.sigmoid(conf_logits)
    t = _uploaded(tuple(temperatures), conf_logits.device, conf_logits.dtype)
    return torch.sigmoid(conf_logits / t[: conf_logits.shape[-1]])


@functools.cache
def _uploaded(temperatures: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A drafter's STS temperatures as a tensor on its device, made once (every proposal divides by them)."""
    return upload(temperatures, device, dtype)
