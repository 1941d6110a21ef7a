"""Where results go: JSON + markdown in an output directory, stamped with the machine, date,
versions and the exact command that produced them; `table` and `cell` write markdown tables
(one number format for every table the project writes)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

DEFAULT_OUT = "docs/results"


def cpu_info(text: str) -> dict[str, str]:
    """The first processor's fields of a /proc/cpuinfo text: its name, and where the name is as generic as
    'AMD EPYC', the family and model numbers that tell one generation from another (two machines here
    printed the same name and ran plain decoding 20-40% apart) and the vector extensions the kernels use."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:
                break  # the first processor's block ends at a blank line
            continue
        fields.setdefault(key.strip(), value.strip())
    flags = fields.get("flags", "").split()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    info = {"cpu": fields.get("model name", "")}
    if "cpu family" in fields and "model" in fields:
        info["cpu_id"] = f"family {fields['cpu family']}, model {fields['model']}"
    if isa:
        info["isa"] = " ".join(isa)
    return info


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            info.update({k: v for k, v in cpu_info(f.read()).items() if v})
    except OSError:
        pass
    info.update({"cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                 "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()})
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_line(m: dict[str, Any]) -> str:
    """'AMD EPYC (family 25, model 17; avx512f avx512_bf16; 2 cores)': the report header's machine."""
    parts = [m.get("cpu_id"), m.get("isa"), f"{m['cores']} cores", m.get("gpu")]
    return f"{m['cpu']} ({'; '.join(p for p in parts if p)})"


RUN_ENV = ("DSPARK_DTYPE", "DSPARK_PROFILE_DIR")  # settings that change what a run computes, so its command names them


def command_line() -> str:
    """The command as typed, after the environment settings of RUN_ENV that were set (never a secret)."""
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in RUN_ENV if os.environ.get(k)]
    return " ".join([*env, "dspark", *(shlex.quote(a) for a in sys.argv[1:])])


def stamp() -> dict[str, Any]:
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(), "command": command_line()}


def write(out_dir: str | Path, name: str, payload: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = stamp()
    (out / f"{name}.json").write_text(json.dumps({**meta, **payload}, indent=2))
    m = meta["machine"]
    header = (f"_Machine: {machine_line(m)}, torch {m['torch']}; date {meta['date']}._\n\n"
              f"_Command:_ `{meta['command']}`\n\n")
    (out / f"{name}.md").write_text(header + markdown)
    return out / f"{name}.json", out / f"{name}.md"


def cell(v: Any, digits: int = 3) -> str:
    """One markdown table cell: a float to `digits` decimals, None as a dash, else str(v)."""
    if v is None:
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
