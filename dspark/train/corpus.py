"""`dspark train corpus`: build the three-domain corpus of the dspark-tiny target.

Domains (each with a held-out split drawn with a fixed seed):
- math: GSM8K train, as chat (user question -> assistant step-by-step answer, `#### n` kept);
- code: the running interpreter's standard library, as raw files and as chat tasks
  ("Complete the following Python function" with signature + docstring -> whole function);
- chat: the Python documentation (reST stripped to prose), as "Explain <title>." -> text;
- agent: agent-style tasks with checkable answers built from the three sources above plus
  synthetic logs, JSON documents and tool specs (`dspark.agent`), as single chat turns and
  as multi-turn episodes (raw ChatML text with tool observations).

Records are JSONL, one of `{"domain", "prompt", "response"}` (chat form) or
`{"domain", "text"}` (raw text). `render` turns a record into training text.

    dspark train corpus --out ~/.cache/dspark/corpus
"""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GSM8K = "../shared/data/gsm8k/train.jsonl"
DEFAULT_DOCS = "../shared/data/corpus/python-3.11-docs-rst.tar.gz"
DOMAINS = ("math", "code", "chat", "agent")
END_OF_TEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END, MASK]
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "turtledemo", "lib2to3"}


@dataclass(frozen=True)
class CorpusConfig:
    gsm8k: str = DEFAULT_GSM8K
    docs: str = DEFAULT_DOCS
    stdlib: str = ""  # default: this interpreter's standard library
    heldout_fraction: float = 0.03
    seed: int = 0
    max_response_chars: int = 2400  # chat answers are clipped at a paragraph boundary
    max_function_lines: int = 60  # code tasks: longer functions are left out
    raw_code: bool = True  # also the raw source files (False: only the chat-form function tasks)
    agent_tasks: int = 12000  # single-turn agent tasks (every kind in rotation)
    agent_episodes: int = 2500  # multi-turn agent episodes


def chat_text(prompt: str, response: str | None = None) -> str:
    """ChatML, as the tokenizer's chat template renders one user turn (+ the answer)."""
    head = f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n"
    return head if response is None else f"{head}{response}{IM_END}\n"


def render(record: dict) -> str:
    """Training text of one record, ending with the document separator."""
    if "text" in record:
        return record["text"] + END_OF_TEXT
    return chat_text(record["prompt"], record["response"]) + END_OF_TEXT


def is_heldout(key: str, cfg: CorpusConfig) -> bool:
    """Deterministic split by a stable hash of the record's key and the seed."""
    h = zlib.crc32(f"{cfg.seed}:{key}".encode()) / 0xFFFFFFFF
    return h < cfg.heldout_fraction


def math_records(cfg: CorpusConfig) -> Iterator[dict]:
    with open(cfg.gsm8k, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            answer = re.sub(r"<<[^>]*>>", "", row["answer"])  # drop calculator annotations
            yield {"domain": "math", "key": row["question"], "prompt": row["question"], "response": answer}


def stdlib_files(root: str) -> list[Path]:
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in base.rglob("*.py") if not _SKIP_DIRS & set(p.relative_to(base).parts[:-1])]
    return sorted(files)


def function_tasks(source: str, max_lines: int = 60) -> Iterator[tuple[str, str]]:
    """(prompt, response) for every documented function of reasonable size in a module."""
    from dspark.agent.tasks import function_nodes

    lines, nodes = function_nodes(source)
    for node in nodes:
        doc = ast.get_docstring(node, clean=False)
        if not doc or node.end_lineno is None or node.end_lineno - node.lineno > max_lines:
            continue
        body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        first = node.body[0]
        head = "\n".join(lines[node.lineno - 1 : (first.end_lineno or node.lineno)])
        indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
        prompt = f"Complete the following Python function:\n```python\n{_dedent(head, indent)}\n```"
        yield prompt, f"```python\n{_dedent(body, indent)}\n```"


def _dedent(text: str, indent: int) -> str:
    return "\n".join(line[indent:] for line in text.splitlines())


def code_records(cfg: CorpusConfig) -> Iterator[dict]:
    for path in stdlib_files(cfg.stdlib):
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        key = path.name + str(len(source))
        if cfg.raw_code:
            yield {"domain": "code", "key": key, "text": source}
        for prompt, response in function_tasks(source, cfg.max_function_lines):
            yield {"domain": "code", "key": key, "prompt": prompt, "response": response}


