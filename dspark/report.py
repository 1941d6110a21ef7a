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


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def command_line() -> str:
    return "dspark " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def stamp() -> dict[str, Any]:
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(), "command": command_line()}


def write(out_dir: str | Path, name: str, payload: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = stamp()
    (out / f"{name}.json").write_text(json.dumps({**meta, **payload}, indent=2))
    m = meta["machine"]
    header = (f"_Machine: {m['cpu']} ({m['cores']} cores{', ' + m['gpu'] if 'gpu' in m else ''}), "
              f"torch {m['torch']}; date {meta['date']}._\n\n_Command:_ `{meta['command']}`\n\n")
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
