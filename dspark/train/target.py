"""`dspark train target --config FILE`: train the dspark-tiny target from scratch.

AdamW with warm-up and cosine decay on windows of the three-domain corpus; a progress bar
with loss and tokens/s; a checkpoint every few minutes; exact resume after a kill (run
the same command again). At the end the model is exported in Hugging Face format.

Optionally (`unlikelihood > 0`) the loss adds token-level unlikelihood (Welleck et al. 2019,
"Neural text generation with unlikelihood training"): at every position, the probability of
each token seen in the last `unlikelihood_window` context tokens (other than the true next
token) is pushed down by -log(1 - p). It targets the greedy repetition loops that small models
fall into, which more steps of plain cross-entropy made worse here (docs/models/dspark-tiny.md).

    dspark train target --config configs/target-tiny.toml
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F
from tqdm import tqdm

from dspark.config import ModelConfig
from dspark.models.decoder import CausalLM
from dspark.models.loader import save_model
from dspark.train.checkpoint import append_log, config_from_toml, cosine_lr, load_checkpoint, save_checkpoint
from dspark.train.tokens import WindowSampler, heldout_windows, load_streams


@dataclass(frozen=True)
class TargetTrainConfig:
    tokens_dir: str = "~/.cache/dspark/tokens"
    tokenizer_dir: str = "~/.cache/dspark/tokenizer"
    run_dir: str = "~/.cache/dspark/runs/target"
    export_dir: str = ""  # where the finished model is written (HF format)
    init_from: str = ""  # start from a model directory or a run's checkpoint.pt (a further stage), fresh optimizer
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    seq_len: int = 1024
    batch_size: int = 4
    max_steps: int = 2800
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 150
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    domain_weights: tuple[float, ...] = (0.35, 0.35, 0.30)  # math, code, chat
    seed: int = 0
    checkpoint_minutes: float = 4.0
    eval_every: int = 200
    eval_windows: int = 8
    compile: bool = True
    threads: int = 0  # 0: torch's default
    unlikelihood: float = 0.0  # weight of the token-level unlikelihood term (0: plain cross-entropy)
    unlikelihood_window: int = 64  # candidates: the tokens of this many preceding context positions

    @classmethod
    def from_file(cls, path: str | Path) -> TargetTrainConfig:
        return config_from_toml(cls, path)

    def model_config(self, vocab_size: int, eos: tuple[int, ...], bos: int | None) -> ModelConfig:
        return ModelConfig(
            model_type="qwen3", vocab_size=vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta, tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos,
        )


def next_token_logits(net: CausalLM, batch: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] for the next token at every position of batch[:, :-1] (batch is [B, T+1])."""
    hidden, _ = net.forward_dense(batch[:, :-1])
    return net.logits(hidden, normed=True)


