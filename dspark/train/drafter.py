"""`dspark train drafter --kind dspark|dflash|eagle3|mtp --config FILE`.

Target frozen, its features computed online (one no-grad target pass per batch, taps
and the target's logits at the block positions); random anchors per sequence, packed;
the losses of `train/losses.py`; AdamW + cosine; a checkpoint every few minutes and exact
resume after a kill (data order is a function of seed, step and rank); held-out
per-position teacher-forced acceptance 1 - ||p_d - p_t||_1 / 2 in the progress log.
Runs under `torchrun --nproc-per-node N` with DDP (gloo with `device = "cpu"`, nccl with
`device = "cuda"`: one GPU per process, cuda:LOCAL_RANK); rank 0 writes checkpoints, and a
run resumes from them with any process count. `write_checksums = true` makes every rank write
`run_dir/rank{r}.sum` (sha256 of its final weights) to check that replicas stayed identical.

    dspark train drafter --kind dspark --config configs/drafter-dspark.toml
    torchrun --nproc-per-node 2 -m dspark train drafter --kind dspark --config FILE
    (docs/scaling.md: several GPUs and nodes)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dspark.drafters.base import save_drafter
from dspark.drafters.registry import new_config, new_drafter
from dspark.train.anchors import BlockBatch, make_batch
from dspark.train.checkpoint import append_log, config_from_toml, cosine_lr, load_checkpoint, save_checkpoint
from dspark.train.losses import LossWeights, acceptance, drafter_loss
from dspark.train.surgery import (
    grow,
    reheaded,
    with_anchor_mlp,
    with_context_residual,
    with_exit,
    with_slot_mlp,
)


@dataclass(frozen=True)
class DrafterTrainConfig:
    kind: str = "dspark"
    model: str = "dspark-tiny"
    data: str = "~/.cache/dspark/regen/train.jsonl"
    heldout: str = "~/.cache/dspark/regen/heldout.jsonl"
    run_dir: str = "~/.cache/dspark/runs/drafter-dspark"
    export_dir: str = ""
    gamma: int = 0  # 0: the kind's default (7; MTP 1)
    num_layers: int = 0  # 0: the kind's default (2; EAGLE-3/MTP 1)
    head: str = ""  # dspark: markov | gated | rnn | mlp
    taps: tuple[int, ...] = ()  # target layers the drafter reads (empty: the kind's default)
    context_residual: bool = False  # dspark/dflash: the feature before the anchor into every slot's residual
    causal_block: bool = False  # dspark/dflash: block slots see only the slots before them (any depth is exact)
    anchor_mlp: int = 0  # dspark: width of an MLP only the anchor slot runs (0: none; `DrafterConfig.anchor_mlp`)
    slot_mlp: int = 0  # dspark: width of an MLP each block slot runs after every backbone layer (`DrafterConfig.slot_mlp`)
    exit_mlp: int = 0  # dspark with init_from: grow an early exit, a layer of its own whose MLP is this wide (0: none;
    #                    `DrafterConfig.exit_mlp`) ...
    exit_layer: int = 0  # ... run after this many backbone layers (0: on the block's input)
    exit_only: bool = False  # train the exit alone, every other weight frozen (the full block unchanged); the loss
    #                          and the held-out report are the exit's one position
    rank: int = 0  # the sequential head's rank (0: 64 for a new drafter, init_from's own otherwise)
    conf_stop_grad: bool = False
    init_from: str = ""  # a drafter directory to continue from (its architecture, fresh optimizer, no STS)
    seq_len: int = 512
    batch_size: int = 8
    anchors_per_seq: int = 16
    walked: float = 0.0  # share of each answer's anchors drawn from its greedy walk's round starts (`dspark train walk`)
    fed: float = 0.0  # dspark/dflash with a causal block: share of blocks whose slots read the text's tokens instead
    #                   of masks (slot k then predicts x_{k+1} from x_0..x_k), what a refining pass sees
    #                   (`DrafterConfig.refine`)
    max_steps: int = 2000
    lr: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    loss_ce: float = 0.1
    loss_tv: float = 0.9
    loss_conf: float = 1.0
    loss_soft_ce: float = 0.0  # dspark: weight of soft CE against the target (0: the paper's loss)
    loss_first: float = 1.0  # the first block position's weight, a multiple of the kind's schedule (`position_weights`)
    grown_lr: float = 0.0  # with init_from: the peak lr of the weights the config's surgery added (a new head's, an
    #                        exit's, ...; same schedule), where a small lr for the trained ones barely moves them (0: lr)
    seed: int = 0
    eval_every: int = 200
    eval_batches: int = 4
    checkpoint_minutes: float = 4.0
    device: str = "cpu"  # cpu | cuda (each torchrun process takes cuda:LOCAL_RANK)
    write_checksums: bool = False  # every rank writes run_dir/rank{r}.sum at the end

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> DrafterTrainConfig:
        return config_from_toml(cls, path, **overrides)

    def __post_init__(self) -> None:
        if self.exit_only and not (self.exit_mlp and self.init_from):
            raise ValueError("exit_only trains an exit grown onto a trained drafter: it needs exit_mlp and init_from")

    def loss_weights(self) -> LossWeights:
        return LossWeights(self.loss_ce, self.loss_tv, self.loss_conf, self.loss_soft_ce, self.loss_first)


def read_rows(path: str) -> list[dict]:
    with open(Path(path).expanduser()) as f:
        return [r for r in map(json.loads, f) if len(r["response_ids"]) >= 2]


def rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def train_device(cfg: DrafterTrainConfig) -> torch.device:
    if cfg.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(cfg.device)


def load_frozen_target(cfg: DrafterTrainConfig):
    from dspark.models.loader import load_model

    target, tok = load_model(cfg.model, str(train_device(cfg)), "float32")
    for p in target.parameters():
        p.requires_grad_(False)
    return target, tok


def build(cfg: DrafterTrainConfig, loaded=None):
    """(target, tokenizer, drafter, drafter config); `loaded` = (target, tokenizer) already loaded."""
    target, tok = loaded if loaded is not None else load_frozen_target(cfg)
    torch.manual_seed(cfg.seed)
    if cfg.init_from:
        drafter = initial_drafter(cfg, target.config)
        dcfg = drafter.config
    else:
        extra = {k: v for k, v in {"gamma": cfg.gamma, "num_layers": cfg.num_layers, "head": cfg.head,
                                   "taps": tuple(cfg.taps), "context_residual": cfg.context_residual,
                                   "causal_block": cfg.causal_block, "anchor_mlp": cfg.anchor_mlp,
                                   "slot_mlp": cfg.slot_mlp}.items() if v}
        if cfg.kind == "dspark":
            extra["rank"] = cfg.rank or 64
        dcfg = new_config(cfg.kind, target.config, tok.token_id("<|mask|>") or 0, **extra)
        drafter = new_drafter(dcfg)
    drafter = drafter.to(train_device(cfg))
    drafter._target = [target]  # type: ignore[attr-defined]
    return target, tok, drafter, dcfg


def block_targets(target, batch: BlockBatch, taps_layers) -> tuple[torch.Tensor, torch.Tensor]:
    """Online target features: taps [B, T, m*d] and target logits at the block positions
    [B, A, g, V] (the target's distribution of each label given its prefix)."""
    with torch.no_grad():
        hidden, taps = target.forward_dense(batch.tokens, taps_layers)
        g = batch.labels.shape[-1]
        pos = (batch.anchors[..., None] + torch.arange(g, device=batch.anchors.device)).clamp(max=batch.tokens.shape[1] - 1)  # p+k-1
        h = hidden.gather(1, pos.flatten(1)[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = target.logits(h, normed=True).view(*pos.shape, -1)
    return taps, logits


def batch_at(rows: list[dict], cfg: DrafterTrainConfig, gamma: int, step: int, rank: int, pad: int) -> BlockBatch:
    rng = np.random.default_rng([cfg.seed, step, rank])
    pick = rng.choice(len(rows), size=cfg.batch_size, replace=len(rows) < cfg.batch_size)
    batch = make_batch([rows[i] for i in pick], cfg.seq_len, gamma, cfg.anchors_per_seq, rng, pad, cfg.walked)
    if cfg.fed:
        batch = dataclasses.replace(batch, fed=torch.from_numpy(rng.random(batch.anchors.shape) < cfg.fed))
    return on_device(batch, cfg)


def on_device(batch: BlockBatch, cfg: DrafterTrainConfig) -> BlockBatch:
    """The batch's tensors on the training device."""
    dev = train_device(cfg)
    return dataclasses.replace(batch, tokens=batch.tokens.to(dev), anchors=batch.anchors.to(dev),
                               labels=batch.labels.to(dev), valid=batch.valid.to(dev),
                               fed=None if batch.fed is None else batch.fed.to(dev))


def forward_on(forward, taps: torch.Tensor, batch: BlockBatch, cfg: DrafterTrainConfig):
    """The drafter's teacher-forced (logits, confidence logits) on a batch; only a batch with fed blocks (a block
    drafter's) passes `fed`."""
    extra = {} if batch.fed is None else {"fed": batch.fed}
    return forward(taps, batch.tokens, batch.anchors, conf_stop_grad=cfg.conf_stop_grad, **extra)


def trained_forward(model, exits: bool):
    """What the loss and the held-out report read: the drafter (or its DDP wrapper) called for the exit's forward
    (exits: `exit_only`) or the whole block's."""
    return functools.partial(model, exits=True) if exits else model


def trainable(drafter, cfg: DrafterTrainConfig) -> list[torch.nn.Parameter]:
    """The parameters a run moves: the exit's alone under `exit_only` (every other one frozen), else all."""
    if cfg.exit_only:
        keep = {id(p) for p in drafter.exit.parameters()}
        for p in drafter.parameters():
            p.requires_grad_(id(p) in keep)
    return [p for p in drafter.parameters() if p.requires_grad]


def positions_loss(cfg: DrafterTrainConfig, logits, conf, t_logits, batch: BlockBatch):
    """The kind's loss over the positions the forward drafted (the first of each block for an exit)."""
    g = logits.shape[-2]
    return drafter_loss(cfg.kind, logits, conf, t_logits[..., :g, :], batch.labels[..., :g], batch.valid[..., :g],
                        cfg.loss_weights())


@torch.no_grad()
def evaluate(drafter, target, rows, cfg: DrafterTrainConfig, gamma: int, pad: int, exits: bool | None = None) -> dict:
    """Held-out per-position teacher-forced acceptance and confidence error.

    `acceptance` is the chance that speculative sampling at temperature 1 accepts position k;
    `greedy_acceptance` the share of blocks whose draft argmax matches the target's argmax at
    position k, among those matching at every earlier position (what greedy verification accepts;
    exact on greedy answers, `dspark train regen --temperature 0`, where the text is the target's
    argmax at every position). exits: measure the early exit's one position (default: `cfg.exit_only`)."""
    exits = cfg.exit_only if exits is None else exits
    drafted = 1 if exits else gamma  # positions the forward drafts
    acc_sum, count, conf_err, hits, tried, fed_hits, fed_tried = torch.zeros(7, drafted, device=train_device(cfg))
    refines = drafter.config.refinable and not exits
    drafter.eval()
    for i in range(cfg.eval_batches):
        batch = dataclasses.replace(batch_at(rows, cfg, gamma, 10**9 + i, 0, pad), fed=None)
        taps, t_logits = block_targets(target, batch, drafter.taps)
        logits, conf = forward_on(trained_forward(drafter, exits), taps, batch, cfg)
        t_logits = t_logits[..., :drafted, :]
        acc = acceptance(logits.softmax(-1), t_logits.softmax(-1))  # [B, A, g]
        v = batch.valid[..., :drafted].float()
        acc_sum += (acc * v).sum((0, 1))
        count += v.sum((0, 1))
        matched, reached = argmax_chain(logits, t_logits, v)
        hits += matched
        tried += reached
        if refines:
            fed = dataclasses.replace(batch, fed=torch.ones_like(batch.anchors, dtype=torch.bool))
            fed_logits, _ = forward_on(drafter.train_forward, taps, fed, cfg)
            matched, reached = chain_counts(refined_survival(logits, fed_logits, t_logits), v)
            fed_hits += matched
            fed_tried += reached
        if conf is not None:
            conf_err += ((torch.sigmoid(conf) - acc).abs() * v).sum((0, 1))
    drafter.train()
    per_pos = (acc_sum / count.clamp_min(1)).tolist()
    greedy = (hits / tried.clamp_min(1)).tolist()
    out = {"acceptance": [round(x, 4) for x in per_pos], "expected_tau": expected_tau(per_pos),
           "greedy_acceptance": [round(x, 4) for x in greedy], "greedy_tau": expected_tau(greedy)}
    if refines:  # a second pass reading the first one's draft (`DrafterConfig.refine`), on the same blocks
        refined = (fed_hits / fed_tried.clamp_min(1)).tolist()
        out |= {"refined_acceptance": [round(x, 4) for x in refined], "refined_tau": expected_tau(refined)}
    if drafter.has_confidence:
        out["conf_mae"] = [round(x, 4) for x in (conf_err / count.clamp_min(1)).tolist()]
    return out


def argmax_chain(d_logits: torch.Tensor, t_logits: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., g, V] draft and target logits, [..., g] valid -> per position [g]: the valid blocks whose
    draft argmax equals the target's there and at every earlier position, and those matching at every
    earlier one (what greedy verification accepts, and what it reaches)."""
    return chain_counts(torch.cumprod((d_logits.argmax(-1) == t_logits.argmax(-1)).float(), -1), valid)


def refined_survival(mask_logits: torch.Tensor, fed_logits: torch.Tensor, t_logits: torch.Tensor) -> torch.Tensor:
    """[..., g] 1.0 where greedy verification accepts position k of a refined draft: the second pass's x_k
    (read from the first pass's draft before it) matches the target there and at every earlier position, and
    the first pass's draft matched at every earlier one (the refined draft ends after its first token that
    differs from the first pass's; before it, the second pass read the text itself, which fed blocks emulate)."""
    target = t_logits.argmax(-1)
    first = torch.cumprod((mask_logits.argmax(-1) == target).float(), -1)
    second = torch.cumprod((fed_logits.argmax(-1) == target).float(), -1)
    return second * torch.cat([torch.ones_like(first[..., :1]), first[..., :-1]], -1)


def chain_counts(survived: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """survived [..., g] (a block's first k drafts all accepted), valid [..., g] -> per position [g]: the
    valid blocks accepted through k and those that reach k."""
    reached = torch.cat([torch.ones_like(survived[..., :1]), survived[..., :-1]], -1)
    dims = tuple(range(survived.dim() - 1))
    return (survived * valid).sum(dims), (reached * valid).sum(dims)


def expected_tau(conditional: list[float]) -> float:
    """1 + sum_k prod_{i<=k} c_i: expected tokens per round with the full block verified."""
    tau, surv = 1.0, 1.0
    for c in conditional:
        surv *= c
        tau += surv
    return round(tau, 4)


def initial_drafter(cfg: DrafterTrainConfig, target_config):
    """The drafter at cfg.init_from, in float32, as the start of a further stage (e.g. after the
    target trained further). Its STS temperatures are dropped: calibrate the new weights again.
    `cfg.taps` moves it to other target layers (as many as it reads), e.g. onto a target grown
    deeper (`train.target.deepen`: tiny's layer i is the grown model's layer 4i + 3); `num_layers`,
    `context_residual`, `anchor_mlp`, `slot_mlp`, `head` and `rank` grow it into another shape (`train/surgery.py`)."""
    from dspark.drafters.registry import load_one

    drafter = load_one(cfg.init_from)
    dcfg, before = drafter.config, {k: v.shape for k, v in drafter.state_dict().items()}
    if dcfg.kind != cfg.kind:
        raise ValueError(f"init_from holds a {dcfg.kind!r} drafter, not {cfg.kind!r}")
    if dcfg.vocab_size != target_config.vocab_size or dcfg.hidden_size != target_config.hidden_size:
        raise ValueError("init_from drafter was built for a target of another size")
    if cfg.num_layers and cfg.num_layers != dcfg.num_layers:
        drafter = grow(drafter, cfg.num_layers)
    if cfg.taps and len(cfg.taps) != len(dcfg.taps):
        raise ValueError(f"taps: init_from reads {len(dcfg.taps)} target layers, the config names {len(cfg.taps)}")
    if cfg.context_residual and not dcfg.context_residual:
        drafter = with_context_residual(drafter)
    if cfg.causal_block and not dcfg.causal_block:  # the same weights, a narrower mask: fine-tune after
        drafter.config = drafter.config.replace(causal_block=True)
    if cfg.anchor_mlp and cfg.anchor_mlp != dcfg.anchor_mlp:
        drafter = with_anchor_mlp(drafter, cfg.anchor_mlp)
    if cfg.slot_mlp and cfg.slot_mlp != dcfg.slot_mlp:
        drafter = with_slot_mlp(drafter, cfg.slot_mlp)
    if cfg.exit_mlp and not dcfg.exit_mlp:
        drafter = with_exit(drafter, cfg.exit_layer, cfg.exit_mlp)
    head, rank = cfg.head or dcfg.head, cfg.rank or dcfg.rank
    if cfg.kind == "dspark" and (head, rank) != (dcfg.head, dcfg.rank):
        drafter = reheaded(drafter, head, rank)
    drafter.config = drafter.config.replace(sts_temperatures=(), sts_greedy=(), taps=tuple(cfg.taps) or dcfg.taps)
    drafter.grown = frozenset(k for k, v in drafter.state_dict().items() if before.get(k) != v.shape)
    return drafter.float()


def setup_distributed(device: torch.device) -> tuple[int, int]:
    """The backend follows where the weights live (nccl only for CUDA tensors), not whether
    the machine has a GPU: a CPU run on a GPU machine needs gloo."""
    rank, world = rank_world()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world


def load_state(run_dir: str, rank: int, world: int) -> dict | None:
    """Rank 0's checkpoint, sent to every rank: nodes need not share run_dir's disk, and no
    rank can resume at another step than rank 0 (the ranks would then wait on each other)."""
    state = load_checkpoint(run_dir) if rank == 0 else None
    if world > 1:
        box = [state]
        torch.distributed.broadcast_object_list(box, src=0)
        state = box[0]
    return state


def write_checksum(module: torch.nn.Module, run_dir: str, rank: int) -> None:
    """run_dir/rank{r}.sum: sha256 of every tensor of the state dict, in name order."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    path = Path(run_dir).expanduser() / f"rank{rank}.sum"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(h.hexdigest() + "\n")


def optimizer(params: list[torch.nn.Parameter], cfg: DrafterTrainConfig, drafter=None) -> torch.optim.Optimizer:
    """AdamW over params; with `grown_lr`, the drafter's grown weights (`initial_drafter`) in a group of their own whose
    `scale` multiplies the schedule's lr (`set_lr`)."""
    grown = getattr(drafter, "grown", frozenset()) if cfg.grown_lr else frozenset()
    ids = {id(p) for name, p in drafter.named_parameters() if name in grown} if grown else set()
    groups = [{"params": [p for p in params if id(p) not in ids], "scale": 1.0}]
    if ids:
        groups.append({"params": [p for p in params if id(p) in ids], "scale": cfg.grown_lr / cfg.lr})
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(0.9, 0.95),
                             weight_decay=cfg.weight_decay)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's lr for this step into every group, times the group's scale (grown weights, `grown_lr`)."""
    for group in opt.param_groups:
        group["lr"] = lr * group.get("scale", 1.0)


def checkpoint_state(drafter, opt, step: int, cfg: DrafterTrainConfig) -> dict:
    """What a drafter run's checkpoint holds (resume reads model, optimizer and step)."""
    return {"model": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "config": dataclasses.asdict(cfg)}


def train(cfg: DrafterTrainConfig) -> dict:
    rank, world = setup_distributed(train_device(cfg))
    target, tok, drafter, dcfg = build(cfg)
    pad = tok.pad_id
    params = trainable(drafter, cfg)
    opt = optimizer(params, cfg, drafter)
    state, step = load_state(cfg.run_dir, rank, world), 0
    if state is not None:
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    model = drafter
    if world > 1:
        dev = train_device(cfg)
        model = torch.nn.parallel.DistributedDataParallel(drafter, device_ids=[dev.index] if dev.type == "cuda" else None)
    rows, held = read_rows(cfg.data), read_rows(cfg.heldout)
    bar = tqdm(total=cfg.max_steps, initial=step, desc=f"drafter {cfg.kind}", disable=rank != 0)
    last_save, t0, start_step, report = time.time(), time.time(), step, {}

    def checkpoint() -> None:
        if rank == 0:
            save_checkpoint(cfg.run_dir, checkpoint_state(drafter, opt, step, cfg))

    while step < cfg.max_steps:
        lr = cosine_lr(step, cfg.lr, cfg.warmup_steps, cfg.max_steps)
        set_lr(opt, lr)
        batch = batch_at(rows, cfg, dcfg.gamma, step, rank, pad)
        taps, t_logits = block_targets(target, batch, dcfg.taps)
        logits, conf = forward_on(trained_forward(model, cfg.exit_only), taps, batch, cfg)
        loss, parts = positions_loss(cfg, logits, conf, t_logits, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", steps_s=f"{(step - start_step) / (time.time() - t0):.2f}")
        row = {"step": step, "loss": loss.item(), **parts, "lr": lr, "time": time.time()}
        if rank == 0 and (step % cfg.eval_every == 0 or step == cfg.max_steps):
            report = evaluate(drafter, target, held, cfg, dcfg.gamma, pad)
            row["heldout"] = report
            bar.write(f"step {step} held-out acceptance {report['acceptance']} tau~{report['expected_tau']}")
        if rank == 0:
            append_log(cfg.run_dir, row)
        if time.time() - last_save > cfg.checkpoint_minutes * 60 or step == cfg.max_steps:
            checkpoint()
            last_save = time.time()
    bar.close()
    if cfg.write_checksums:
        write_checksum(drafter, cfg.run_dir, rank)
    if rank == 0 and cfg.export_dir:
        save_drafter(drafter, dcfg, Path(cfg.export_dir).expanduser())
    if world > 1:
        torch.distributed.destroy_process_group()
    return report
