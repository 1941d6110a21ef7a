"""Typed, frozen configuration for every part of dspark.

`ModelConfig` mirrors the fields of a Hugging Face `config.json` for the Qwen3 and Llama
decoder families (read with `ModelConfig.from_hf`, written with `to_hf`). `EngineConfig`
says how the engine batches and caches. Device and dtype are configuration, never forks
of the code: the same model runs in float32 or bfloat16, on CPU or CUDA.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a dtype name ("float32", "bf16", ...) to a torch dtype, with a clear error."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512-BF16 or AMX)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def default_dtype(device: str) -> str:
    """$DSPARK_DTYPE when set; else bfloat16 on CUDA and on CPUs with native bfloat16, float32
    on other CPUs. With native bfloat16 a matrix product of 8 rows costs about what one row
    does (float32 pays about 1.3x from the second row on), so verifying a draft block is nearly
    free. On dspark-small (2-core AVX512-BF16 CPU) bfloat16 served faster than float32 in 16 of
    20 configuration x load cells of one A/B run, plain decoding included (`docs/results/online/dtype/`)."""
    if os.environ.get("DSPARK_DTYPE"):
        return os.environ["DSPARK_DTYPE"]
    if device.startswith("cuda") or native_bf16_cpu():
        return "bfloat16"
    return "float32"


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only target (Qwen3 or Llama family)."""

    model_type: str = "qwen3"
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.model_type!r}; dspark runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises queries and keys per head before RoPE; Llama does not."""
        return self.model_type == "qwen3"

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def num_parameters(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (2 * self.head_dim if self.qk_norm else 0)
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_hidden_layers * layer + d + head

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict; unknown keys are ignored."""
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = raw.get("architectures") or []
            raise ValueError(
                f"unsupported architecture model_type={model_type!r} architectures={archs}; "
                f"dspark runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported by dspark")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        theta, scaling = _rope(raw)
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )

    def to_hf(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """The Hugging Face config.json dict for this architecture."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling_dict or {})}
        out: dict[str, Any] = {
            "architectures": [SUPPORTED_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": torch_dtype,
            "use_cache": True,
        }
        if self.model_type == "llama":
            out["mlp_bias"] = False
        return out


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the legacy keys or transformers v5 `rope_parameters`."""
    params = dict(raw.get("rope_parameters") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


PAD_ROWS = 48  # default of `EngineConfig.pad_rows` (why this many: `models/attention.py`, `_buckets`)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches, caches and where it runs.

    `kv_cache_bytes` sizes the paged KV pool (a memory budget, as vLLM's
    gpu_memory_utilization does); `num_kv_blocks`, when set, overrides it (tests use tiny
    pools to force preemption).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_bytes: int = 256 * 1024 * 1024
    num_kv_blocks: int | None = None
    device: str = field(default_factory=default_device)
    dtype: str = ""
    seed: int = 0
    pad_rows: int = PAD_ROWS  # a forward's one-token rows share its verify rows' attention grid while that pads them by at
    # most this many query rows (`models/attention.py`); 0: only where no padding is needed

    def __post_init__(self) -> None:
        if not self.dtype:
            object.__setattr__(self, "dtype", default_dtype(self.device))
        resolve_dtype(self.dtype)
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be positive")
        if self.pad_rows < 0:
            raise ValueError("pad_rows must be >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)
