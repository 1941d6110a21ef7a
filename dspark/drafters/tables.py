"""A sequential head served from tables over a draft vocabulary (`docs/architecture.md`, The DSpark drafter).

Over a draft vocabulary of N tokens, what a sequential head computes from the previous draft token alone can be
computed once for every token the walk can draw, so drafting a position reads rows instead of running products:
- the markov bias W1[x] W2 after each draft token is a row of the table W1 W2^T [N, N] (`transitions`);
- the mlp head's correction E W_o silu(W_i [h_k; W1[x]] + b) splits W_i into its hidden half and its token half.
  The token half with the bias is a row per draft token (`Mix.entry`, [N, d]); the hidden half reads the block's
  hidden states once, before the walk (`Mix.start`); and W_o read through the LM head's rows of the draft
  vocabulary is one matrix (`Mix.exit`, [N, d]). A position then costs a row lookup, an add, a silu and one
  product of d inputs by N outputs, where the head's own step runs two d x d products and the LM head.
Each walk computes what the head's `step` does over the draft vocabulary, up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

TABLE_BYTES = 64 << 20  # the largest transition table a head keeps (N x N float32)


def transitions(w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """W1 [N, r], W2 [N, r] over a draft vocabulary -> [N, N] float32: row i is the markov bias after
    draft token i, rounded to the weights' dtype as the head's product rounds it."""
    return (w1.float() @ w2.float().T).to(w1.dtype).float()


@dataclass(frozen=True)
class Mix:
    """The mlp head's correction over a draft vocabulary, as float32 tables (module docstring)."""

    entry: torch.Tensor  # [N, d]: W_i's token half applied to each draft token's W1 row, plus W_i's bias
    read: torch.Tensor  # [d, d]: W_i's hidden half, transposed (hidden [.., d] @ read -> its share)
    exit: torch.Tensor  # [d, N]: (E_N W_o)^T, the LM head's draft-vocabulary rows E_N after W_o

    @staticmethod
    def build(mix_in: torch.nn.Linear, mix_out: torch.nn.Linear, w1: torch.Tensor, lm_rows: torch.Tensor) -> Mix:
        """From the head's layers, its W1 rows [N, r] and the LM head's rows [N, d] of the draft vocabulary."""
        d = lm_rows.shape[1]
        w_in = mix_in.weight.detach().float()  # [d, d + r]: [h; W1[x]] -> d
        entry = w1.float() @ w_in[:, d:].T + mix_in.bias.detach().float()
        exit_ = (lm_rows.float() @ mix_out.weight.detach().float()).T
        return Mix(entry.contiguous(), w_in[:, :d].T.contiguous(), exit_.contiguous())

    def start(self, hidden: torch.Tensor) -> torch.Tensor:
        """The block's hidden states [R, depth, d] -> their share of each position's pre-activation, float32."""
        return hidden.float() @ self.read

    def bias(self, start: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """One position: its `start` [R, d] and each row's previous draft token (rows of the tables [R])
        -> the correction [R, N] float32."""
        return F.silu(start + self.entry.index_select(0, index)) @ self.exit


def greedy_walk(base: torch.Tensor, table: torch.Tensor, first: torch.Tensor,
                mix: Mix | None = None, start: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy drafting along the tables: base logits [R, depth, N] float32, the markov table [N, N] and each
    row's first table row [R] (and with an mlp head its `Mix` and the block's `start` [R, depth, d]) -> draft
    positions [R, depth], x_k = argmax(base_k + table[x_{k-1}] (+ the correction after x_{k-1})).
    On CPU the walk runs in NumPy over the tensors' own memory (no copy): a few small vector operations
    per position cost about a quarter of what as many torch calls' dispatch does, and the result is the
    same up to float rounding (float32 sums, the first maximum on ties)."""
    return (host_walk if base.device.type == "cpu" else device_walk)(base, table, first, mix, start)


def host_walk(base: torch.Tensor, table: torch.Tensor, first: torch.Tensor,
              mix: Mix | None = None, start: torch.Tensor | None = None) -> torch.Tensor:
    """`greedy_walk` in NumPy (CPU tensors)."""
    b, t, index = base.numpy(), table.numpy(), first.numpy()
    out = np.empty(base.shape[:2], dtype=np.int64)
    for k in range(base.shape[1]):
        logits = b[:, k] + t[index]
        if mix is not None:  # in torch, as `Mix.bias` defines it (NumPy's BLAS threads would wait on torch's)
            logits += mix.bias(start[:, k], torch.from_numpy(index)).numpy()
        index = logits.argmax(-1)
        out[:, k] = index
    return torch.from_numpy(out)


def device_walk(base: torch.Tensor, table: torch.Tensor, first: torch.Tensor,
                mix: Mix | None = None, start: torch.Tensor | None = None) -> torch.Tensor:
    """`greedy_walk` in torch operations (any device; nothing is copied to the host)."""
    picks, index = [], first
    for k in range(base.shape[1]):
        logits = base[:, k] + table.index_select(0, index)
        if mix is not None:
            logits = logits + mix.bias(start[:, k], index)
        index = logits.argmax(-1)
        picks.append(index)
    return torch.stack(picks, 1) if picks else first.new_zeros(len(first), 0)
