"""`dspark bench peers`: single-stream decoding speed of this engine against Hugging Face
`transformers` `generate()` on the same checkpoint, prompts and number of new tokens.

    dspark bench peers --max-tokens 128 --num-prompts 4 --repeats 2
    dspark bench peers --quick        # a ~1 minute smoke run (never a speed claim)
    dspark bench peers --model dspark-small --assistant dspark-tiny

Seven systems (eight with `--assistant`), greedy, exactly `--max-tokens` new tokens each (EOS ignored; with
`--stop-at-eos` each stops at the model's end token, as a served answer does, and tok/s counts what it
emitted): transformers `generate()`, transformers with prompt lookup (`prompt_lookup_num_tokens=7`), this engine
plainly (`none`), this engine with the model's default drafter verifying its whole block
(`static:gamma`) and with the default drafter and policy (engine/factory.py `default_spec`;
when no drafter is shipped for the model, `ngram` stands in and the report says so), and this
engine's own prompt lookup under the DSpark scheduler (`ngram:dspark`, beside transformers') and its
router between the default drafter and the suffix drafter (`auto:dspark`, `drafters/route.py`), and
with `--assistant MODEL` transformers' assisted generation with that smaller model of the same
tokenizer as its draft model (what a CPU user would try first); with `--llama-cpp DIR` also llama.cpp
plainly and (with `--assistant`) with that model as its draft model (bench/llamacpp.py). Runs
alternate prompt by prompt, the order rotating, so drift hits every system alike; results
are tok/s over all prompts and per domain (math, code, chat) with ratios, this engine's τ (tokens per
target step, what its speed-up rests on), whether each
system's greedy tokens match transformers' (a sanity check: in bf16 two implementations can
round differently and part ways) and this engine's plain decoding (the lossless check).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dspark import report
from dspark.bench.llamacpp import Measured
from dspark.bench.prompts import ONE_PER_DOMAIN, Prompt, load_dataset
from dspark.bench.summary import ratio
from dspark.bench.workload import engine_config, render
from dspark.models.loader import model_label


@dataclass(frozen=True)
class PeersSettings:
    model: str | None = None
    datasets: tuple[str, ...] = ONE_PER_DOMAIN
    num_prompts: int = 4  # per dataset
    max_tokens: int = 128
    repeats: int = 1
    lookup_tokens: int = 7
    profile: str = "auto"
    device: str | None = None
    assistant: str | None = None  # a smaller model with the same tokenizer: transformers assisted generation
    llama_cpp: str | None = None  # a built llama.cpp tree: its plain and (with assistant) draft-model decoding
    stop_at_eos: bool = False  # every system stops at the model's end token (default: exactly max_tokens each)


QUICK = dict(num_prompts=1, max_tokens=32, repeats=1)


def _timed(fn, device: torch.device) -> Measured:
    """fn() timed here, unless it times itself (an external program reports its own time)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    ids = fn()
    if isinstance(ids, Measured):
        return ids
    if device.type == "cuda":
        torch.cuda.synchronize()
    return Measured(time.perf_counter() - start, len(ids), ids, {})


def llama_systems(s: PeersSettings, path: Path, tok) -> dict:
    """llama.cpp plain, and with the assistant as its draft model when one is given."""
    from dspark.bench import llamacpp
    from dspark.models.loader import resolve_model_path

    ll = llamacpp.LlamaCpp(Path(s.llama_cpp).expanduser())
    target = llamacpp.gguf(ll, path)
    systems = {f"llama.cpp ({ll.outtype})": llamacpp.plain(ll, target, tok, s.max_tokens, s.stop_at_eos)}
    if s.assistant:
        draft = llamacpp.gguf(ll, resolve_model_path(s.assistant))
        systems[f"llama.cpp draft model ({Path(str(s.assistant)).name}, {ll.draft_max})"] = llamacpp.speculative(
            ll, target, draft, tok, s.max_tokens, s.stop_at_eos)
    return systems


class EngineSystem:
    """One greedy request alone through this engine, counting the target steps its requests took (the
    report's τ is the tokens `run` counts over these steps). A copy drafter first forgets earlier requests
    (`Drafter.forget`): every prompt runs once per pass, and a store holding the last pass's answer would
    copy it whole."""

    def __init__(self, engine, max_tokens: int, stop_at_eos: bool = False) -> None:
        from dspark.sampling import SamplingParams

        self.engine = engine
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not stop_at_eos)
        self.rounds = 0

    def __call__(self, ids: list[int]) -> list[int]:
        if self.engine.drafter is not None:
            self.engine.drafter.forget()
        out = self.engine.run_until_done([self.engine.add_request(ids, self.params)])[0]
        self.rounds += out.stats["rounds"]
        return out.token_ids


