"""Drafter losses (`docs/architecture.md`, Calibration and drafter training), all over blocks [..., gamma] with a validity mask.

- DSpark: `0.1 * CE + 0.9 * L1 + 1.0 * conf`, each weighted per position by
  w_k = exp(-(k-1)/gamma); L1 = ||p_d - p_t||_1 (p_d includes the sequential bias,
  teacher-forced); conf = BCE(c_k, c*_k) with the soft label c*_k = 1 - ||p_d - p_t||_1 / 2
  (detached). An optional soft-CE term (`LossWeights.soft_ce`, 0 in the paper's loss) adds
  the full target distribution as a label: L1's gradient vanishes where p_d and p_t do not
  overlap, and one sampled label is a noisy stand-in for p_t when training is short.
- DFlash / MTP: CE only. EAGLE-3: soft CE against the target, step weights 0.8^k.
`acceptance` is the teacher-forced per-position acceptance used for progress reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    soft_ce: float = 0.0
    first: float = 1.0  # the first position's weight, a multiple of what the kind's schedule gives it


def position_weights(gamma: int, device, kind: str = "dspark", first: float = 1.0) -> torch.Tensor:
    """The kind's weight per block position (EAGLE-3 0.8^k, else exp(-k/gamma)), the first one times `first`
    (the first position's acceptance multiplies every later term of tau; from random weights, x7 raised the DSpark
    drafter's expected tau 4.2% at step 200, x3 on the shipped drafter 0.4% in 300 steps; `docs/models/dspark-small.md`)."""
    k = torch.arange(gamma, device=device, dtype=torch.float32)
    w = 0.8**k if kind == "eagle3" else torch.exp(-k / gamma)
    w[0] = w[0] * first
    return w


def acceptance(p_draft: torch.Tensor, p_target: torch.Tensor) -> torch.Tensor:
    """1 - ||p_d - p_t||_1 / 2 per position: the probability that speculative sampling
    accepts a token drawn from p_d when the target's distribution is p_t."""
    return 1.0 - 0.5 * (p_draft - p_target).abs().sum(-1)


def soft_ce(p_target: torch.Tensor, logp_draft: torch.Tensor) -> torch.Tensor:
    """-sum_v p_t(v) log p_d(v) per position (KL(p_t || p_d) plus the target's entropy)."""
    return -(p_target * logp_draft).sum(-1)


def _weighted_mean(per_pos: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    w = weights * valid.float()  # [..., g]
    return (per_pos * w).sum() / w.sum().clamp_min(1.0)


def drafter_loss(
    kind: str,
    logits: torch.Tensor,  # [..., g, V] draft logits (float32)
    conf_logits: torch.Tensor | None,  # [..., g]
    target_logits: torch.Tensor,  # [..., g, V]
    labels: torch.Tensor,  # [..., g] the target's tokens x*_k
    valid: torch.Tensor,  # [..., g] bool: position inside the valid prefix
    weights: LossWeights = LossWeights(),
) -> tuple[torch.Tensor, dict[str, float]]:
    g = logits.shape[-2]
    w = position_weights(g, logits.device, kind, weights.first)
    logp_d = logits.log_softmax(-1)
    p_t = target_logits.float().softmax(-1)
    ce = -logp_d.gather(-1, labels[..., None])[..., 0]  # [..., g]
    parts: dict[str, torch.Tensor] = {}
    if kind == "eagle3":
        parts["soft_ce"] = _weighted_mean(soft_ce(p_t, logp_d), w, valid)
        total = parts["soft_ce"]
    elif kind in ("dflash", "mtp"):
        parts["ce"] = _weighted_mean(ce, w, valid)
        total = parts["ce"]
    else:
        p_d = logp_d.exp()
        l1 = (p_d - p_t).abs().sum(-1)
        parts["ce"] = _weighted_mean(ce, w, valid)
        parts["tv"] = _weighted_mean(l1, w, valid)
        total = weights.ce * parts["ce"] + weights.tv * parts["tv"]
        if weights.soft_ce:
            parts["soft_ce"] = _weighted_mean(soft_ce(p_t, logp_d), w, valid)
            total = total + weights.soft_ce * parts["soft_ce"]
        if conf_logits is not None:
            soft = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
            bce = F.binary_cross_entropy_with_logits(conf_logits.float(), soft, reduction="none")
            parts["conf"] = _weighted_mean(bce, w, valid)
            total = total + weights.conf * parts["conf"]
    return total, {k: float(v.detach()) for k, v in parts.items()}
