"""What a benchmark runs: prompts rendered to token ids, and engines built per configuration.

Shared by `dspark bench offline | online | peers` (not a command itself):
- `select(datasets, prompts_file, n)`: n prompts per shipped dataset, or from a user JSONL;
- `render(tokenizer, prompts, limit)`: the chat template applied, encoded, the last `limit`
  token ids kept (so the generation prompt survives truncation);
- `interleave` (the `mixed` workload: math, code and chat in the same batch) and
  `hostile` (random token strings, on which almost every draft token is rejected); the `agent`
  workload's multi-turn traces are in agent.py, a job carrying its later turns (`follow`);
- `Spec` / `parse_configs`: `none` or `drafter:policy`, e.g. `dspark:dspark-async`; a drafter
  name may end in `@N` to draft from the N most frequent tokens (`dspark@2048:dspark`);
- `drafter_gamma`: the block size a named drafter would load with (None when missing).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dspark.bench.prompts import DATASETS, Prompt, load_dataset, read_prompts


@dataclass(frozen=True)
class Job:
    """One prompt ready for the engine; a multi-turn trace also carries its later turns."""

    ids: list[int]
    dataset: str
    domain: str
    turns: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (domain, token ids of the next message) per later turn
    limit: int = 0  # the longest prompt a later turn may have


def follow(job: Job, output: Sequence[int], stop_ids: Sequence[int]) -> Job | None:
    """A trace's next turn: this turn's prompt, the model's turn (its stop token dropped: the next
    message closes the turn) and the next message; None after the last turn or when that prompt
    would be longer than the job's limit (the context must still hold the next turn's tokens)."""
    if not job.turns:
        return None
    body = list(output)
    if body and body[-1] in stop_ids:
        body.pop()
    domain, nxt = job.turns[0]
    ids = [*job.ids, *body, *nxt]
    if len(ids) > job.limit:
        return None
    return Job(ids, job.dataset, domain, job.turns[1:], job.limit)


def select(datasets: list[str] | None, prompts_file: str | None, n: int) -> list[Prompt]:
    """`n` prompts per dataset (the first n of each shipped subset), or the first n of a file."""
    if prompts_file:
        return read_prompts(prompts_file)[:n]
    return [p for d in (datasets or list(DATASETS)) for p in load_dataset(d)[:n]]


def render(tokenizer, prompts: list[Prompt], limit: int) -> list[Job]:
    """Chat-template each prompt as one user turn (plain text when there is no template)."""
    jobs = []
    for p in prompts:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p.text}])
        except ValueError:
            text = p.text
        jobs.append(Job(tokenizer.encode(text)[-limit:], p.dataset, p.domain))
    return jobs


def interleave(jobs: list[Job]) -> list[Job]:
    """Round-robin over datasets, so consecutive requests come from different domains."""
    groups: dict[str, list[Job]] = {}
    for j in jobs:
        groups.setdefault(j.dataset, []).append(j)
    lists = list(groups.values())
    return [g[i] for i in range(max(map(len, lists), default=0)) for g in lists if i < len(g)]


def hostile(tokenizer, n: int, length: int, seed: int = 0) -> list[Job]:
    """Random token strings (special tokens excluded), passed to the engine as id lists."""
    rng = random.Random(seed)
    special = {i for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
               if (i := tokenizer.token_id(t)) is not None}
    pool = [i for i in range(tokenizer.vocab_size) if i not in special]
    return [Job([rng.choice(pool) for _ in range(length)], "random", "hostile") for _ in range(n)]


@dataclass(frozen=True)
class Spec:
    """A served configuration: `none`, or a drafter (name or directory) with a policy and, optionally,
    options: the gate's (`GateConfig.parse`: 'select=0,cut=1') and the engine's (`ENGINE_OPTIONS`)."""

    drafter: str | None
    policy: str
    copy: int = 1  # the n-th time the configuration is listed: an identical engine, a noise yardstick
    options: str = ""  # as written after '?' ('select=0,pad_rows=0'); `split_options` sorts them

    @property
    def label(self) -> str:
        base = "none" if self.drafter is None else f"{drafter_label(self.drafter)}:{self.policy}"
        base = f"{base}?{self.options}" if self.options else base
        return base if self.copy == 1 else f"{base}#{self.copy}"


def split_drafter(name: str) -> tuple[str, int | None]:
    """'dspark@2048' -> ('dspark', 2048): the drafter and its draft vocabulary ('@0': every token;
    no '@': None, the drafter's own setting)."""
    base, sep, size = name.rpartition("@")
    if not sep or not size.isdigit() or not base:
        return name, None
    return base, int(size)


def drafter_label(name: str) -> str:
    """A shipped name as is; a directory by its last component."""
    return Path(name).name if "/" in name else name


ENGINE_OPTIONS = ("pad_rows",)  # `EngineConfig` fields a configuration may set beside its gate options


def split_options(text: str) -> tuple[str, dict[str, int]]:
    """'select=0,pad_rows=0' -> ('select=0', {'pad_rows': 0}): gate options, and engine config changes."""
    gate, engine = [], {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, raw = item.partition("=")
        if key not in ENGINE_OPTIONS:
            gate.append(item)
        elif not raw.isdigit():
            raise ValueError(f"engine option {item!r}: expected {key}=N, N >= 0")
        else:
            engine[key] = int(raw)
    return ",".join(gate), engine


def parse_configs(text: str) -> list[Spec]:
    """'none;mtp:static:1;dspark:dspark' -> Specs (the drafter is everything before the first ':').
    A configuration listed again ('none;none;...') is a second, identical engine labelled
    'none#2': its ratio to the first is the run's own noise (an A/A comparison). A policy may end in
    '?' and options ('dspark:dspark?select=0', 'dspark:dspark?pad_rows=0'), to compare gate or engine settings
    side by side."""
    from dspark.engine.gate import GateConfig

    out: list[Spec] = []
    for item in (s.strip() for s in text.split(";")):
        if not item:
            continue
        if item == "none":
            drafter, policy = None, "none"
        else:
            drafter, sep, policy = item.partition(":")
            if not sep or not policy:
                raise ValueError(f"config {item!r}: expected 'none' or 'drafter:policy' (e.g. dspark:dspark)")
        policy, _, options = policy.partition("?")
        GateConfig.parse(split_options(options)[0])  # a bad option fails here, before any engine is built
        copy = 1 + sum(1 for sp in out if (sp.drafter, sp.policy, sp.options) == (drafter, policy, options))
        spec = Spec(drafter, policy, copy, options)
        clash = next((sp for sp in out if sp.label == spec.label), None)
        if clash is not None:  # results are keyed by label: one would silently replace the other
            raise ValueError(f"configs {clash.drafter}:{clash.policy} and {item!r} share the label {spec.label!r} (a "
                             f"directory is labelled by its last component); give the directory another name")
        out.append(spec)
    return out


def drafter_config_path(name: str, model_dir: Path) -> Path | None:
    """Where a drafter's config.json lives: the shipped kind next to the model, or a directory."""
    from dspark.drafters.base import KINDS

    path = model_dir.parent / "drafters" / name if name in KINDS else Path(name).expanduser()
    return path / "config.json" if (path / "config.json").is_file() else None


def drafter_gamma(name: str, model_dir: Path) -> int | None:
    """The drafter's own block size, without loading its weights; None when it is missing."""
    from dspark.drafters.registry import GAMMA, WEIGHT_FREE, paired_parts, routed_parts

    name = split_drafter(name)[0]
    if name in WEIGHT_FREE:
        return GAMMA[name]
    if (neural := routed_parts(name)) is not None:
        return drafter_gamma(neural, model_dir)
    if (pair := paired_parts(name)) is not None:  # the deep drafter's block, where both parts are there
        deep, one = (drafter_gamma(p, model_dir) for p in pair)
        return None if one is None else deep
    cfg = drafter_config_path(name, model_dir)
    return None if cfg is None else int(json.loads(cfg.read_text()).get("gamma", 7))


def drafter_kind(name: str, model_dir: Path) -> str:
    from dspark.drafters.registry import WEIGHT_FREE, paired_parts, routed_parts

    name = split_drafter(name)[0]
    if name in WEIGHT_FREE:
        return name
    if routed_parts(name) is not None:
        return "auto"
    if (pair := paired_parts(name)) is not None:
        return drafter_kind(pair[0], model_dir)
    cfg = drafter_config_path(name, model_dir)
    return name if cfg is None else str(json.loads(cfg.read_text()).get("kind", name))


def engine_config(model_dir: Path, max_num_seqs: int, tokens_per_seq: int, device: str | None = None):
    """The engine's default KV pool (as `dspark serve` has), grown when max_num_seqs sequences
    of tokens_per_seq (prompt + max_tokens + gamma + anchor) would not fit, so nothing preempts.
    (A pool sized to the load alone is too small for the step-profile measurement, which
    reserves up to budget / (gamma + 1) contexts at once.)"""
    from dspark.config import EngineConfig, default_device, default_dtype, resolve_dtype
    from dspark.kv_cache import bytes_per_block
    from dspark.models.loader import read_config

    device = device or default_device()
    cfg = EngineConfig(device=device, max_num_seqs=max_num_seqs)
    per_block = bytes_per_block(read_config(model_dir), cfg.block_size, resolve_dtype(default_dtype(device)))
    need = -(-tokens_per_seq // cfg.block_size) * max_num_seqs + 1
    return cfg.replace(num_kv_blocks=max(need, cfg.kv_cache_bytes // per_block))