def lm_loss(net: CausalLM, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of batch [B, T+1]."""
    logits = next_token_logits(net, batch)
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def repeat_candidates(inputs: torch.Tensor, targets: torch.Tensor, vocab: int, window: int) -> torch.Tensor:
    """[B, T, V] bool: token v is a candidate at position i when it occurs among inputs[i-window+1 .. i]
    (the context just before target i) and is not targets[i]."""
    pad = inputs[:, :1].expand(-1, window - 1)  # the first token stands in before the start (it is context anyway)
    recent = torch.cat([pad, inputs], dim=1).unfold(1, window, 1)  # [B, T, window]
    mask = torch.zeros(*inputs.shape, vocab, dtype=torch.bool, device=inputs.device)
    mask.scatter_(2, recent, True)
    mask.scatter_(2, targets[..., None], False)
    return mask


def unlikelihood_loss(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over positions of -sum over candidates of log(1 - p(candidate))."""
    p = logits.float().softmax(-1)
    penalty = -torch.log1p(-p.clamp(max=1 - 1e-6)) * mask
    return penalty.sum() / (logits.shape[0] * logits.shape[1])


def lm_ul_loss(net: CausalLM, batch: torch.Tensor, weight: float, window: int) -> torch.Tensor:
    """Cross-entropy plus `weight` x token-level unlikelihood of recently seen tokens."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = next_token_logits(net, batch)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return ce + weight * unlikelihood_loss(logits, repeat_candidates(inputs, targets, logits.shape[-1], window))


@torch.no_grad()
def heldout_loss(net: CausalLM, streams, cfg: TargetTrainConfig) -> dict[str, float]:
    net.eval()
    out = {d: float(lm_loss(net, heldout_windows(s, cfg.seq_len, cfg.eval_windows))) for d, s in streams.items()}
    net.train()
    return out


def build(cfg: TargetTrainConfig):
    from dspark.models.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(Path(cfg.tokenizer_dir).expanduser())
    eos = tuple(i for i in (tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")) if i is not None)
    torch.manual_seed(cfg.seed)
    net = CausalLM(cfg.model_config(tok.vocab_size, eos, None))
    for name, p in net.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02 / (2 * cfg.num_hidden_layers) ** 0.5 if "o_proj" in name or "down_proj" in name else 0.02)
    decay = [p for p in net.parameters() if p.dim() == 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    return net, opt, tok


def train(cfg: TargetTrainConfig) -> CausalLM:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    net, opt, tok = build(cfg)
    state = load_checkpoint(cfg.run_dir)
    step = 0
    if state is None and cfg.init_from:
        net.load_state_dict(deepen(initial_weights(cfg.init_from), net))
    if state is not None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    train_streams, held_streams = load_streams(cfg.tokens_dir, "train"), load_streams(cfg.tokens_dir, "heldout")
    sampler = WindowSampler(cfg.seq_len, cfg.batch_size, cfg.domain_weights, cfg.seed)
    loss_fn = lm_loss
    if cfg.unlikelihood > 0:
        loss_fn = functools.partial(lm_ul_loss, weight=cfg.unlikelihood, window=cfg.unlikelihood_window)
    loss_fn = torch.compile(loss_fn) if cfg.compile else loss_fn
    net.train()
    last_save, t0, tokens = time.time(), time.time(), 0
    bar = tqdm(total=cfg.max_steps, initial=step, desc="target", dynamic_ncols=True)

    def checkpoint() -> None:
        save_checkpoint(cfg.run_dir, {"model": net.state_dict(), "optimizer": opt.state_dict(),
                                      "step": step, "config": dataclasses.asdict(cfg)})

    while step < cfg.max_steps:
        lr = cosine_lr(step, cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = loss_fn(net, sampler.batch(train_streams, step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += cfg.batch_size * cfg.seq_len
        tok_s = tokens / (time.time() - t0)
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tok_s:.0f}", lr=f"{lr:.2e}")
        row = {"step": step, "loss": loss.item(), "lr": lr, "tok_s": tok_s, "time": time.time()}
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            row["heldout"] = heldout_loss(net, held_streams, cfg)
            bar.write(f"step {step} held-out loss " + " ".join(f"{d}={v:.3f}" for d, v in row["heldout"].items()))
        append_log(cfg.run_dir, row)
        if time.time() - last_save > cfg.checkpoint_minutes * 60 or step == cfg.max_steps:
            checkpoint()
            last_save = time.time()
    bar.close()
    if cfg.export_dir:
        export(net, tok, cfg)
    return net


def initial_weights(source: str) -> dict[str, torch.Tensor]:
    """Weights to start a further training stage from: a checkpoint.pt or a model directory."""
    path = Path(source).expanduser()
    if path.suffix == ".pt":
        return torch.load(path, map_location="cpu", weights_only=False)["model"]
    from dspark.models.loader import load_target

    return load_target(path, "cpu", "float32").state_dict()


def deepen(source: dict[str, torch.Tensor], net: CausalLM) -> dict[str, torch.Tensor]:
    """Function-preserving depth up-scaling: a state dict for `net` (L layers) that computes what
    `source` (l <= L layers, L a multiple of l) computes. Source layer i becomes layer i*L/l; each
    layer inserted after it starts as a copy of it with its output projections (attention o_proj,
    MLP down_proj) at zero, so it adds nothing to the residual stream until training moves it.
    Returns `source` unchanged when the depths already match."""
    old = 1 + max((int(k.split(".")[2]) for k in source if k.startswith("model.layers.")), default=-1)
    new = net.config.num_hidden_layers
    if old == new:
        return source
    if old == 0 or new % old:
        raise ValueError(f"can deepen a {old}-layer model to a multiple of {old} layers, not {new}")
    out = {k: v for k, v in source.items() if not k.startswith("model.layers.")}
    factor = new // old
    for k, v in source.items():
        if not k.startswith("model.layers."):
            continue
        i, rest = int(k.split(".")[2]), k.split(".", 3)[3]
        for j in range(factor):
            zero = j > 0 and rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
            out[f"model.layers.{i * factor + j}.{rest}"] = torch.zeros_like(v) if zero else v.clone()
    return out


def export(net: CausalLM, tok, cfg: TargetTrainConfig) -> None:
    """Write the finished model + tokenizer as a Hugging Face directory."""
    import shutil

    out = Path(cfg.export_dir).expanduser()
    save_model(net, out, dtype="bfloat16", generation={"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20})
    src = Path(cfg.tokenizer_dir).expanduser()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
