"""Prompt styles (`train/styles.py`): the corpus's prompts worded as served traffic words them.

Only the wording changes: the question, function or section of the corpus record stays in the prompt, a
domain without a served wording (agent) or a prompt not in the corpus's form passes through, and `mixed`
keeps about half of the prompts as they were, reproducibly for a seed.
"""

from __future__ import annotations

import random

import pytest

from dspark.train.regen import chat_prompts
from dspark.train.styles import BOXED, docstring_line, restyle, styled
from tests.test_ddp import write_corpus

TASK = 'Complete the following Python function:\n```python\ndef area(r):\n    """Returns the area of a circle."""\n```'


def test_math_keeps_the_question_and_asks_for_a_boxed_answer():
    assert restyle("math", "What is 2 + 3?", random.Random(0)) == "What is 2 + 3?" + BOXED


def test_code_becomes_a_task_with_tests_or_a_one_line_description():
    seen = {restyle("code", TASK, random.Random(seed)) for seed in range(20)}
    assert seen == {
        'Write a solution to the following problem and make sure that it passes the tests:\n```python\n'
        'def area(r):\n    """Returns the area of a circle."""\n\n```',
        "Write a python function to return the area of a circle.",
    }


def test_a_docstring_that_does_not_start_with_a_verb_gives_no_description():
    assert docstring_line('def f():\n    """Content display hook for sub-classes."""') is None
    assert docstring_line("def f():\n    pass") is None
    assert docstring_line('def f():\n    """Computes x."""') == "compute x"


def test_chat_keeps_the_topic_and_other_prompts_pass_through():
    text = restyle("chat", "Explain Iterator Protocol.", random.Random(3))
    assert "Iterator Protocol" in text and not text.startswith("Explain")
    assert restyle("agent", "Rename `f` to `g`.", random.Random(0)) == "Rename `f` to `g`."
    assert restyle("code", "Fix this bug.", random.Random(0)) == "Fix this bug."


def test_mixed_rewords_about_half_and_repeats_for_a_seed():
    prompts = [f"Question {i}?" for i in range(400)]
    first = [styled("math", p, "mixed", random.Random(i)) for i, p in enumerate(prompts)]
    again = [styled("math", p, "mixed", random.Random(i)) for i, p in enumerate(prompts)]
    reworded = sum(t.endswith(BOXED) for t in first)
    assert first == again and 150 < reworded < 250
    assert all(styled("math", p, "corpus", random.Random(0)) == p for p in prompts[:5])


def test_an_unknown_style_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown prompt style 'tests'"):
        styled("math", "x", "tests", random.Random(0))


def test_regen_prompts_in_the_served_style(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    plain = chat_prompts(corpus, "train", 3, seed=1)
    served = chat_prompts(corpus, "train", 3, seed=1, style="served")
    assert [d for d, _ in plain] == [d for d, _ in served]
    math = [(p, s) for (d, p), (_, s) in zip(plain, served, strict=True) if d == "math"]
    assert math and all(s.replace(BOXED, "") == p for p, s in math)
