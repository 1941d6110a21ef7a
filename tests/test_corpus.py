"""The code domain of the corpus: raw source files plus chat-form function tasks, or the tasks alone."""

from __future__ import annotations

from dspark.train.corpus import CorpusConfig, code_records

MODULE = '''"""A module."""


def add(a, b):
    """Return a + b."""
    return a + b


def undocumented(x):
    return x
'''


def test_code_records_with_and_without_raw_files(tmp_path):
    (tmp_path / "mod.py").write_text(MODULE)
    both = list(code_records(CorpusConfig(stdlib=str(tmp_path))))
    assert [("text" in r, "prompt" in r) for r in both] == [(True, False), (False, True)]
    assert "def add(a, b):" in both[1]["prompt"] and "return a + b" in both[1]["response"]
    tasks = list(code_records(CorpusConfig(stdlib=str(tmp_path), raw_code=False)))
    assert tasks == both[1:]
