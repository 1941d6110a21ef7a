"""Lossless verification of variable-length draft prefixes (`docs/architecture.md`, Verification).

For request r with l_r verified draft tokens x_1..x_l, draft distributions q_k and target
distributions p_1..p_{l+1} (p_k from the target's logits at the token before x_k):
accept x_k with probability min(1, p_k(x_k) / q_k(x_k)) while all before it were accepted;
at the first rejection emit a token from norm(max(p_k - q_k, 0)) (the recovered token);
if all l are accepted emit a token from p_{l+1} (the bonus token). Greedy decoding is the
same rule with one-hot p and q: accept iff x_k is the target's argmax, and emit the argmax.
Vectorised over the padded [R, gamma] layout; one uniform per position per request, drawn
from the request's generator (its own when it has a seed, else its engine's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.sampling import inverse_cdf, uniforms


@dataclass
class Verdict:
    num_accepted: list[int]  # accepted draft tokens per request
    tokens: list[list[int]]  # emitted per request: accepted drafts + the recovered/bonus token


def verify(
    draft_tokens: torch.Tensor,  # [R, G] long
    draft_probs: torch.Tensor,  # [R, G, V]
    target_probs: torch.Tensor,  # [R, G+1, V]; row k of request r valid for k <= l_r
    lengths: torch.Tensor,  # [R] long, l_r in 0..G
    generators: Sequence[torch.Generator | None],
) -> Verdict:
    rows, width = draft_tokens.shape
    dev = draft_tokens.device
    p_x = target_probs[:, :width].gather(-1, draft_tokens[..., None])[..., 0]  # [R, G]
    q_x = draft_probs.gather(-1, draft_tokens[..., None])[..., 0].clamp_min(1e-30)
    u = uniforms(rows, width + 1, generators, dev)  # last column samples the final token
    accepted = accepted_prefix(u[:, :width] * q_x < p_x, lengths)  # u < p/q without dividing
    final = target_probs[torch.arange(rows, device=dev), accepted]  # [R, V]
    # the residual is computed for every row (rows that were not rejected keep `final`): asking
    # the device whether any row was rejected would wait for it
    rejected = accepted < lengths
    if width == 0:  # nothing drafted: every row emits from its first target distribution
        return _verdict(accepted, draft_tokens, inverse_cdf(final, u[:, 0]))
    q_at = draft_probs[torch.arange(rows, device=dev), accepted.clamp(max=width - 1)]
    residual = (final - q_at).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), final)
    final = torch.where(rejected[:, None], residual, final)
    return _verdict(accepted, draft_tokens, inverse_cdf(final, u[:, width]))


def verify_greedy(
    draft_tokens: torch.Tensor,  # [R, G] long
    target_tokens: torch.Tensor,  # [R, G+1] long: the target's argmax at each verified position
    lengths: torch.Tensor,  # [R] long, l_r in 0..G
) -> Verdict:
    """`verify` when every request is greedy, without building one-hot distributions: accept
    while x_k is the target's argmax, then emit the argmax where the prefix stopped (the same
    tokens `verify` gives one-hot p and q, whatever its uniforms)."""
    accepted = accepted_prefix(draft_tokens == target_tokens[:, : draft_tokens.shape[1]], lengths)
    return _verdict(accepted, draft_tokens, target_tokens.gather(1, accepted[:, None])[:, 0])


def accepted_prefix(ok: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """ok [R, G] bool (position k would be accepted) -> [R] accepted tokens: the run of ok
    positions from the start, within each request's verified l_r."""
    in_prefix = torch.arange(ok.shape[1], device=ok.device)[None, :] < lengths[:, None]
    return (ok & in_prefix).long().cumprod(-1).sum(-1)


def _verdict(accepted: torch.Tensor, draft_tokens: torch.Tensor, last: torch.Tensor) -> Verdict:
    # one host copy for the whole batch: every read waits for the device
    host = torch.cat([accepted[:, None], last[:, None], draft_tokens], 1).tolist()
    return Verdict([row[0] for row in host], [row[2 : 2 + row[0]] + [row[1]] for row in host])
