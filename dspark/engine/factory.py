"""Build an engine from names: model, drafter, policy (what `LLM(...)` and the CLI call).

    build_engine("dspark-tiny", drafter="dspark", policy="dspark", gamma=7)

On the embedded model the defaults are the shipped `dspark` drafter and the `dspark`
policy, and a policy named without a drafter uses the shipped one; elsewhere plain
decoding unless a drafter is named. Policies that weigh costs
(dspark, dspark-async) load the step profile from the on-disk cache or measure it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.config import EngineConfig
from dspark.drafters.neural import NeuralDrafter
from dspark.drafters.registry import load_drafter
from dspark.drafters.vocab import top_ids
from dspark.engine.engine import LLMEngine
from dspark.models.loader import BUILTIN_MODELS, load_model, resolve_model_path
from dspark.models.qwen3 import CausalLM
from dspark.models.tokenizer import TextTokenizer
from dspark.spec import measure
from dspark.spec.profile import load_cached, profile_key, save_cached
from dspark.spec.round import GateConfig


def default_spec(model: str | Path | None) -> tuple[str | None, str]:
    """(drafter, policy) used when the caller names neither."""
    path = resolve_model_path(model)
    shipped = path.parent / "drafters" / "dspark" / "config.json"
    if path in BUILTIN_MODELS.values() and shipped.is_file():
        return "dspark", "dspark"
    return None, "none"


def build_engine(model: str | Path | None = None, drafter: str | None = None, policy: str | None = None,
                 cfg: EngineConfig | None = None, gamma: int | None = None, profile: str = "auto",
                 gate: GateConfig | None = None, loaded: tuple[CausalLM, TextTokenizer] | None = None,
                 draft_vocab: int = 0) -> LLMEngine:
    """profile: 'auto' (cached or measured), 'refresh' (always measure), 'off' (no costs).
    draft_vocab: draft from the N most frequent tokens of the model's `token_counts.json`
    (0: the whole vocabulary; `dspark/drafters/vocab.py`).
    loaded: the target and tokenizer already loaded from this model by `load_model` on cfg's
    device and dtype, to share one copy of the weights between engines (a benchmark that runs
    several configurations side by side, as one deployment serves one model)."""
    cfg = cfg or EngineConfig()
    path = resolve_model_path(model)
    default_drafter, default_policy = default_spec(path)
    if drafter is None and policy is None:
        drafter, policy = default_drafter, default_policy
    if drafter is None and policy not in (None, "none"):
        drafter = default_drafter  # e.g. `--policy static:7` on dspark-tiny uses its shipped drafter
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
    if draft_vocab and d is None:
        raise ValueError("--draft-vocab needs a drafter")
    if draft_vocab and not isinstance(d, NeuralDrafter):
        raise ValueError(f"the {d.config.kind} drafter has no LM head to restrict (--draft-vocab)")
    ids = top_ids(path, draft_vocab) if draft_vocab else None
    engine = LLMEngine(net, tok, cfg, drafter=d, policy=policy, gate=gate)
    if ids is not None:
        d.restrict_vocab(ids)  # type: ignore[union-attr]
    if d is not None and engine.policy.needs_cost and profile != "off":
        name = f"{drafter}:{d.config.gamma}" + (f":vocab{draft_vocab}" if draft_vocab else "")
        key = profile_key(str(path), name, cfg.device, cfg.dtype, d.config.gamma,
                          cfg.max_num_batched_tokens, cfg.max_num_seqs)
        prof = None if profile == "refresh" else load_cached(key)
        if prof is None:
            prof = measure.measure(engine, key)
            save_cached(prof)
        engine.runner.set_profile(prof)  # type: ignore[union-attr]
    return engine