_ROLE = re.compile(r":[\w:+.-]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_TITLE_RULE = re.compile(r"^([=\-~^\"'*+#`:.])\1{2,}\s*$")


def strip_rest(text: str) -> str:
    """reST markup -> readable prose: roles, literals, directives and rules removed."""
    out, skipping = [], False
    for line in text.splitlines():
        if line.startswith(".. "):
            skipping = True  # a directive/comment and its indented options
            continue
        if skipping and (line.startswith("   :") or (line.strip() and line.startswith(" ") and ":" in line[:30] and line.strip().startswith(":"))):
            continue
        skipping = False
        line = _ROLE.sub(r"\1", line)
        line = re.sub(r"``([^`]+)``", r"\1", line)
        line = re.sub(r"`([^`<]+?)(?:\s*<[^>]*>)?`_{0,2}", r"\1", line)
        line = re.sub(r"\*\*([^*]+)\*\*", r"\1", line)
        line = line.replace("::", ":") if line.rstrip().endswith("::") else line
        out.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def rst_sections(text: str) -> Iterator[tuple[str, str]]:
    """(title, body) for every section of an reST document."""
    lines = text.splitlines()
    titles = [i for i in range(len(lines) - 1)
              if lines[i].strip() and not _TITLE_RULE.match(lines[i])
              and _TITLE_RULE.match(lines[i + 1]) and len(lines[i + 1].strip()) >= len(lines[i].strip())]
    for n, i in enumerate(titles):
        end = titles[n + 1] - 1 if n + 1 < len(titles) else len(lines)
        body = [ln for ln in lines[i + 2 : end] if not _TITLE_RULE.match(ln)]
        yield lines[i].strip(), "\n".join(body)


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    return text[: cut if cut > limit // 3 else limit].rstrip()


def chat_records(cfg: CorpusConfig) -> Iterator[dict]:
    with tarfile.open(cfg.docs) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if not member.isfile() or not member.name.endswith(".rst.txt"):
                continue
            raw = tar.extractfile(member).read().decode("utf-8", errors="replace")  # type: ignore[union-attr]
            for title, body in rst_sections(raw):
                prose = strip_rest(body)
                title = strip_rest(title)
                if len(prose) < 200 or not title:
                    continue
                yield {"domain": "chat", "key": f"{member.name}#{title}",
                       "prompt": f"Explain {title}.", "response": _clip(prose, cfg.max_response_chars)}


def agent_sources(cfg: CorpusConfig):
    """Functions of the standard library, GSM8K solutions and documentation sections for agent tasks."""
    from dspark.agent.generate import Sources
    from dspark.agent.tasks import functions

    funcs = []
    for path in stdlib_files(cfg.stdlib):
        try:
            funcs += list(functions(path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    math = [(r["prompt"], r["response"]) for r in math_records(cfg)]
    docs = [(r["prompt"].removeprefix("Explain ").rstrip("."), r["response"]) for r in chat_records(cfg)]
    return Sources(funcs, math, docs)


def agent_records(cfg: CorpusConfig) -> Iterator[dict]:
    from dspark.agent.generate import episodes, generate, render_episode

    sources = agent_sources(cfg)
    for t in generate(sources, cfg.agent_tasks, cfg.seed):
        yield {"domain": "agent", "key": t.key, "kind": t.kind, "prompt": t.prompt, "response": t.answer}
    for ep in episodes(sources, cfg.agent_episodes, cfg.seed + 1):
        yield {"domain": "agent", "key": ep.key, "text": render_episode(ep).removesuffix("\n")}


def build(cfg: CorpusConfig, out: str) -> dict[str, dict[str, int]]:
    """Write `{out}/{domain}.{train,heldout}.jsonl`; returns record counts per split."""
    out_dir = Path(out).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    counts: dict[str, dict[str, int]] = {}
    sources = {"math": math_records, "code": code_records, "chat": chat_records, "agent": agent_records}
    for domain in DOMAINS:
        counts[domain] = {"train": 0, "heldout": 0}
        with open(out_dir / f"{domain}.train.jsonl", "w") as tr, open(out_dir / f"{domain}.heldout.jsonl", "w") as ho:
            for rec in sources[domain](cfg):
                split = "heldout" if is_heldout(rec.pop("key"), cfg) else "train"
                (ho if split == "heldout" else tr).write(json.dumps(rec) + "\n")
                counts[domain][split] += 1
    return counts


def corpus_domains(corpus_dir: str | Path, split: str) -> list[str]:
    """The domains, in DOMAINS order, that a corpus directory has a `split` file for (a corpus
    built before a domain existed, e.g. `agent`, lacks it)."""
    base = Path(corpus_dir).expanduser()
    return [d for d in DOMAINS if (base / f"{d}.{split}.jsonl").is_file()]


def read_records(path: str | Path) -> list[dict]:
    with open(Path(path).expanduser(), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def shuffled(records: list[dict], seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = list(records)
    rng.shuffle(out)
    return out
