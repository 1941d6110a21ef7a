"""`dspark train eval-drafter`: held-out teacher-forced acceptance of saved drafters, side by side.

Training logs its held-out evaluation per run, on batches drawn with that run's `anchors_per_seq`,
so two runs with different anchor densities are measured on different anchor positions (on
dspark-small, two draws of the same 32 sequences moved expected τ by 5%). This command measures
any number of drafter directories on one set of held-out batches, taken from a drafter training
config (its `model`, `heldout`, `seq_len`, `batch_size`, `eval_batches`, `seed`; `--anchors`
overrides its `anchors_per_seq`):

    dspark train eval-drafter --config configs/drafter-small-dspark-stage4.toml \
        --drafter dspark/assets/dspark-small/drafters/dspark --drafter ~/.cache/dspark/export/x/dspark
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from dspark.train.anchors import make_batch
from dspark.train.drafter import (
    DrafterTrainConfig,
    block_targets,
    evaluate,
    load_frozen_target,
    on_device,
    read_rows,
    refined_survival,
    train_device,
)


def load_against(path: str, target, cfg: DrafterTrainConfig):
    """The saved drafter at `path` in float32 on the training device, checked against and reading `target`."""
    from dspark.drafters.neural import check_compatible
    from dspark.drafters.registry import load_one

    drafter = load_one(path).float().to(train_device(cfg))
    check_compatible(drafter.config, target)
    drafter._target = [target]  # type: ignore[attr-defined]
    return drafter


def evaluate_drafters(cfg: DrafterTrainConfig, drafters: Sequence[str], anchors: int = 0) -> dict:
    """{drafter dir: held-out acceptance per position, expected τ (and confidence error); for a drafter with an early
    exit, also its one position's (`exit_acceptance`, `exit_greedy_acceptance`, `exit_conf_mae`)}."""
    if not drafters:
        raise ValueError("name at least one drafter directory (--drafter DIR)")
    if anchors:
        cfg = dataclasses.replace(cfg, anchors_per_seq=anchors)
    target, tok = load_frozen_target(cfg)
    held = read_rows(cfg.heldout)
    pad = tok.pad_id
    out = {}
    for path in drafters:
        drafter = load_against(path, target, cfg)
        out[path] = {**evaluate(drafter, target, held, cfg, drafter.config.gamma, pad),
                     **walk(drafter, target, spread(held, cfg.batch_size * cfg.eval_batches), cfg, pad)}
        if drafter.config.exit_mlp:  # its early exit's one position on the same blocks (`exit_` keys)
            exit_report = evaluate(drafter, target, held, cfg, drafter.config.gamma, pad, exits=True)
            out[path] |= {f"exit_{k}": v for k, v in exit_report.items() if not k.endswith("tau")}
    return {"settings": {k: getattr(cfg, k) for k in ("model", "heldout", "seq_len", "batch_size", "eval_batches",
                                                       "anchors_per_seq", "seed")}, "drafters": out}


def spread(rows: Sequence[dict], n: int) -> list[dict]:
    """n rows evenly spaced through the file (answers are written domain by domain), or all of them."""
    if len(rows) <= n:
        return list(rows)
    return [rows[i * len(rows) // n] for i in range(n)]


@torch.no_grad()
def walk(drafter, target, rows: Sequence[dict], cfg: DrafterTrainConfig, pad: int) -> dict:
    """Greedy verification walked along each answer: a block drafted (teacher-forced) at every response
    position, the round at position p accepting the drafts that match the target's argmax up to the first
    miss and moving to p + accepted + 1. `walk_tau` is emitted tokens per round, `walk_first` the share of
    rounds whose first draft is accepted and `walk_acceptance` each position's acceptance among the rounds
    that reached it: what a greedy `static:γ` run sees on these prompts, exact on greedy answers (`regen
    --temperature 0`), where each next token is the target's argmax. The uniformly drawn anchors of
    `greedy_tau` weigh easy stretches, which a run crosses in a few long rounds, as much as hard ones, where it
    spends most of its rounds (dspark-small's stage-11 DSpark drafter: greedy τ 3.480, walked 2.599;
    `docs/models/dspark-small.md`)."""
    gamma = drafter.config.gamma
    drafter.eval()
    chains = [chain_of(drafter, target, row, cfg, pad) for row in rows]
    drafter.train()
    out = {}
    for name in chains[0] if chains else ("walk",):  # a drafter that can refine: refined and fed drafts walked too
        out |= walked(rows, [c[name] for c in chains], cfg, gamma, name)
    return out


def walked(rows: Sequence[dict], chains: Sequence[dict[int, int]], cfg: DrafterTrainConfig, gamma: int,
           name: str) -> dict:
    """`walk`'s measures (keys prefixed by name) from each answer's chain."""
    tried, hits, tokens = [0] * gamma, [0] * gamma, 0
    for row, chain in zip(rows, chains, strict=True):
        for n, room in rounds_along(chain, len(row["prompt_ids"]), last_of(row, cfg), gamma):
            tokens += n + 1
            for k in range(min(n + 1, room)):  # positions 1..n accepted, n + 1 tried and missed (if in the text)
                tried[k], hits[k] = tried[k] + 1, hits[k] + (k < n)
    rounds = tried[0]
    return {f"{name}_tau": round(tokens / max(1, rounds), 4), f"{name}_first": round(hits[0] / max(1, rounds), 4),
            f"{name}_acceptance": [round(h / t, 4) if t else None for h, t in zip(hits, tried, strict=True)],
            f"{name}_rounds": rounds}


@torch.no_grad()
def chain_of(drafter, target, row: dict, cfg: DrafterTrainConfig, pad: int,
             refining: bool = True) -> dict[str, dict[int, int]]:
    """{"walk": {anchor position: drafts of its teacher-forced block that match the target's argmax up to the first
    miss}} for every response position of one answer (empty where it has none); with refining, for a drafter that
    can refine (`DrafterConfig.refinable`) also "refined_walk", the same for one refining pass's draft
    (`refined_survival`), and "fed_walk", for blocks fed the text's tokens (what refining passes could reach at
    most: every slot reads the true draft before it)."""
    gamma, length = drafter.config.gamma, last_of(row, cfg) + 1
    refines = refining and drafter.config.refinable
    names = ("walk", "refined_walk", "fed_walk") if refines else ("walk",)
    every = max(1, length - 1 - len(row["prompt_ids"]))  # every anchor, in a window as long as the answer
    batch = make_batch([row], length, gamma, every, np.random.default_rng(0), pad)
    if not bool(batch.valid.any()):
        return {name: {} for name in names}
    batch = on_device(batch, cfg)
    taps, t_logits = block_targets(target, batch, drafter.taps)
    logits, _ = drafter.train_forward(taps, batch.tokens, batch.anchors)
    target_ids = t_logits.argmax(-1)
    survived = {"walk": torch.cumprod((logits.argmax(-1) == target_ids).long(), -1)}
    if refines:
        every = torch.ones_like(batch.anchors, dtype=torch.bool)
        fed, _ = drafter.train_forward(taps, batch.tokens, batch.anchors, fed=every)
        survived["refined_walk"] = refined_survival(logits, fed, t_logits).long()
        survived["fed_walk"] = torch.cumprod((fed.argmax(-1) == target_ids).long(), -1)
    anchors = batch.anchors[0].tolist()
    return {name: dict(zip(anchors, (s * batch.valid)[0].sum(-1).tolist(), strict=True))
            for name, s in survived.items()}


def last_of(row: dict, cfg: DrafterTrainConfig) -> int:
    """The position of the answer's last token inside the training window."""
    return min(len(row["prompt_ids"]) + len(row["response_ids"]), cfg.seq_len) - 1


def starts_of(rounds: Sequence[tuple[int, int]], start: int) -> list[int]:
    """The position each round of `rounds_along(..., start, ...)` drafts from."""
    out, p = [], start
    for n, _ in rounds:
        out.append(p)
        p += n + 1
    return out


def rounds_along(chain: dict[int, int], start: int, last: int, gamma: int) -> list[tuple[int, int]]:
    """(accepted, positions the text leaves room for) of each round from `start` to `last`: a round at p
    accepts `chain[p]` drafts, at most up to the token before `last`, and the next starts after the token
    that follows them."""
    out, p = [], start
    while p < last:
        room = min(gamma, last - p - 1)
        n = min(chain.get(p, 0), room)
        out.append((n, max(1, room)))
        p += n + 1
    return out
