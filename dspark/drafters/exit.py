"""The early exit: a one-position DSpark proposal read after the backbone's first layers (`DrafterConfig.exit_layer`).

Under load the scheduler drafts one position per request or none: each extra token verified costs about as much as
a plain one, and only the first draft is likely enough to pay. A one-position proposal of the full backbone still
runs every layer over every request's anchor slot; MTP-1 runs one. The exit reads the anchor slot's residual stream
after `exit_layer` layers through a gated MLP and a norm of its own, then the drafter's LM head and sequential head
as the full path does, and scores it with a confidence head of its own. It is trained with every other weight frozen
(`DrafterTrainConfig.exit_only`), so the full block computes exactly what it did; a drafter grown with it
(`train/surgery.py` `with_exit`) starts as a plain early exit (the MLP's output projection at zero, the final norm's
weights and the confidence head copied).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.drafters.heads import ConfidenceHead
from dspark.models.layers import RMSNorm, SwiGLU


class Exit(nn.Module):
    """The residual stream x [..., d] after the exit layer -> the hidden the LM head reads, norm(x + MLP(norm(x)))."""

    def __init__(self, hidden: int, width: int, eps: float, conf_rank: int | None) -> None:
        """conf_rank: the confidence head's markov rank (0: it reads the hidden alone; None: no confidence head)."""
        super().__init__()
        self.pre = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, width)
        torch.nn.init.zeros_(self.mlp.down_proj.weight)  # adds nothing until training moves it
        self.norm = RMSNorm(hidden, eps)
        self.conf = ConfidenceHead(hidden, conf_rank) if conf_rank is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.mlp(self.pre(x)))
