"""Agent-style tasks with checkable answers, generated from the corpus the project already has.

Each task is a chat turn whose answer is known exactly, so the same records serve as training
data (the `agent` domain of the corpus), as a held-out measure of the model (exact-match or
valid-JSON rate) and as the phases of the agent workload (`dspark.agent.traces`). Kinds:

- `rename`, `add_arg`, `off_by_one`: edit a standard-library function (rename it, add a
  keyword parameter, repair a planted `range(...)` off-by-one) and return the whole function;
- `log_errors`: extract the ERROR lines of a synthetic log as JSON objects;
- `json_edit`: return a JSON document with one field changed;
- `tool_call`: write a tool call whose arguments come from the request;
- `plan`: plan in a few sentences (GSM8K solution steps, Python documentation prose).

All but `plan` copy long spans of their context; `plan` does not. `make_tasks(kind, ...)` is
deterministic in its seed.
"""

from __future__ import annotations

import ast
import json
import random
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

KINDS = ("rename", "add_arg", "off_by_one", "log_errors", "json_edit", "tool_call", "plan")
COPY_KINDS = frozenset(KINDS) - {"plan"}


@dataclass(frozen=True)
class Task:
    kind: str
    key: str  # stable identity (the held-out split hashes it)
    prompt: str
    answer: str


def check(kind: str, answer: str, output: str) -> bool:
    """Whether `output` solves the task: exact match for code, equal JSON for JSON kinds, and for
    `plan` an answer that is non-empty prose (no reference to match)."""
    output = output.strip()
    if kind in ("log_errors", "json_edit", "tool_call"):
        try:
            return json.loads(_unfence(output)) == json.loads(_unfence(answer))
        except ValueError:
            return False
    if kind == "plan":
        return len(output.split()) >= 5
    return output == answer.strip()


def valid_json(output: str) -> bool:
    try:
        json.loads(_unfence(output.strip()))
        return True
    except ValueError:
        return False


def _unfence(text: str) -> str:
    m = re.fullmatch(r"```\w*\n(.*)\n```", text, re.S)
    return m.group(1) if m else text


def _fence(text: str, lang: str) -> str:
    return f"```{lang}\n{text}\n```"


# ---- code edits on standard-library functions -------------------------------------------------

