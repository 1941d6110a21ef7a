"""Building blocks shared by the target runtime and the drafters: RMSNorm, RoPE, SwiGLU.

Every function takes the flat `[num_tokens, ...]` layout or a batched `[B, T, ...]`
layout alike (they act on the last dimension).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dspark.models.fused import Fused, outputs, refresh


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference implementations do."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * normalized(x, self.eps)


def normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x²) + eps) over the last axis in float32 (one kernel on CUDA), cast back to x's dtype;
    RMSNorm applies its weight after the cast, as the reference implementations do."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class SwiGLU(nn.Module):
    """The gated MLP of Llama/Qwen: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.fused: Fused | None = None  # gate and up as one product (`fuse_projections`)
        self.fused_down: Fused | None = None  # down_proj's product

    def fuse_projections(self) -> None:
        self.fused = refresh(self.fused, self.gate_proj, self.up_proj)
        self.fused_down = refresh(self.fused_down, self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = outputs(self.fused, (self.gate_proj, self.up_proj), x)
        return outputs(self.fused_down, (self.down_proj,), F.silu(gate) * up)[0]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] with the config's rope scaling applied.

    Supported scalings: none/default, `linear` and `llama3`; anything else is refused with a
    clear error rather than silently giving wrong positions.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3_scaled(inv, scaling).float()
    raise ValueError(f"unsupported rope_scaling type {kind!r}; dspark supports default, linear, llama3")


def _llama3_scaled(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


class Rotary(nn.Module):
    """Rotary position embedding; positions are given explicitly per token."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self.attention_factor = 1.0

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., head_dim], sin with its first half negated: the sign of
        `apply_rope`'s rotation folded in once per step instead of a negation per layer."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        sin = emb.sin()
        sin[..., : freqs.shape[-1]].neg_()
        return emb.cos().to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim]; cos/sin [..., head_dim] from `Rotary.cos_sin` broadcast over heads.
    x * cos + rotate_half(x) * sin of the reference implementations, where rotate_half(x) = [-x2, x1]:
    with the sign in sin, rotate_half is a roll by half the head (bit for bit the same; two ops fewer)."""
    return x * cos.unsqueeze(-2) + x.roll(x.shape[-1] // 2, -1) * sin.unsqueeze(-2)
