"""`dspark bench exact`: on this machine, is greedy speculative output plain greedy output, token for token?

Every configuration (`DRAFTER:POLICY`) decodes the same prompts greedily, exactly `--max-tokens` tokens each
(EOS ignored), once with each prompt alone and once with `n` prompts started together for each n in
`--concurrency`; so does plain decoding (`none`). The report counts, per configuration and concurrency, the
prompts whose tokens equal plain decoding's at the same concurrency and plain decoding's alone, and names the
first differing token.

Alone, the engine gives a row the logits a plain step gives it, bit for bit (`docs/architecture.md`,
exactness), so every cell must hold all the prompts; the command exits with status 1 where one does not.
Together, a step's products have many rows; where this CPU's kernels round a row of a large product
otherwise than the same row of a small one, plain decoding itself depends on what shares its steps (the
`none` row against plain alone), and a drafter, whose steps hold other rows, can part from it on a near tie.

    dspark bench exact                                   # every drafter x {static:7, dspark}; 1 and 12 together
    dspark bench exact --configs 'ngram:dspark' --concurrency 1
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark import report
from dspark.bench.prompts import ONE_PER_DOMAIN, load_dataset
from dspark.sampling import SamplingParams

DRAFTERS = ("dspark", "dflash", "eagle3", "mtp", "ngram", "suffix", "auto")
POLICIES = ("static:7", "dspark")


@dataclass(frozen=True)
class ExactSettings:
    model: str | None = None
    configs: tuple[str, ...] = tuple(f"{d}:{p}" for d in DRAFTERS for p in POLICIES)
    num_prompts: int = 4  # per dataset
    max_tokens: int = 128
    concurrency: tuple[int, ...] = (1, 12)  # 1: each prompt alone; n: n prompts started together
    device: str | None = None  # default: cuda when available


def parse_config(name: str) -> tuple[str, str]:
    """'ngram:dspark' -> ('ngram', 'dspark'); plain decoding is the reference, not a configuration."""
    drafter, sep, policy = name.partition(":")
    if not sep or not drafter or not policy or drafter == "none":
        raise ValueError(f"config {name!r}: use DRAFTER:POLICY, e.g. ngram:dspark (plain decoding is the reference)")
    return drafter, policy


def decode(engine, prompts: list[list[int]], max_tokens: int, together: int) -> list[list[int]]:
    """Greedy tokens of every prompt, `together` prompts started at once, in prompt order."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out: list[list[int]] = []
    for i in range(0, len(prompts), together):
        if engine.drafter is not None:
            engine.drafter.forget()  # a copy drafter starts from what these prompts hold, as a fresh server does
        reqs = [engine.add_request(p, params) for p in prompts[i : i + together]]
        out += [o.token_ids for o in engine.run_until_done(reqs)]
    return out


def first_difference(got: list[list[int]], want: list[list[int]]) -> tuple[int, int] | None:
    """(prompt, token) of the first token that differs, or None."""
    for p, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            return p, next((t for t, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return None


def row(config: str, together: int, got: list[list[int]], same: list[list[int]], alone: list[list[int]]) -> dict:
    return {"config": config, "together": together, "prompts": len(got),
            "equal_same": sum(a == b for a, b in zip(got, same, strict=True)),
            "equal_alone": sum(a == b for a, b in zip(got, alone, strict=True)),
            "first_difference": first_difference(got, same)}


def run(settings: ExactSettings, out_dir: str) -> dict:
    from dspark.bench.workload import engine_config, render
    from dspark.engine.factory import build_engine
    from dspark.models.loader import load_model, model_label, read_config, resolve_model_path
    from dspark.models.tokenizer import TextTokenizer

    specs = {name: parse_config(name) for name in settings.configs}
    if not settings.concurrency or min(settings.concurrency) < 1:
        raise ValueError("--concurrency: one or more numbers of prompts started together, each at least 1")
    path = resolve_model_path(settings.model)
    tok = TextTokenizer.from_dir(path)
    limit = read_config(path).max_position_embeddings - settings.max_tokens - 16  # room for the answer and a draft
    texts = [p for d in ONE_PER_DOMAIN for p in load_dataset(d)[: settings.num_prompts]]
    prompts = [job.ids for job in render(tok, texts, limit)]  # chat template, the prompt's end kept
    cfg = engine_config(path, max(settings.concurrency), max(map(len, prompts)) + settings.max_tokens + 16,
                        settings.device)
    loaded = load_model(path, cfg.device, cfg.dtype)
    plain = build_engine(path, None, "none", cfg, loaded=loaded)
    ref = {c: decode(plain, prompts, settings.max_tokens, c) for c in sorted({1, *settings.concurrency})}
    rows = [row("none", c, ref[c], ref[c], ref[1]) for c in settings.concurrency if c > 1]
    for name, (drafter, policy) in specs.items():
        engine = build_engine(path, drafter, policy, cfg, loaded=loaded)
        rows += [row(name, c, decode(engine, prompts, settings.max_tokens, c), ref[c], ref[1])
                 for c in settings.concurrency]
    payload = {"settings": settings.__dict__ | {"configs": list(settings.configs),
                                                "concurrency": list(settings.concurrency)},
               "model": model_label(path), "dtype": cfg.dtype, "prompts": len(prompts), "rows": rows,
               "alone_exact": all(r["equal_same"] == r["prompts"] for r in rows if r["together"] == 1)}
    report.write(out_dir, "exact", payload, markdown(payload))
    return payload


def markdown(payload: dict) -> str:
    s = payload["settings"]
    head = (f"# Greedy speculative output against plain decoding: model `{payload['model']}`, {payload['dtype']}\n\n"
            f"Exactly {s['max_tokens']} tokens (EOS ignored) for each of {payload['prompts']} prompts"
            f" ({s['num_prompts']} from each of {', '.join(ONE_PER_DOMAIN)}); 'together' prompts started at once. "
            "Alone every cell must hold every prompt; together, the `none` rows show how much plain decoding itself "
            "depends on what shares its steps here.\n\n")
    cells = [[f"`{r['config']}`", r["together"], f"{r['equal_same']} / {r['prompts']}",
              f"{r['equal_alone']} / {r['prompts']}",
              "–" if r["first_difference"] is None else "prompt {}, token {}".format(*r["first_difference"])]
             for r in payload["rows"]]
    verdict = ("\nAlone, every configuration equalled plain decoding on every prompt.\n" if payload["alone_exact"]
               else "\n**Alone, a configuration parted from plain decoding: not lossless on this machine.**\n")
    return head + report.table(["config", "together", "= plain, same together", "= plain alone",
                                "first difference (against the same together)"], cells) + verdict
