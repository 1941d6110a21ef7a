"""Run directories with atomic checkpoints, so a killed training run resumes exactly.

A checkpoint holds the model, the optimizer, the step and the run's config; the data
order is a pure function of (seed, step) (see tokens.WindowSampler), so resuming from
step s replays exactly the batches the killed run would have seen.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(run_dir: str | Path, state: dict[str, Any]) -> Path:
    """Write `run_dir/checkpoint.pt` atomically (temp file + rename)."""
    run = Path(run_dir).expanduser()
    run.mkdir(parents=True, exist_ok=True)
    tmp = run / "checkpoint.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, run / "checkpoint.pt")
    return run / "checkpoint.pt"


def load_checkpoint(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir).expanduser() / "checkpoint.pt"
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


def append_log(run_dir: str | Path, row: dict[str, Any]) -> None:
    run = Path(run_dir).expanduser()
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "log.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def config_from_toml(cls: type, path: str | Path, **overrides: Any) -> Any:
    """A frozen config dataclass from a TOML file (unknown keys refused, lists -> tuples);
    overrides that are not None win over the file."""
    import dataclasses
    import tomllib

    raw = tomllib.loads(Path(path).read_text())
    raw.update({k: v for k, v in overrides.items() if v is not None})
    unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"unknown keys in {path}: {sorted(unknown)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def cosine_lr(step: int, base_lr: float, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warm-up to base_lr, then cosine decay to floor * base_lr at `total`."""
    import math

    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
