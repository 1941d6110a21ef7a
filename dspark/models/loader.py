"""Load and save Hugging Face-format model directories, offline only.

A directory holds `config.json`, `model.safetensors` (or `model.safetensors.index.json`
with shards), `tokenizer.json`, `tokenizer_config.json` and `generation_config.json`.
`load_model` returns the target and its tokenizer; nothing is ever fetched from a hub.
The names `dspark-tiny` and `dspark-small` resolve to the models shipped inside the package.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dspark.config import ModelConfig, resolve_dtype
from dspark.models.decoder import CausalLM
from dspark.models.fused import owned
from dspark.models.tokenizer import TextTokenizer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUILTIN_MODELS = {"dspark-tiny": ASSETS / "dspark-tiny" / "target", "dspark-small": ASSETS / "dspark-small" / "target"}
DEFAULT_MODEL = "dspark-small"


def model_label(path: Path) -> str:
    """How reports name a model: its built-in name, else its directory's name."""
    names = {v: k for k, v in BUILTIN_MODELS.items()}
    return names.get(path, path.name)


def resolve_model_path(model: str | Path | None) -> Path:
    """A built-in name or a local directory -> the directory, with a clear error."""
    name = str(model) if model else DEFAULT_MODEL
    path = BUILTIN_MODELS.get(name, Path(name).expanduser())
    if name in BUILTIN_MODELS and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the built-in model {name!r} is not in this install: the wheel carries {DEFAULT_MODEL} and its dspark "
            "drafter only; the other built-ins come with a source checkout (git clone, then pip install -e .)"
        )
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {str(path)!r} not found; pass a local Hugging Face-format directory "
            f"or one of {sorted(BUILTIN_MODELS)} (dspark never downloads models)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; is it a Hugging Face-format model directory?")
    return path


def read_config(path: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(str(path / shard)))
        return state
    raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


def load_target(model: str | Path | None, device: str = "cpu", dtype: str | torch.dtype = "float32") -> CausalLM:
    path = resolve_model_path(model)
    cfg = read_config(path)
    state = read_state_dict(path)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    net = CausalLM(cfg)
    missing, unexpected = net.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match {cfg.model_type}: missing={missing[:5]} unexpected={unexpected[:5]}")
    return net.to(device=device, dtype=resolve_dtype(dtype)).eval()


def load_model(model: str | Path | None, device: str = "cpu", dtype: str | torch.dtype = "float32"):
    """-> (CausalLM, TextTokenizer) from a local directory or a built-in name."""
    path = resolve_model_path(model)
    return load_target(path, device, dtype), TextTokenizer.from_dir(path)


def save_model(net: CausalLM, out_dir: str | Path, dtype: str = "bfloat16",
               generation: dict[str, Any] | None = None) -> None:
    """Write config.json, model.safetensors and generation_config.json (tokenizer files apart)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = net.config
    (out / "config.json").write_text(json.dumps(cfg.to_hf(dtype), indent=2))
    state = {k: owned(v.detach().to(resolve_dtype(dtype))) for k, v in net.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, **(generation or {})}
    if isinstance(gen["eos_token_id"], tuple):
        gen["eos_token_id"] = list(gen["eos_token_id"])
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
