"""The `dspark` command line (also `python -m dspark`).

    dspark generate [--model PATH] [--temperature T] [--top-p P] [--top-k K] [--max-tokens N]
                    [--seed S] [--chat] [--json] PROMPT
    dspark serve [--model PATH] [--drafter NAME] [--policy P] [--host H] [--port N] ...
    dspark train corpus|tokenizer|target ...
    dspark bench decode ...
    dspark export-drafter --drafter DIR --format deepspec|speculators --out DIR

Each subcommand's work lives in its own module; this file only parses arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF-format directory, 'dspark-small' (default) or 'dspark-tiny'")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default="", help="float32, bfloat16, float16 (default: bfloat16 on CUDA and on CPUs with native bfloat16, else float32)")
    p.add_argument("--pad-rows", type=int, default=None, metavar="N",
                   help="one-token rows share the verify rows' attention grid while that pads them by at most N "
                        "query rows (default 48; 0: two grids; `EngineConfig.pad_rows`)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", default=None, help="dspark | dflash | eagle3 | mtp | ngram | suffix | auto (dspark+suffix) | NAME+suffix | DEEP+ONE (dspark+mtp) | PATH")
    p.add_argument("--policy", default=None, help="none | static:K | threshold:T | dspark | dspark-async")
    p.add_argument("--gamma", type=int, default=None, help="draft block size (<= the drafter's)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="draft from the N most frequent tokens (0: all; default: the drafter's own setting; "
                        "counts from `dspark draft-vocab`)")
    p.add_argument("--gate", default="", metavar="KEY=VALUE,...",
                   help="options of the never-slower gate of the dspark policies, e.g. enabled=0 or cut=0 "
                        "(`GateConfig` in dspark/engine/gate.py)")


def engine_config(args: argparse.Namespace, **extra):
    from dspark.config import PAD_ROWS, EngineConfig, default_device

    pad = PAD_ROWS if getattr(args, "pad_rows", None) is None else args.pad_rows
    return EngineConfig(device=args.device or default_device(), dtype=args.dtype, pad_rows=pad, **extra)


def cmd_generate(args: argparse.Namespace) -> int:
    from dspark.llm import LLM
    from dspark.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(args.model, engine_config(args), drafter=args.drafter, policy=args.policy, gamma=args.gamma,
              draft_vocab=args.draft_vocab, gate=args.gate)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    out = llm.generate([prompt], params)[0]
    if args.json:
        print(json.dumps(out.as_dict()))
    else:
        print(out.text)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from dspark.train import commands

    return commands.run(args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from dspark.bench.prompts import read_prompts
    from dspark.train.calibrate import calibrate
    from dspark.train.regen import chat_prompts

    if args.prompts:
        texts = [p.text for p in read_prompts(args.prompts)][: args.num_prompts]
    else:
        per = max(1, args.num_prompts // 3)
        texts = [t for _, t in chat_prompts(args.corpus, "heldout", per)]
        if len(texts) < 2:
            raise ValueError(f"no held-out prompts in {args.corpus}: build the corpus first (dspark train corpus "
                             f"--out {args.corpus}) or name prompts with --prompts FILE.jsonl")
    calibrate(args.model, args.drafter, texts, args.out, args.max_tokens, args.temperature, write=not args.no_write)
    return 0


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    from dspark.drafters.vocab import count_tokens, coverage, expected_counts, write_counts
    from dspark.models.loader import resolve_model_path
    from dspark.models.tokenizer import TextTokenizer

    model_dir = resolve_model_path(args.model)
    tok = TextTokenizer.from_dir(model_dir)
    rows = []
    for name in args.data:
        with open(name) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    if args.expected:
        from dspark.models.loader import load_target

        counts = expected_counts(rows, load_target(model_dir, args.device or "cpu", "float32"), tok)
    else:
        counts = count_tokens(rows, tok)
    path = write_counts(model_dir, counts, " ".join(args.data), "expected" if args.expected else "sampled")
    print(f"{path}: {len(rows)} rows")
    sizes = [s for s in (256, 512, 1024, 2048, 4096) if s < tok.vocab_size]
    for size, share in coverage(model_dir, sizes).items():
        print(f"  top {size:5d} tokens cover {share:.1%} of the counted tokens")
    return 0


def cmd_export_drafter(args: argparse.Namespace) -> int:
    from dspark.drafters.formats.export import export

    out = export(args.drafter, args.model, args.format, args.out, args.verifier)
    print(f"wrote {args.format} drafter to {out}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from dspark.engine.factory import build_engine
    from dspark.engine.gate import GateConfig

    engine = build_engine(args.model, args.drafter, args.policy or "dspark", engine_config(args),
                          gamma=args.gamma, profile="refresh" if args.refresh else "auto",
                          draft_vocab=args.draft_vocab, gate=GateConfig.parse(args.gate))
    prof = engine.runner.profile
    if prof is None:
        print("no step profile: this engine weighs no costs (name a drafter and a cost-weighing policy)")
        return 2
    print(f"profile {prof.key}: target forward seconds by tokens B, drafter proposal seconds by requests R")
    for b, t in zip(prof.tokens, prof.verify_s, strict=True):
        print(f"  verify B={b:5d}  {t * 1000:8.2f} ms  SPS={1 / t:8.1f}")
    for r, extra, secs in zip(prof.rows, prof.row_extra, prof.row_s, strict=True):
        shapes = "  ".join(f"+{x}: {t * 1000:.2f} ms" for x, t in zip(extra, secs, strict=True))
        print(f"  rows R={r:5d}  tokens beyond one per row {shapes}")
    shallow = prof.shallow_s or [None] * len(prof.requests)
    pair = prof.pair_s or [None] * len(prof.requests)
    sampled = prof.sampled_s or [None] * len(prof.requests)
    for r, t, one, two, hot in zip(prof.requests, prof.draft_s, shallow, pair, sampled, strict=True):
        cut = "" if one is None else f"  (one position: {one * 1000:8.2f} ms)"
        cut += "" if two is None else f"  (two: {two * 1000:8.2f} ms)"
        every = "" if hot is None else f"  (sampling, every token: {hot * 1000:8.2f} ms)"
        print(f"  draft  R={r:5d}  {t * 1000:8.2f} ms{cut}{every}")
    if args.plot:
        from dspark.spec.profile import plot

        plot(prof, args.plot)
        print(f"plot -> {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(g)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_spec_args(g)
    g.add_argument("--json", action="store_true", help="print text, token_ids, finish_reason and stats as JSON")
    g.add_argument("prompt")
    g.set_defaults(func=cmd_generate)

    from dspark.server.commands import add_parser as add_serve

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics")
    add_engine_args(s)
    add_spec_args(s)
    add_serve(s)

    c = sub.add_parser("calibrate", help="fit STS temperatures of a drafter's confidence head")
    c.add_argument("--drafter", required=True, help="drafter directory (its config.json gets the temperatures)")
    c.add_argument("--model", default=None)
    c.add_argument("--prompts", default=None, help="JSONL prompts (default: held-out corpus prompts)")
    c.add_argument("--corpus", default="~/.cache/dspark/corpus")
    c.add_argument("--num-prompts", type=int, default=150)
    c.add_argument("--max-tokens", type=int, default=128)
    c.add_argument("--temperature", type=float, default=1.0)
    c.add_argument("--out", default="docs/results/calibration")
    c.add_argument("--no-write", action="store_true", help="report only; leave config.json unchanged")
    c.set_defaults(func=cmd_calibrate)

    v = sub.add_parser("draft-vocab", help="count the target's tokens (for --draft-vocab N)")
    v.add_argument("--model", default=None, help="the model directory that gets token_counts.json")
    v.add_argument("--data", nargs="+", required=True,
                   help="JSONL rows with `response_ids` (dspark train regen output) or `text`")
    v.add_argument("--expected", action="store_true",
                   help="sum the target's temperature-1 distributions instead of counting the sampled tokens")
    v.add_argument("--device", default=None, help="where the target runs for --expected (default cpu)")
    v.set_defaults(func=cmd_draft_vocab)

    x = sub.add_parser("export-drafter", help="write a dspark DSpark drafter as a DeepSpec or speculators checkpoint")
    x.add_argument("--model", default=None, help="the target directory (default dspark-small)")
    x.add_argument("--drafter", default="dspark", help="a shipped name or a drafter directory")
    x.add_argument("--format", required=True, choices=["deepspec", "speculators"])
    x.add_argument("--out", required=True, help="output directory")
    x.add_argument("--verifier", default=None, help="speculators: the verifier's name or path (default: --model's directory)")
    x.set_defaults(func=cmd_export_drafter)
    p = sub.add_parser("profile", help="measure/print the step-cost profile (SPS and draft time)")
    add_engine_args(p)
    add_spec_args(p)
    p.add_argument("--refresh", action="store_true", help="measure again even if cached")
    p.add_argument("--plot", default=None, help="write a PNG of the profile")
    p.set_defaults(func=cmd_profile)

    from dspark.train.commands import add_parser as add_train

    add_train(sub.add_parser("train", help="build the corpus, tokenizer, target and drafters"))

    from dspark.bench.commands import add_parser as add_bench

    add_bench(sub.add_parser("bench", help="benchmarks that write docs/results/"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"dspark: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader left (`dspark generate ... | head`): stop quietly, as Unix tools do; stdout goes to
        # /dev/null so that the interpreter's last flush at exit does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool a closed pipe stopped


if __name__ == "__main__":
    sys.exit(main())
