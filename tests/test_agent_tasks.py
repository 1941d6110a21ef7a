"""Agent tasks: every kind is generated, its reference answer passes its own check and a wrong
answer does not, edits are valid Python, logs and JSON answers say what the prompt holds, and
generation is a function of the seed."""

from __future__ import annotations

import ast
import json
import re

from dspark.agent.generate import Sources, episodes, generate, render_episode
from dspark.agent.tasks import KINDS, check, functions, valid_json

SOURCE = '''
def total(values, n):
    """Sum of the first n values."""
    s = 0
    for i in range(n):
        s += values[i]
    return s


def greet(name):
    return "hello " + name
'''


def sources() -> Sources:
    return Sources(functions=list(functions(SOURCE)),
                   math=[("Tom has 3 apples and buys 4. How many?", "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7")],
                   docs=[("list comprehensions", "A list comprehension builds a list. It reads left to right. "
                          "It can filter with if. Nested loops work too.")])


def body(text: str) -> str:
    return re.fullmatch(r"```\w*\n(.*)\n```", text, re.S).group(1)


def test_every_kind_is_generated_and_passes_its_own_check():
    tasks = list(generate(sources(), 70, seed=3))
    assert {t.kind for t in tasks} == set(KINDS)
    for t in tasks:
        assert check(t.kind, t.answer, t.answer), t
        assert not check(t.kind, t.answer, "I cannot do that."), t


def test_code_edits_are_valid_python_and_differ_from_the_prompt():
    for t in generate(sources(), 70, seed=4, kinds=("rename", "add_arg", "off_by_one")):
        edited = body(t.answer)
        ast.parse(edited)
        shown = body(t.prompt.split("\n", 1)[1])
        assert edited != shown
    fix = next(generate(sources(), 1, seed=0, kinds=("off_by_one",)))
    assert "range(n - 1)" in fix.prompt and "range(n)" in fix.answer


def test_log_answer_lists_exactly_the_error_lines():
    t = next(generate(sources(), 1, seed=5, kinds=("log_errors",)))
    log = body(t.prompt.split("\n", 1)[1]).splitlines()
    errors = json.loads(body(t.answer))
    assert [f"{e['time']} ERROR {e['component']}: {e['message']}" for e in errors] == [ln for ln in log if " ERROR " in ln]


def test_json_edit_changes_one_field():
    t = next(generate(sources(), 1, seed=6, kinds=("json_edit",)))
    before = json.loads(body(t.prompt.split("\n", 1)[1]))
    after = json.loads(body(t.answer))
    flat = lambda d: {(k, j): w for k, v in d.items() for j, w in (v.items() if isinstance(v, dict) else [(None, v)])}  # noqa: E731
    changed = [k for k in flat(before) if flat(before)[k] != flat(after)[k]]
    assert len(changed) == 1 and flat(before).keys() == flat(after).keys()
    assert valid_json(t.answer) and not valid_json("{broken")


def test_tool_call_arguments_come_from_the_request():
    for t in generate(sources(), 20, seed=7, kinds=("tool_call",)):
        call = json.loads(t.answer)
        request = t.prompt.split("Request: ", 1)[1]
        assert call["name"] in t.prompt
        assert all(str(v).lower() in request.lower() or isinstance(v, bool) for v in call["arguments"].values())


def test_generation_is_a_function_of_the_seed():
    a = [t.answer for t in generate(sources(), 30, seed=1)]
    assert a == [t.answer for t in generate(sources(), 30, seed=1)]
    assert a != [t.answer for t in generate(sources(), 30, seed=2)]


def test_episodes_chain_turns_with_tool_observations():
    ep = next(episodes(sources(), 1, seed=0))
    text = render_episode(ep)
    assert len(ep.turns) >= 3 and ep.turns[-1].kind == "plan"
    assert text.startswith("<|im_start|>user\n") and text.count("<|im_start|>tool\n") == len(ep.turns) - 1
    assert text.count("<|im_start|>assistant\n") == len(ep.turns)
