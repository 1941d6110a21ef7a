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
W1 W2^T over that vocabulary, and the mlp head's correction is read from tables too (`tables.py`):
a gather per position instead of a lookup and a product; so is the bias after the anchor when the
anchor is one of its tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from dspark.device import upload
from dspark.drafters.tables import TABLE_BYTES, Mix, transitions
from dspark.models.fused import Fused, Product, refresh, stamp


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
        self.fused: Fused | None = None  # W2's product over every token, serving on other devices (`out`)
        self.wide: torch.Tensor | None = None  # W2^T in float32, serving over every token on CPU (`wide_weight`)
        self.wide_key: tuple | None = None  # the `stamp` of the W2 it was made from
        self.table: torch.Tensor | None = None  # markov over a draft vocabulary: [N, N] bias after each draft token
        self.mix: Mix | None = None  # mlp over a draft vocabulary: its correction's tables (`tables.py`)
        self.row_of: dict[int, int] = {}  # token id -> its row of the table (the draft vocabulary's tokens)
        self.narrow = True  # whether this proposal biases the draft vocabulary alone (`NeuralDrafter.select_vocab`)
        self.project = None  # mlp: the drafter's LM head (hidden [..., d] -> float32 logits over what it scores)

    def restrict(self, ids: torch.Tensor | None, lm_rows: torch.Tensor | None = None) -> None:
        """Bias only the draft vocabulary's tokens (ids [N]; lm_rows [N, d]: the LM head's rows for them, which
        an mlp head's tables read); None: every token again."""
        self.rows, self.table, self.mix, self.row_of = None, None, None, {}
        if ids is None:
            return
        rows = self.w2.weight.detach()[ids].contiguous()
        self.rows = Product(rows, None, [rows])
        if self.kind not in ("markov", "mlp") or len(ids) ** 2 * 4 > TABLE_BYTES:
            return
        w1 = self.w1.weight.detach()[ids]
        if self.kind == "mlp":
            assert lm_rows is not None, "an mlp head's tables read the LM head's rows of the draft vocabulary"
            self.mix = Mix.build(self.mix_in, self.mix_out, w1, lm_rows)
        self.table = transitions(w1, rows)
        self.row_of = {token: row for row, token in enumerate(ids.tolist())}

    @property
    def active_table(self) -> torch.Tensor | None:
        """The transition table when this proposal drafts over the draft vocabulary, else None."""
        return self.table if self.narrow else None

    @property
    def active_mix(self) -> Mix | None:
        """An mlp head's correction tables when this proposal drafts over the draft vocabulary, else None."""
        return self.mix if self.narrow else None

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
        if x.device.type == "cpu":  # float32 [..., V]: a sampled block draws every position over all V tokens
            return x.float() @ self.wide_weight()
        # W2 as one product (`models/fused.py`), made on first use and anew after a `.to()`
        self.fused = refresh(self.fused, self.w2)
        return self.fused(x)[0]

    def wide_weight(self) -> torch.Tensor:
        """W2^T [r, V] in float32, made again when W2 changed (a `.to()`, `load_state_dict`, an optimizer step).
        On a 2-core Xeon with AMX the bias of one row over 8,192 tokens took 17 µs so, against 67 as a bfloat16
        product (8 rows 46 against 87; level at 64 rows): seven times per sampled block."""
        key = stamp(self.w2.weight)
        if self.wide is None or self.wide_key != key:
            self.wide, self.wide_key = self.w2.weight.detach().float().T.contiguous(), key
        return self.wide

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
