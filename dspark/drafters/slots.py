"""Per-slot MLPs: weights each slot of a parallel block runs on its own (`DrafterConfig.slot_mlp`).

Every backbone weight of a DSpark drafter serves all gamma slots of its block, and each slot asks another question:
the anchor slot the next token, slot k the token k+1 ahead. The one-slot diagnostic (`docs/models/dspark-small.md`)
found most of what the first position lacks in that sharing. A slot MLP gives each slot a small gated MLP of its own
after every backbone layer, added to its residual stream, so the layers after it (their attention over the context
and over the slots before it) read a slot-specific state; its output projection starts at zero, so a drafter grown
with it computes what it did until training moves it. A proposal of `depth` positions runs only the first `depth`
slots' MLPs: one batched product per slot over every request's row of that slot.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class SlotMLP(nn.Module):
    """x [..., g, d] (g <= slots) -> x + down_k(silu(gate_k x) * up_k x) for each slot k, width w."""

    def __init__(self, slots: int, dim: int, width: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(slots, dim, 2 * width) * dim**-0.5)
        self.down = nn.Parameter(torch.zeros(slots, width, dim))  # adds nothing until training moves it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, d = x.shape[-2], x.shape[-1]
        if g > self.down.shape[0]:
            raise ValueError(f"a block of {g} slots, slot MLPs for {self.down.shape[0]}")
        rows = x.reshape(-1, g, d).transpose(0, 1)  # [g, N, d]: each slot's rows together
        gate, up = torch.bmm(rows, self.gate_up[:g]).chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, self.down[:g])  # [g, N, d]
        return x + out.transpose(0, 1).reshape(x.shape)
