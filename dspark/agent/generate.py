"""Agent tasks and multi-turn episodes from source material (functions, math solutions, docs).

`Sources` holds what the tasks are built from; the corpus builder fills it from the full
datasets, the benchmark from the standard library and the shipped prompt subsets.
`generate(sources, count, seed)` yields a deterministic mix of every kind; `episodes` chains
tasks into traces (a user request, the model's turn, a tool observation with the next
instruction, the model's next turn, ...) whose context grows turn by turn.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from dspark.agent.tasks import (
    KINDS,
    Task,
    add_arg_task,
    json_edit_task,
    log_errors_task,
    off_by_one_task,
    plan_from_docs,
    plan_from_math,
    rename_task,
    tool_call_task,
)

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True)
class Sources:
    functions: list[tuple[str, str]] = field(default_factory=list)  # (name, dedented source)
    math: list[tuple[str, str]] = field(default_factory=list)  # (question, solution)
    docs: list[tuple[str, str]] = field(default_factory=list)  # (title, prose)


_EDITS = {"rename": rename_task, "add_arg": add_arg_task, "off_by_one": off_by_one_task}
_SYNTHETIC = {"log_errors": log_errors_task, "json_edit": json_edit_task, "tool_call": tool_call_task}


def one_task(kind: str, sources: Sources, rng: random.Random, index: int, tries: int = 50) -> Task | None:
    """A task of `kind` (None when the sources have nothing that fits it)."""
    if kind in _SYNTHETIC:
        return _SYNTHETIC[kind](rng, index)
    for _ in range(tries):
        if kind in _EDITS and sources.functions:
            task = _EDITS[kind](*rng.choice(sources.functions), rng)
        elif kind == "plan" and (sources.math or sources.docs):
            use_math = sources.math and (not sources.docs or rng.random() < 0.5)
            task = plan_from_math(*rng.choice(sources.math)) if use_math else plan_from_docs(*rng.choice(sources.docs))
        else:
            return None
        if task is not None:
            return task
    return None


def generate(sources: Sources, count: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> Iterator[Task]:
    """`count` tasks, the kinds in rotation."""
    rng = random.Random(seed)
    for i in range(count):
        task = one_task(kinds[i % len(kinds)], sources, rng, i)
        if task is not None:
            yield task


@dataclass(frozen=True)
class Episode:
    """Turns of one agent trace; turn 0 comes from the user, later ones as tool observations."""

    key: str
    turns: tuple[Task, ...]


def episodes(sources: Sources, count: int, seed: int = 0, min_turns: int = 3, max_turns: int = 5) -> Iterator[Episode]:
    rng = random.Random(seed)
    for i in range(count):
        kinds = rng.sample([k for k in KINDS if k != "plan"], rng.randint(min_turns, max_turns) - 1) + ["plan"]
        turns = [one_task(k, sources, rng, i * 8 + j) for j, k in enumerate(kinds)]
        turns = [t for t in turns if t is not None]
        if turns:
            yield Episode(f"episode:{seed}:{i}:" + "|".join(t.key for t in turns), tuple(turns))


def role(turn: int) -> str:
    return "user" if turn == 0 else "tool"


def message(turn: int, content: str) -> str:
    return f"{IM_START}{role(turn)}\n{content}{IM_END}\n{IM_START}assistant\n"


def render_episode(ep: Episode) -> str:
    """ChatML text of a whole episode with the reference answers (training text)."""
    return "".join(message(i, t.prompt) + t.answer + f"{IM_END}\n" for i, t in enumerate(ep.turns))
