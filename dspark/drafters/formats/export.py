"""`dspark export-drafter`: a dspark DSpark drafter in the formats other servers read.

    dspark export-drafter --drafter dspark|DIR [--model M] --format deepspec|speculators --out DIR

`deepspec` writes DeepSpec's `Qwen3DSparkModel` checkpoint (with copies of the target's
embedding and LM head, as DeepSpec stores them); `speculators` writes vLLM speculators' `dspark`
checkpoint (`vllm serve TARGET --speculative-config '{"model": "DIR", ...}'`), whose verifier is
named by `--verifier` (default: the model directory). STS temperatures travel as
`sts_temperatures` / `sts_greedy` (keys the reference code ignores and dspark reads back).
"""

from __future__ import annotations

from pathlib import Path

from dspark.drafters.formats import deepspec, speculators

WRITERS = {"deepspec": deepspec.write, "speculators": speculators.write}


def export(drafter_name: str, model: str | None, fmt: str, out_dir: str, verifier: str | None = None) -> Path:
    from dspark.drafters.registry import load_one
    from dspark.models.loader import load_target, resolve_model_path

    if fmt not in WRITERS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {sorted(WRITERS)}")
    path = resolve_model_path(model)
    target = load_target(path)
    drafter = load_one(drafter_name, path, target.config)
    drafter.bind(target, num_blocks=1, block_size=16)  # checks the pair; the export reads weights only
    out = WRITERS[fmt](drafter, target, Path(out_dir))
    if fmt == "speculators":
        speculators.verifier(out, verifier or str(path.resolve()))
    return out
