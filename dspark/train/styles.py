"""Prompt styles: the corpus's chat prompts worded as served traffic words them.

The corpus asks each domain one way ("Complete the following Python function", "Explain X.", a bare
GSM8K question). Traffic words the same requests otherwise: math with an instruction to reason step by
step and box the answer, code as a task with tests or a one-line description, chat as open instructions.
A drafter distils the target's answers, and the target answers a question differently when it is worded
differently, so `dspark train regen --style served` (or `mixed`, half of the prompts) asks the training
prompts in these wordings. Only the wording changes: every question, function and section still comes
from the corpus's own split, never from an evaluation set.
"""

from __future__ import annotations

import random
import re

STYLES = ("corpus", "served", "mixed")
BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
TESTED = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{code}\n\n```"
DESCRIBED = "Write a python function to {what}."
CHAT_FORMS = (
    "Write an engaging blog post about {topic}.",
    "Describe {topic}, highlighting the key points a newcomer should know.",
    "Imagine you are teaching {topic} to a colleague. Explain it with an example.",
    "Compose a short article on {topic} for a technical newsletter.",
    "What should I know about {topic}? Answer in a few paragraphs.",
)
CODE_TASK = re.compile(r"\AComplete the following Python function:\n```python\n(?P<code>.*)\n```\Z", re.S)
EXPLAIN = re.compile(r"\AExplain (?P<topic>.+)\.\Z", re.S)
VERBS = frozenset("return compute calculate get set create check convert find make parse read write build remove add "
                  "count split join format test determine generate encode decode load save copy update extract "
                  "search sort merge replace validate apply raise call open close run print produce".split())


def docstring_line(code: str) -> str | None:
    """The first line of a function's docstring as the verb phrase after "to " ("Returns the sum." -> "return the
    sum"), or None where it has no docstring or the line does not start with a common verb."""
    m = re.search(r'(?:"""|\'\'\')\s*(?P<line>[^\n]+)', code)
    if m is None:
        return None
    words = m.group("line").strip().strip('"\' ').rstrip(".").split()
    if len(words) < 2:
        return None
    verb = words[0].lower()
    for stem in (verb, verb.removesuffix("s"), verb.removesuffix("es")):
        if stem in VERBS:
            return " ".join([stem, *words[1:]])
    return None


def restyle(domain: str, prompt: str, rng: random.Random) -> str:
    """The prompt in a served wording of its domain (unchanged where the domain has none, or the prompt
    is not in the corpus's form)."""
    if domain == "math":
        return prompt + BOXED
    if domain == "code" and (m := CODE_TASK.match(prompt)):
        what = docstring_line(m.group("code"))
        if what is not None and rng.random() < 0.5:
            return DESCRIBED.format(what=what)
        return TESTED.format(code=m.group("code"))
    if domain == "chat" and (m := EXPLAIN.match(prompt)):
        return rng.choice(CHAT_FORMS).format(topic=m.group("topic"))
    return prompt


def check_style(style: str) -> None:
    """A clear error for a style that is not one of STYLES."""
    if style not in STYLES:
        raise ValueError(f"unknown prompt style {style!r}; expected one of {', '.join(STYLES)}")


def styled(domain: str, prompt: str, style: str, rng: random.Random) -> str:
    """One prompt in `style`: as the corpus asks it, in a served wording, or (`mixed`) either, even odds."""
    check_style(style)
    if style == "corpus" or (style == "mixed" and rng.random() < 0.5):
        return prompt
    return restyle(domain, prompt, rng)