def function_nodes(source: str) -> tuple[list[str], list[ast.FunctionDef | ast.AsyncFunctionDef]]:
    """A module's lines and its function definitions (none when it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return [], []
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return source.splitlines(), nodes


def functions(source: str, max_lines: int = 25) -> Iterator[tuple[str, str]]:
    """(name, dedented source) of every top-level or method function of at most max_lines lines."""
    lines, nodes = function_nodes(source)
    for node in nodes:
        if isinstance(node, ast.FunctionDef) and node.end_lineno and node.end_lineno - node.lineno < max_lines:
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            body = lines[first - 1 : node.end_lineno]
            indent = len(body[0]) - len(body[0].lstrip())
            if all(not ln.strip() or ln[:indent].isspace() or indent == 0 for ln in body):
                yield node.name, "\n".join(ln[indent:] for ln in body)


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except SyntaxError:
        return False


_NEW_NAMES = ("process", "handle_item", "compute", "load_entry", "parse_value", "update_state", "render_row",
              "collect", "resolve", "apply_change", "read_block", "emit_record")
_PARAMS = (("timeout", "None"), ("verbose", "False"), ("retries", "3"), ("encoding", "'utf-8'"),
           ("strict", "True"), ("limit", "100"), ("callback", "None"), ("prefix", "''"))


def rename_task(name: str, code: str, rng: random.Random) -> Task | None:
    new = rng.choice([n for n in _NEW_NAMES if n != name])
    edited = re.sub(rf"\b{re.escape(name)}\b", new, code)
    if edited == code or re.search(rf"\b{new}\b", code):
        return None
    prompt = f"Rename the function `{name}` to `{new}` (and its recursive calls). Return the whole edited function.\n{_fence(code, 'python')}"
    return Task("rename", f"rename:{name}:{zlib.crc32(code.encode())}", prompt, _fence(edited, "python"))


def add_arg_task(name: str, code: str, rng: random.Random) -> Task | None:
    m = re.search(rf"^def {re.escape(name)}\((.*)\)(\s*->[^:\n]+)?:\s*$", code, re.M)
    if m is None or "*" in m.group(1):
        return None
    param, default = rng.choice(_PARAMS)
    if re.search(rf"\b{param}\b", code):
        return None
    args = m.group(1).strip()
    new_args = f"{args}, {param}={default}" if args else f"{param}={default}"
    edited = code[: m.start(1)] + new_args + code[m.end(1) :]
    if not _parses(edited):
        return None
    prompt = (f"Add a keyword parameter `{param}` with default `{default}` at the end of the signature of "
              f"`{name}`. Return the whole edited function.\n{_fence(code, 'python')}")
    return Task("add_arg", f"add_arg:{name}:{zlib.crc32(code.encode())}", prompt, _fence(edited, "python"))


_RANGE = re.compile(r"range\(([^()]*(?:\([^()]*\))?[^()]*)\)")


def off_by_one_task(name: str, code: str, rng: random.Random) -> Task | None:
    m = _RANGE.search(code)
    if m is None or "," in m.group(1) or not m.group(1).strip():
        return None
    broken = code[: m.start()] + f"range({m.group(1)} - 1)" + code[m.end() :]
    prompt = (f"The function `{name}` has an off-by-one error in a `range` call. Fix it and return the whole "
              f"fixed function.\n{_fence(broken, 'python')}")
    return Task("off_by_one", f"off_by_one:{name}:{zlib.crc32(code.encode())}", prompt, _fence(code, "python"))


# ---- synthetic logs, JSON documents, tool calls ------------------------------------------------

_COMPONENTS = ("auth", "db", "cache", "scheduler", "api", "worker", "storage", "billing", "mailer", "search")
_INFO = ("request served in {n} ms", "connected to {host}", "job {id} started", "cache hit ratio {p}%",
         "user {user} logged in", "flushed {n} records", "health check ok", "config reloaded")
_WARN = ("slow query took {n} ms", "retrying job {id} (attempt {k})", "disk usage at {p}%",
         "deprecated option {opt} used")
_ERROR = ("connection to {host} refused", "job {id} failed: timeout after {n} s", "invalid token for user {user}",
          "could not write {path}: permission denied", "out of memory allocating {n} MB",
          "unhandled exception in {opt}: KeyError '{user}'")
_HOSTS = ("10.0.0.12", "db-primary", "cache-2", "api.internal", "10.0.3.7")
_USERS = ("alice", "bob", "carol", "dave", "erin", "frank")
_OPTS = ("legacy_mode", "fast_path", "handler", "compress", "batch_size")


def _fill(template: str, rng: random.Random) -> str:
    return template.format(n=rng.randint(2, 9000), host=rng.choice(_HOSTS), id=rng.randint(100, 999),
                           p=rng.randint(10, 99), user=rng.choice(_USERS), k=rng.randint(2, 5),
                           opt=rng.choice(_OPTS), path=f"/var/data/{rng.choice(_USERS)}.db")


def synthetic_log(rng: random.Random) -> tuple[str, list[dict]]:
    """A log of 8-18 lines and its ERROR lines as objects (at least one)."""
    lines, errors = [], []
    h, mnt, s = rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59)
    n, day = rng.randint(8, 18), rng.randint(10, 28)
    error_at = set(rng.sample(range(n), rng.randint(1, 4)))
    for i in range(n):
        s += rng.randint(1, 20)
        mnt, s = mnt + s // 60, s % 60
        h, mnt = (h + mnt // 60) % 24, mnt % 60
        time = f"2026-03-{day}T{h:02d}:{mnt:02d}:{s:02d}"
        level = "ERROR" if i in error_at else rng.choice(("INFO", "INFO", "INFO", "WARN"))
        comp = rng.choice(_COMPONENTS)
        msg = _fill(rng.choice({"INFO": _INFO, "WARN": _WARN, "ERROR": _ERROR}[level]), rng)
        lines.append(f"{time} {level} {comp}: {msg}")
        if level == "ERROR":
            errors.append({"time": time, "component": comp, "message": msg})
    return "\n".join(lines), errors


def log_errors_task(rng: random.Random, index: int) -> Task:
    log, errors = synthetic_log(rng)
    prompt = ("Extract the ERROR lines of this log as a JSON list of objects with the keys time, component "
              f"and message.\n{_fence(log, '')}")
    answer = "[\n" + ",\n".join("  " + json.dumps(e) for e in errors) + "\n]"
    return Task("log_errors", f"log:{index}", prompt, _fence(answer, "json"))


_KEYS = ("name", "version", "enabled", "port", "host", "timeout", "retries", "owner", "region", "replicas",
         "mode", "level", "path", "tags", "limit", "debug")
_WORDS = ("alpha", "beta", "prod", "staging", "eu-west", "us-east", "fast", "safe", "main", "backup", "nightly")


def _value(rng: random.Random, depth: int):
    r = rng.random()
    if depth < 1 and r < 0.2:
        return {k: _value(rng, depth + 1) for k in rng.sample(_KEYS, rng.randint(2, 4))}
    if r < 0.4:
        return rng.randint(0, 5000)
    if r < 0.55:
        return rng.choice((True, False))
    if r < 0.65:
        return rng.sample(_WORDS, rng.randint(1, 3))
    return rng.choice(_WORDS)


def json_edit_task(rng: random.Random, index: int) -> Task:
    doc = {k: _value(rng, 0) for k in rng.sample(_KEYS, rng.randint(4, 9))}
    paths = [(k,) for k, v in doc.items() if not isinstance(v, dict | list)]
    paths += [(k, j) for k, v in doc.items() if isinstance(v, dict) for j, w in v.items() if not isinstance(w, dict | list)]
    path = rng.choice(paths or [(next(iter(doc)),)])
    old = doc[path[0]] if len(path) == 1 else doc[path[0]][path[1]]
    new = rng.randint(0, 5000) if isinstance(old, int) and not isinstance(old, bool) else (
        (not old) if isinstance(old, bool) else rng.choice([w for w in _WORDS if w != old]))
    edited = json.loads(json.dumps(doc))
    if len(path) == 1:
        edited[path[0]] = new
    else:
        edited[path[0]][path[1]] = new
    prompt = (f"Change the field `{'.'.join(path)}` to {json.dumps(new)} and return the whole JSON document."
              f"\n{_fence(json.dumps(doc, indent=2), 'json')}")
    return Task("json_edit", f"json:{index}", prompt, _fence(json.dumps(edited, indent=2), "json"))


_TOOLS = (
    ("get_weather", "Current weather for a city.", (("city", "str"), ("unit", "str"))),
    ("search_files", "Find files matching a pattern under a directory.", (("pattern", "str"), ("path", "str"))),
    ("send_email", "Send an email.", (("to", "str"), ("subject", "str"))),
    ("create_event", "Add an event to the calendar.", (("title", "str"), ("date", "str"), ("duration_minutes", "int"))),
    ("run_tests", "Run the test suite of a project.", (("path", "str"), ("verbose", "bool"))),
    ("restart_service", "Restart a service on a host.", (("service", "str"), ("host", "str"))),
)
_CITIES = ("Paris", "Lagos", "Osaka", "Lima", "Oslo", "Pune", "Quito", "Perth")
_TITLES = ("standup", "design review", "1:1 with Erin", "release planning", "incident retro")


def _tool_args(tool: str, rng: random.Random) -> tuple[dict, str]:
    """Arguments and the request that states them."""
    if tool == "get_weather":
        a = {"city": rng.choice(_CITIES), "unit": rng.choice(("celsius", "fahrenheit"))}
        return a, f"What is the weather in {a['city']} right now? Use {a['unit']}."
    if tool == "search_files":
        a = {"pattern": rng.choice(("*.py", "*.log", "test_*.py", "*.json")), "path": rng.choice(("src", "/var/log", "tests", "configs"))}
        return a, f"Find all files matching {a['pattern']} in {a['path']}."
    if tool == "send_email":
        a = {"to": f"{rng.choice(_USERS)}@example.com", "subject": rng.choice(("Weekly report", "Build failed", "Lunch?", "Deploy done"))}
        return a, f"Email {a['to']} with the subject \"{a['subject']}\"."
    if tool == "create_event":
        a = {"title": rng.choice(_TITLES), "date": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
             "duration_minutes": rng.choice((15, 30, 45, 60, 90))}
        return a, f"Put \"{a['title']}\" on my calendar on {a['date']} for {a['duration_minutes']} minutes."
    if tool == "run_tests":
        a = {"path": rng.choice(("tests", "tests/unit", "pkg/tests")), "verbose": rng.choice((True, False))}
        return a, f"Run the tests in {a['path']}{' verbosely' if a['verbose'] else ' quietly'}."
    a = {"service": rng.choice(("nginx", "postgres", "redis", "worker")), "host": rng.choice(_HOSTS)}
    return a, f"Restart {a['service']} on {a['host']}."


def tool_spec(tools) -> str:
    return "\n".join(json.dumps({"name": n, "description": d, "parameters": {p: t for p, t in ps}}) for n, d, ps in tools)


def tool_call_task(rng: random.Random, index: int) -> Task:
    tools = rng.sample(_TOOLS, rng.randint(2, 4))
    name = rng.choice(tools)[0]
    args, request = _tool_args(name, rng)
    prompt = (f"You can call these tools:\n{tool_spec(tools)}\nRequest: {request}\n"
              "Answer with one tool call as JSON with the keys name and arguments.")
    return Task("tool_call", f"tool:{index}", prompt, json.dumps({"name": name, "arguments": args}))


# ---- planning: open-ended, nothing to copy -----------------------------------------------------

def plan_from_math(question: str, solution: str) -> Task:
    steps = [s.strip() for s in re.sub(r"<<[^>]*>>", "", solution).split("\n") if s.strip() and not s.startswith("####")]
    plan = " ".join(f"Step {i + 1}: {s}" for i, s in enumerate(steps[:5]))
    prompt = f"Plan, in a few sentences, how to solve this problem.\n{question}"
    return Task("plan", f"plan:{question}", prompt, plan)


def plan_from_docs(title: str, prose: str) -> Task | None:
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(prose.split()))
    text = " ".join(sentences[:3])
    if len(text) < 80:
        return None
    prompt = f"Plan, in a few sentences, how you would use {title} in a project."
    return Task("plan", f"plan:{title}", prompt, text)
