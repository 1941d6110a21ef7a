"""Published drafter checkpoint formats, detected from config.json (`--drafter DIR`).

| format | detected by | in | out |
|---|---|---|---|
| DeepSpec DSpark (`deepspec`) | `architectures: ["Qwen3DSparkModel"]` | yes | yes |
| speculators `dspark` / `dflash` / `eagle3` (`speculators`) | `speculators_model_type` | yes | dspark, eagle3 |
| z-lab DFlash (`dflash`) | `dflash_config` | yes | no |
| original / SpecForge EAGLE-3 (`eagle`) | `midlayer.*` weights, `draft_vocab_size` | yes | no |

A directory in none of these is dspark's own format (`DrafterConfig` as config.json).
`dspark export-drafter` writes the `out` formats.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark.config import ModelConfig
from dspark.drafters.formats import deepspec, dflash, eagle, speculators
from dspark.drafters.formats.common import load_weights, read_json, read_weights

FORMATS = {"deepspec": deepspec, "speculators": speculators, "dflash": dflash, "eagle": eagle}


def detect(path: Path, raw: dict[str, Any] | None = None) -> str:
    """The format name of a drafter directory ('dspark' for dspark's own)."""
    raw = read_json(path) if raw is None else raw
    for name, module in FORMATS.items():
        if module.detect(raw):
            return name
    if eagle.detect_dir(path, raw):
        return "eagle"
    return "dspark"


def load(path: Path, target: ModelConfig | None = None):
    """A published checkpoint as a dspark drafter, or None when the directory is dspark's own format.
    target: the target's config, to refuse a mismatched pair with the config key that does not fit."""
    from dspark.drafters.registry import new_drafter

    raw = read_json(path)
    name = detect(path, raw)
    if name == "dspark":
        return None
    cfg, state = FORMATS[name].read(path, raw, target, read_weights(path))
    drafter = new_drafter(cfg)
    load_weights(drafter, state, path)
    return drafter
