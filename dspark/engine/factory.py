"""Build an engine: from names (`build_engine`, what `LLM(...)` and the CLI call) or from
loaded parts (`assemble`: KV cache, runner, engine).

    build_engine("dspark-small", drafter="dspark", policy="dspark", gamma=7)
    assemble(model, tokenizer, EngineConfig(), drafter=d, policy="static:3")

On the embedded model the defaults are the shipped `dspark` drafter and the `dspark`
policy, and a policy named without a drafter uses the shipped one; elsewhere plain
decoding unless a drafter is named. Policies that weigh costs
(dspark, dspark-async) load the step profile from the on-disk cache or measure it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.config import EngineConfig
from dspark.drafters.base import Drafter
from dspark.drafters.neural import NeuralDrafter
from dspark.drafters.pair import PairedDrafter
from dspark.drafters.registry import load_drafter
from dspark.drafters.route import RoutedDrafter
from dspark.drafters.vocab import FILE as COUNTS_FILE
from dspark.drafters.vocab import top_ids
from dspark.engine import profiler
from dspark.engine.engine import LLMEngine
from dspark.engine.gate import GateConfig
from dspark.engine.runner import ModelRunner, Runner
from dspark.engine.speculative import SpeculativeRunner
from dspark.kv_cache import PagedKVCache
from dspark.models.decoder import CausalLM
from dspark.models.fused import fuse_projections
from dspark.models.loader import BUILTIN_MODELS, load_model, resolve_model_path
from dspark.models.tokenizer import TextTokenizer
from dspark.spec.policies import NoSpeculation, make_policy
from dspark.spec.profile import StepProfile


def default_spec(model: str | Path | None) -> tuple[str | None, str]:
    """(drafter, policy) used when the caller names neither."""
    path = resolve_model_path(model)
    shipped = path.parent / "drafters" / "dspark" / "config.json"
    if path in BUILTIN_MODELS.values() and shipped.is_file():
        return "dspark", "dspark"
    return None, "none"


def assemble(model: CausalLM, tokenizer: TextTokenizer, cfg: EngineConfig, drafter: Drafter | None = None,
             policy: str = "none", profile: StepProfile | None = None, gate: GateConfig | None = None) -> LLMEngine:
    """An engine over a fresh KV cache: speculative with a drafter and a policy other than
    `none` (the drafter is bound to the model here), plain otherwise."""
    if cfg.num_kv_blocks:
        kv = PagedKVCache(model.config, cfg.num_kv_blocks, cfg.block_size, model.device, model.dtype)
    else:
        kv = PagedKVCache.from_budget(model.config, cfg.kv_cache_bytes, cfg.block_size, model.device, model.dtype)
    chosen = make_policy(policy)
    fuse_projections(model)
    base = ModelRunner(model, kv, cfg.pad_rows)
    runner: Runner = base
    if drafter is not None and not isinstance(chosen, NoSpeculation):
        drafter.bind(model, kv.pool.num_blocks + cfg.max_num_seqs, cfg.block_size)
        runner = SpeculativeRunner(base, drafter, chosen, profile, gate)
    base.warm()  # after everything built: the first forward a request sees is never the process's first
    return LLMEngine(model, tokenizer, cfg, kv, runner)


VOCAB_DRAFTERS = (NeuralDrafter, PairedDrafter, RoutedDrafter)  # drafters with an LM head to restrict (`--draft-vocab`)


def default_vocab(d: Drafter | None, path: Path) -> int:
    """The draft vocabulary a drafter ships with (`serve_vocab`), where the model has the token counts
    that rank it; 0 (every token) otherwise."""
    if isinstance(d, VOCAB_DRAFTERS) and d.config.serve_vocab and (path / COUNTS_FILE).is_file():
        return d.config.serve_vocab
    return 0


def build_engine(model: str | Path | None = None, drafter: str | None = None, policy: str | None = None,
                 cfg: EngineConfig | None = None, gamma: int | None = None, profile: str = "auto",
                 gate: GateConfig | None = None, loaded: tuple[CausalLM, TextTokenizer] | None = None,
                 draft_vocab: int | None = None) -> LLMEngine:
    """profile: 'auto' (cached or measured), 'refresh' (always measure), 'off' (no costs).
    draft_vocab: draft from the N most frequent tokens of the model's `token_counts.json`
    (0: the whole vocabulary; None: the drafter's `serve_vocab` where the model has counts;
    `dspark/drafters/vocab.py`).
    loaded: the target and tokenizer already loaded from this model by `load_model` on cfg's
    device and dtype, to share one copy of the weights between engines (a benchmark that runs
    several configurations side by side, as one deployment serves one model)."""
    cfg = cfg or EngineConfig()
    path = resolve_model_path(model)
    default_drafter, default_policy = default_spec(path)
    if drafter is None and policy is None:
        drafter, policy = default_drafter, default_policy
    if drafter is None and policy not in (None, "none"):
        drafter = default_drafter  # e.g. `--policy static:7` on a built-in model uses its shipped drafter
    policy = policy or ("dspark" if drafter else "none")
    if policy != "none" and not drafter:
        raise ValueError(f"policy {policy!r} needs a drafter (--drafter dspark|dflash|eagle3|mtp|ngram|suffix|auto|PATH)")
    net, tok = loaded if loaded is not None else load_model(path, cfg.device, cfg.dtype)
    if net.device.type != torch.device(cfg.device).type or net.dtype != cfg.torch_dtype:
        raise ValueError(f"the loaded target is {net.device}/{net.dtype}, the engine config asks for "
                         f"{cfg.device}/{cfg.torch_dtype}")
    d = None
    if drafter and policy != "none":
        d = load_drafter(drafter, path, net.config, tok.token_id("<|mask|>") or 0)
        if gamma is not None:
            if not 1 <= gamma <= d.config.gamma:
                raise ValueError(f"gamma must be in 1..{d.config.gamma} for this drafter")
            d.config = d.config.replace(gamma=gamma)
    draft_vocab = default_vocab(d, path) if draft_vocab is None else draft_vocab
    if draft_vocab and d is None:
        raise ValueError("--draft-vocab needs a drafter")
    if draft_vocab and not isinstance(d, VOCAB_DRAFTERS):
        raise ValueError(f"the {d.config.kind} drafter has no LM head to restrict (--draft-vocab)")
    ids = top_ids(path, draft_vocab) if draft_vocab else None
    engine = assemble(net, tok, cfg, drafter=d, policy=policy, gate=gate)
    if ids is not None and isinstance(d, VOCAB_DRAFTERS):
        d.restrict_vocab(ids)
    runner = engine.runner
    if isinstance(runner, SpeculativeRunner) and engine.policy.needs_cost and profile != "off":
        refine = d.config.refine if d is not None else 0  # refining passes change what a proposal costs
        exits = d is not None and d.config.exit_mlp  # ... and so does an exit a one-position one
        name = f"{drafter}:{runner.gamma}" + (f":vocab{draft_vocab}" if draft_vocab else "") + \
            (f":refine{refine}" if refine else "") + (f":exit{d.config.exit_layer}-{d.config.exit_mlp}" if exits else "")
        rows = (gate or GateConfig()).rows  # row shapes are timed only for an engine that prices by them
        key = profiler.profile_key(str(path), name, cfg.device, cfg.dtype, runner.gamma,
                                   cfg.max_num_batched_tokens, cfg.max_num_seqs, rows, cfg.pad_rows)
        runner.set_profile(profiler.cached_or_measured(engine, runner, key, refresh=profile == "refresh", rows=rows))
    return engine