def hf_system(hf, max_tokens: int, pad_id: int, assistant=None, eos: list[int] | None = None, **extra):
    """Greedy `generate()` for exactly max_tokens: like the engine's ignore_eos, EOS tokens are
    emitted where the model predicts them and decoding goes on (min_new_tokens would instead mask
    EOS and change the tokens), so the end-of-sequence id is set to one the model never emits; with
    `eos`, generation stops at those ids, as the engine's does."""
    import copy

    gen = copy.deepcopy(hf.generation_config)
    fields = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id,
                  eos_token_id=eos or hf.config.vocab_size,
                  temperature=None, top_p=None, top_k=None, **extra)
    for key, value in fields.items():
        setattr(gen, key, value)

    def generate(ids: list[int]) -> list[int]:
        x = torch.tensor([ids], device=hf.device)
        with torch.inference_mode():
            y = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gen,
                            **({"assistant_model": assistant} if assistant is not None else {}))
        return y[0, len(ids):].tolist()

    return generate


def assistant_model(name: str, tok, cfg):
    """The assistant as a transformers model, refused unless it shares the target's tokenizer."""
    import transformers

    from dspark.models.loader import resolve_model_path
    from dspark.models.tokenizer import TextTokenizer

    path = resolve_model_path(name)
    other = TextTokenizer.from_dir(path)
    if other.vocab_size != tok.vocab_size or other.encode("def f(x): return x") != tok.encode("def f(x): return x"):
        raise ValueError(f"--assistant {name}: its tokenizer differs from the target's (assisted generation needs one)")
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=cfg.torch_dtype).to(cfg.device).eval()


def run(s: PeersSettings, out: str | Path) -> dict:
    import transformers

    from dspark.engine.factory import build_engine, default_spec
    from dspark.models.loader import read_config, resolve_model_path
    from dspark.models.tokenizer import TextTokenizer

    path = resolve_model_path(s.model)
    tok = TextTokenizer.from_dir(path)
    drafter, policy = default_spec(path)
    note = None
    if drafter is None:
        drafter, policy = "ngram", "dspark"
        note = "no drafter is shipped for this model: `ngram:dspark` stands in for the default drafter"
    prompts: list[Prompt] = [p for d in s.datasets for p in load_dataset(d)[: s.num_prompts]]
    context = read_config(path).max_position_embeddings
    jobs = render(tok, prompts, context - s.max_tokens - 16)
    cfg = engine_config(path, 1, max(len(j.ids) for j in jobs) + s.max_tokens + 16, s.device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=cfg.torch_dtype).to(cfg.device).eval()
    pad = tok.pad_id
    spec_label = f"dspark {drafter}:{policy}"
    spec = build_engine(path, drafter, policy, cfg, profile=s.profile)
    gamma = spec.runner.gamma
    eos = list(tok.eos_token_ids) if s.stop_at_eos else None
    n, stop = s.max_tokens, s.stop_at_eos
    systems = {
        "transformers generate": hf_system(hf, n, pad, eos=eos),
        f"transformers prompt lookup ({s.lookup_tokens})": hf_system(hf, n, pad, eos=eos,
                                                                     prompt_lookup_num_tokens=s.lookup_tokens),
        "dspark none": EngineSystem(build_engine(path, None, "none", cfg), n, stop),
        f"dspark {drafter}:static:{gamma}": EngineSystem(build_engine(path, drafter, f"static:{gamma}", cfg,
                                                                       profile=s.profile), n, stop),
        spec_label: EngineSystem(spec, n, stop),
    }
    if s.assistant:
        systems[f"transformers assisted ({Path(str(s.assistant)).name})"] = hf_system(
            hf, n, pad, assistant=assistant_model(s.assistant, tok, cfg), eos=eos)
    if drafter != "ngram":  # this engine's own prompt lookup, beside transformers', and its router
        for copier in ("ngram", "auto"):
            systems[f"dspark {copier}:dspark"] = EngineSystem(build_engine(path, copier, "dspark", cfg,
                                                                            profile=s.profile), n, stop)
    if s.llama_cpp:
        systems.update(llama_systems(s, path, tok))
    names = list(systems)
    for fn in systems.values():  # warm-up
        fn(jobs[0].ids[-32:])
        if isinstance(fn, EngineSystem):
            fn.rounds = 0
    seconds = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    same = dict.fromkeys(names, 0)
    same_plain = dict.fromkeys(names, 0)  # lossless check: greedy tokens equal this engine's plain decoding
    per_domain: dict[tuple[str, str], list[float]] = {}  # (system, domain) -> [seconds, tokens]
    extra: dict[str, list[dict]] = {n: [] for n in names}  # what an external system reported per run
    runs = [(r, i) for r in range(s.repeats) for i in range(len(jobs))]
    for r, i in tqdm(runs, desc="peers", disable=None):
        shift = (r * len(jobs) + i) % len(names)
        outputs = {}
        for name in names[shift:] + names[:shift]:
            m = _timed(lambda fn=systems[name], p=jobs[i].ids: fn(p), hf.device)
            seconds[name] += m.seconds
            tokens[name] += m.tokens
            outputs[name] = m.ids
            if m.extra:
                extra[name].append({"prompt_ids": len(jobs[i].ids), **m.extra})
            acc = per_domain.setdefault((name, jobs[i].domain), [0.0, 0])
            acc[0] += m.seconds
            acc[1] += m.tokens
        for name in names:
            same[name] += outputs[name] == outputs[names[0]]
            same_plain[name] += outputs[name] == outputs["dspark none"]
    rows = [{"system": n, "tok_s": tokens[n] / seconds[n], "tokens": tokens[n], "seconds": seconds[n],
             "vs_transformers": ratio(tokens[n] / seconds[n], tokens[names[0]] / seconds[names[0]]),
             "vs_dspark_none": ratio(tokens[n] / seconds[n], tokens["dspark none"] / seconds["dspark none"]),
             "greedy_match_fraction": same[n] / len(runs),
             "greedy_match_none_fraction": same_plain[n] / len(runs),
             "tau": tokens[n] / systems[n].rounds if isinstance(systems[n], EngineSystem) else None}
            for n in names]
    speed = {key: toks / secs for key, (secs, toks) in per_domain.items()}  # (system, domain) -> tok/s
    domains = list(dict.fromkeys(j.domain for j in jobs))
    domain_rows = [{"system": n, "domain": d, "tok_s": speed[n, d],
                    "vs_transformers": ratio(speed[n, d], speed[names[0], d]),
                    "vs_dspark_none": ratio(speed[n, d], speed["dspark none", d])} for n in names for d in domains]
    external = {n: runs for n, runs in extra.items() if runs}
    md = markdown(rows, domain_rows, s, path, note) + external_notes(external)
    payload = {"benchmark": "peers", "model": str(path), "settings": asdict(s), "drafter": drafter,
               "policy": policy, "note": note, "num_prompts": len(jobs), "rows": rows, "domain_rows": domain_rows,
               "external": external}
    report.write(out, "peers", payload, md)
    print(md)
    return payload


