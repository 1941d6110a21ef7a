"""`dspark train drafters --config A.toml --config B.toml ...`: several drafters trained side by
side on one target pass per batch.

The frozen target's forward is most of a drafter step's cost when the target is deep; drafters
compared with each other should also see the same data. Here every drafter gets the same batch
at every step (anchors drawn once, for the largest block; a drafter with a smaller gamma reads
the first positions of each block, which is exactly the batch it would have drawn alone), the
target runs once over it tapping the union of the drafters' layers, and each drafter takes its
own loss, optimizer step, evaluation, checkpoint (its own run directory) and export. Equal
budgets by construction: the configs must agree on data, batch shape, steps and seed.

    dspark train drafters --config configs/small/drafter-dspark.toml --config configs/small/drafter-eagle3.toml
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.drafters.base import save_drafter
from dspark.train.checkpoint import append_log, cosine_lr, load_checkpoint, save_checkpoint
from dspark.train.drafter import (
    DrafterTrainConfig,
    batch_at,
    block_targets,
    build,
    checkpoint_state,
    evaluate,
    load_frozen_target,
    optimizer,
    positions_loss,
    read_rows,
    set_lr,
    trainable,
    trained_forward,
)

SHARED = ("model", "data", "heldout", "seq_len", "batch_size", "anchors_per_seq", "max_steps", "seed", "device",
          "eval_every", "eval_batches")


@dataclass
class Member:
    """One drafter of the joint run and its optimizer."""

    cfg: DrafterTrainConfig
    drafter: torch.nn.Module
    dcfg: object
    opt: torch.optim.Optimizer
    step: int

    @property
    def gamma(self) -> int:
        return self.dcfg.gamma  # type: ignore[attr-defined]


def check_shared(cfgs: list[DrafterTrainConfig]) -> None:
    if len(cfgs) < 1:
        raise ValueError("give at least one drafter config")
    for name in SHARED:
        values = {repr(getattr(c, name)) for c in cfgs}
        if len(values) > 1:
            raise ValueError(f"joint training needs one value of {name!r} in every config, got {sorted(values)}")
    dirs = [str(Path(c.run_dir).expanduser()) for c in cfgs]
    if len(set(dirs)) != len(dirs):
        raise ValueError("every drafter of a joint run needs its own run_dir")


def member(cfg: DrafterTrainConfig, loaded) -> Member:
    _, _, drafter, dcfg = build(cfg, loaded)
    opt = optimizer(trainable(drafter, cfg), cfg, drafter)
    state, step = load_checkpoint(cfg.run_dir), 0
    if state is not None:
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    return Member(cfg, drafter, dcfg, opt, step)


def target_pass(target, batch, layers: list[int]):
    """One no-grad target pass: tapped hidden [B, T, U, d] for `layers` and the target's logits
    at every block position [B, A, g, V]."""
    tapped, logits = block_targets(target, batch, layers)
    return tapped.unflatten(-1, (len(layers), -1)), logits


def member_step(m: Member, batch, tapped, t_logits, layers: list[int]) -> dict[str, float]:
    cfg = m.cfg
    lr = cosine_lr(m.step, cfg.lr, cfg.warmup_steps, cfg.max_steps)
    set_lr(m.opt, lr)
    taps = tapped[:, :, [layers.index(t) for t in m.drafter.taps]].flatten(-2)
    logits, conf = trained_forward(m.drafter, cfg.exit_only)(taps, batch.tokens, batch.anchors, conf_stop_grad=cfg.conf_stop_grad)
    loss, parts = positions_loss(cfg, logits, conf, t_logits, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in m.drafter.parameters() if p.requires_grad], cfg.grad_clip)
    m.opt.step()
    m.opt.zero_grad(set_to_none=True)
    m.step += 1
    return {"step": m.step, "loss": loss.item(), **parts, "lr": lr, "time": time.time()}


def save(m: Member) -> None:
    save_checkpoint(m.cfg.run_dir, checkpoint_state(m.drafter, m.opt, m.step, m.cfg))


def train_joint(cfgs: list[DrafterTrainConfig]) -> dict[str, dict]:
    check_shared(cfgs)
    first = cfgs[0]
    loaded = load_frozen_target(first)
    target, tok = loaded
    members = [member(c, loaded) for c in cfgs]
    if len({m.step for m in members}) > 1:
        raise ValueError(f"the run directories are at different steps {[m.step for m in members]}: resume each "
                         "alone to the same step, or start them afresh")
    pad = tok.pad_id
    layers = sorted({t for m in members for t in m.drafter.taps})
    gmax = max(m.gamma for m in members)
    rows, held = read_rows(first.data), read_rows(first.heldout)
    step, reports = members[0].step, {}
    bar = tqdm(total=first.max_steps, initial=step, desc="drafters " + "+".join(c.kind for c in cfgs))
    last_save = time.time()
    while step < first.max_steps:
        batch = batch_at(rows, first, gmax, step, 0, pad)
        tapped, t_logits = target_pass(target, batch, layers)
        losses = {}
        for m in members:
            row = member_step(m, batch, tapped, t_logits, layers)
            losses[m.cfg.kind] = row["loss"]
            if m.step % first.eval_every == 0 or m.step == first.max_steps:
                row["heldout"] = reports[m.cfg.run_dir] = evaluate(m.drafter, target, held, m.cfg, m.gamma, pad)
                bar.write(f"{m.cfg.kind} step {m.step} held-out acceptance {row['heldout']['acceptance']}")
            append_log(m.cfg.run_dir, row)
        step += 1
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in losses.items()})
        if time.time() - last_save > first.checkpoint_minutes * 60 or step == first.max_steps:
            for m in members:
                save(m)
            last_save = time.time()
    bar.close()
    for m in members:
        if m.cfg.export_dir:
            save_drafter(m.drafter, m.dcfg, Path(m.cfg.export_dir).expanduser())  # type: ignore[arg-type]
    return reports
