"""The layer contract (pyproject's `[tool.importlinter]`) holds on the package, and it is a
real check: a copy of the package with one back-import planted (spec importing the engine)
breaks it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")
pytestmark = pytest.mark.slow  # two lint-imports runs in subprocesses

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """Run lint-imports with the repository's contract on the package found under `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())",
           str(ROOT / "pyproject.toml"), "--no-cache"]
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_layers():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_planted_back_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "dspark", tmp_path / "dspark", ignore=shutil.ignore_patterns("assets", "__pycache__"))
    verify = tmp_path / "dspark" / "spec" / "verify.py"
    verify.write_text(verify.read_text() + "\nimport dspark.engine.engine  # planted: spec must not import the engine\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "dspark.spec.verify -> dspark.engine.engine" in result.stdout