def external_notes(external: dict[str, list[dict]]) -> str:
    """What llama.cpp reported: its prompt lengths beside this project's, its draft acceptance."""
    if not external:
        return ""
    lines = ["\nllama.cpp times are its own (prompt evaluation + decoding, loading excluded); it bans the end token "
             "under `--ignore-eos` (all but `--stop-at-eos` runs), so its text parts from the others' after the "
             "model's first end token.\n"]
    for name, runs in external.items():
        same = sum(r["prompt_tokens"] == r["prompt_ids"] for r in runs)
        line = f"\n- {name}: prompt tokenised to dspark's length in {same} of {len(runs)} runs"
        accept = [r["accept"] for r in runs if "accept" in r and r["accept"] == r["accept"]]
        if accept:
            line += f"; draft tokens accepted {100 * sum(accept) / len(accept):.1f}% (mean over runs)"
        lines.append(line + ".")
    return "".join(lines) + "\n"


def length(s: PeersSettings) -> str:
    """How long each answer runs, as the report says it."""
    if s.stop_at_eos:
        return f"up to {s.max_tokens} new tokens (each system stops at the model's end token)"
    return f"exactly {s.max_tokens} new tokens (EOS ignored)"


def markdown(rows: list[dict], domain_rows: list[dict], s: PeersSettings, path: Path, note: str | None) -> str:
    md = [f"# Single stream: dspark vs transformers on `{model_label(path)}`\n\n",
          f"Greedy, {length(s)} per prompt, {s.num_prompts} prompts from each of "
          f"{', '.join(s.datasets)} (chat template), {s.repeats} alternating pass(es), order rotating per prompt.\n"]
    if note:
        md.append(f"\nNote: {note}.\n")
    md.append("\n" + report.table(
        ["system", "tok/s", "× transformers", "× dspark none", "τ (tokens per target step)",
         "greedy tokens = transformers", "greedy tokens = dspark none"],
        [[r["system"], r["tok_s"], r["vs_transformers"], r["vs_dspark_none"], r["tau"], r["greedy_match_fraction"],
          r["greedy_match_none_fraction"]] for r in rows]))
    domains = list(dict.fromkeys(r["domain"] for r in domain_rows))
    by = {(r["system"], r["domain"]): r for r in domain_rows}
    md.append("\nPer domain: tok/s (× dspark none)\n\n" + report.table(
        ["system", *domains],
        [[n, *(f"{by[n, d]['tok_s']:.1f} ({by[n, d]['vs_dspark_none']:.2f}×)" for d in domains)]
         for n in dict.fromkeys(r["system"] for r in domain_rows)]))
    return "".join(md)
