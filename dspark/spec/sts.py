"""Sequential Temperature Scaling (STS) of the confidence head (`docs/architecture.md`, Calibration).

Each c_k models P(x_k accepted | prefix accepted), so the survival a_k = prod_{i<=k} c_i
should match the observed rate of "prefix accepted through k". For k = 1..gamma in order,
a 1-D grid search picks the temperature T_k of c_k's logit that minimises the ECE of a_k
against the binary outcomes, keeping T_1..T_{k-1} fixed. Temperature scaling is monotone,
so the ranking within a position is unchanged.

Metrics per position: ECE (20 equal-width bins), AUROC (rank statistic) and Brier score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GRID = torch.logspace(-1.0, 1.0, 241).tolist()  # T in [0.1, 10]


def ece(pred: torch.Tensor, outcome: torch.Tensor, bins: int = 20) -> float:
    """Expected calibration error with equal-width bins over [0, 1]."""
    idx = (pred.clamp(0, 1 - 1e-9) * bins).long()
    p_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, pred.double())
    y_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, outcome.double())
    return float((p_sum - y_sum).abs().sum() / max(1, len(pred)))


def auroc(pred: torch.Tensor, outcome: torch.Tensor) -> float | None:
    """P(score of a positive > score of a negative), ties counted half; None if one class."""
    pos, neg = pred[outcome > 0.5].double(), pred[outcome <= 0.5].double()
    if len(pos) == 0 or len(neg) == 0:
        return None
    allp = torch.cat([pos, neg])
    order = allp.argsort()
    ranks = torch.empty_like(allp)
    ranks[order] = torch.arange(1, len(allp) + 1, dtype=torch.float64)
    for value in allp.unique():  # average ranks over ties
        tie = allp == value
        ranks[tie] = ranks[tie].mean()
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def brier(pred: torch.Tensor, outcome: torch.Tensor) -> float:
    return float(((pred.double() - outcome.double()) ** 2).mean())


def survival(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """logits [N, g] -> a [N, g] = cumulative products of sigmoid(logit_k / T_k)."""
    t = torch.tensor(temperatures, dtype=logits.dtype)
    return torch.cumprod(torch.sigmoid(logits / t), dim=1)


@dataclass
class Calibration:
    temperatures: list[float]
    before: list[dict]  # per position: ece, auroc, brier
    after: list[dict]


def metrics(pred: torch.Tensor, outcome: torch.Tensor) -> list[dict]:
    return [{"ece": ece(pred[:, k], outcome[:, k]), "auroc": auroc(pred[:, k], outcome[:, k]),
             "brier": brier(pred[:, k], outcome[:, k]), "mean_pred": float(pred[:, k].mean()),
             "observed": float(outcome[:, k].float().mean())} for k in range(pred.shape[1])]


def outcomes(accepted: torch.Tensor, g: int) -> torch.Tensor:
    """y_k = 1 iff at least k draft tokens of the block were accepted: [N, g]."""
    return (accepted[:, None] >= torch.arange(1, g + 1)[None]).float()


def fit_sts(logits: torch.Tensor, accepted: torch.Tensor,
            held: tuple[torch.Tensor, torch.Tensor] | None = None) -> Calibration:
    """logits [N, g] raw confidence logits of N verified blocks (full block verified);
    accepted [N] draft tokens accepted in each. The metrics before/after are computed on
    `held` (logits, accepted) when given -- rounds not used for the fit -- else in-sample."""
    g = logits.shape[1]
    outcome = outcomes(accepted, g)
    logits = logits.double()
    temps = [1.0] * g
    for k in range(g):
        best_t, best = 1.0, float("inf")
        for t in GRID:
            temps[k] = t
            err = ece(survival(logits[:, : k + 1], temps[: k + 1])[:, k], outcome[:, k])
            if err < best - 1e-12:
                best, best_t = err, t
        temps[k] = best_t
    if held is not None:
        logits, outcome = held[0].double(), outcomes(held[1], g)
    return Calibration(temps, metrics(survival(logits, [1.0] * g), outcome), metrics(survival(logits, temps), outcome))
