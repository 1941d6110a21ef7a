"""`dspark train ...` subcommands: corpus, tokenizer, target, regen, drafter(s), eval-target, eval-drafter, walk.

    dspark train corpus --out ~/.cache/dspark/corpus
    dspark train tokenizer --corpus ~/.cache/dspark/corpus --out ~/.cache/dspark/tokenizer \
        --tokens ~/.cache/dspark/tokens
    dspark train target --config configs/target-tiny.toml
    dspark train drafters --config A.toml --config B.toml   # several drafters, one target pass per batch
    dspark train eval-target --model ~/.cache/dspark/export/dspark-tiny-target --out eval.json
    dspark train eval-drafter --config A.toml --drafter DIR --drafter DIR2   # one set of held-out batches
                                                     [--heldout greedy.jsonl]
    dspark train walk --config A.toml --drafter DIR --data answers.jsonl --out walked.jsonl   # walked anchors
"""

from __future__ import annotations

import argparse
import json

from dspark.train.styles import STYLES


def add_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="train_command", required=True)
    c = sub.add_parser("corpus", help="build the math/code/chat corpus with held-out splits")
    c.add_argument("--gsm8k", default=None)
    c.add_argument("--docs", default=None)
    c.add_argument("--stdlib", default="")
    c.add_argument("--max-response-chars", type=int, default=2400, help="clip chat answers (paragraph boundary)")
    c.add_argument("--max-function-lines", type=int, default=60, help="leave out longer functions as code tasks")
    c.add_argument("--no-raw-code", action="store_true", help="code: only the chat-form function tasks, no raw files")
    c.add_argument("--out", default="~/.cache/dspark/corpus")
    c.set_defaults(func=run_corpus)
    t = sub.add_parser("tokenizer", help="train the byte-level BPE and tokenise the corpus")
    t.add_argument("--corpus", default="~/.cache/dspark/corpus")
    t.add_argument("--out", default="~/.cache/dspark/tokenizer")
    t.add_argument("--tokens", default="~/.cache/dspark/tokens")
    t.add_argument("--vocab-size", type=int, default=8192)
    t.add_argument("--existing", action="store_true", help="keep the tokenizer in --out; only tokenise the corpus")
    t.set_defaults(func=run_tokenizer)
    m = sub.add_parser("target", help="train the target (resumes from its run directory)")
    m.add_argument("--config", required=True)
    m.set_defaults(func=run_target)
    r = sub.add_parser("regen", help="the target answers the training prompts (drafter data)")
    r.add_argument("--model", default="dspark-tiny")
    r.add_argument("--corpus", default="~/.cache/dspark/corpus")
    r.add_argument("--split", default="train", choices=["train", "heldout"])
    r.add_argument("--out", required=True)
    r.add_argument("--per-domain", type=int, default=2000)
    r.add_argument("--max-tokens", type=int, default=256)
    r.add_argument("--batch", type=int, default=64)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--temperature", type=float, default=0.7, help="0: greedy answers (default 0.7, top-p 0.8, top-k 20)")
    r.add_argument("--style", default="corpus", choices=STYLES,
                   help="the prompts' wording: the corpus's, served traffic's (boxed math answers, code with tests, "
                        "open chat instructions), or either at even odds (`train/styles.py`)")
    r.add_argument("--domains", type=lambda v: [d.strip() for d in v.split(",") if d.strip()], default=None,
                   help="comma-separated domains to answer (default: every domain the corpus has), e.g. code")
    r.set_defaults(func=run_regen)
    d = sub.add_parser("drafter", help="train a drafter against the frozen target (resumes)")
    d.add_argument("--kind", required=True, choices=["dspark", "dflash", "eagle3", "mtp"])
    d.add_argument("--config", required=True)
    d.set_defaults(func=run_drafter)
    j = sub.add_parser("drafters", help="train several drafters side by side on one target pass per batch (resumes)")
    j.add_argument("--config", action="append", required=True, help="a drafter config (kind inside); repeat")
    j.set_defaults(func=run_drafters)
    e = sub.add_parser("eval-target", help="held-out loss, loop rate and samples of a target (model card)")
    e.add_argument("--model", required=True)
    e.add_argument("--corpus", default="~/.cache/dspark/corpus")
    e.add_argument("--tokens", default="~/.cache/dspark/tokens")
    e.add_argument("--num-prompts", type=int, default=50)
    e.add_argument("--max-tokens", type=int, default=256)
    e.add_argument("--device", default="cpu")
    e.add_argument("--out", default=None, help="write the results as JSON here")
    e.set_defaults(func=run_eval_target)
    v = sub.add_parser("eval-drafter", help="held-out teacher-forced acceptance of saved drafters, side by side")
    v.add_argument("--config", required=True, help="a drafter training config: target, held-out data, batches")
    v.add_argument("--drafter", action="append", default=[], help="a drafter directory; repeat")
    v.add_argument("--anchors", type=int, default=0, help="anchors per held-out sequence (0: the config's)")
    v.add_argument("--heldout", default=None, help="held-out answers to measure on instead of the config's "
                   "(e.g. greedy ones, `regen --temperature 0`)")
    v.add_argument("--out", default=None, help="write the results as JSON here")
    v.set_defaults(func=run_eval_drafter)
    w = sub.add_parser("walk", help="where a greedy run's rounds start along each answer (walked anchors)")
    w.add_argument("--config", required=True, help="a drafter training config: target, window")
    w.add_argument("--drafter", required=True, help="the drafter directory to walk with")
    w.add_argument("--data", required=True, help="answers (`regen --temperature 0`)")
    w.add_argument("--out", required=True, help="the answers again, each with `walk`")
    w.set_defaults(func=run_walk)


def run(args: argparse.Namespace) -> int:
    return args.func(args)


def run_corpus(args: argparse.Namespace) -> int:
    from dspark.train.corpus import CorpusConfig, build

    cfg = CorpusConfig(**{k: v for k, v in {"gsm8k": args.gsm8k, "docs": args.docs}.items() if v}, stdlib=args.stdlib,
                       max_response_chars=args.max_response_chars, max_function_lines=args.max_function_lines,
                       raw_code=not args.no_raw_code)
    print(json.dumps(build(cfg, args.out), indent=2))
    return 0


def run_tokenizer(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenizers import Tokenizer

    from dspark.train.corpus import DOMAINS, read_records, render
    from dspark.train.tokenizer import save_hf_tokenizer, train_bpe
    from dspark.train.tokens import encode_corpus

    corpus, out = Path(args.corpus).expanduser(), Path(args.out).expanduser()
    if args.existing:
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    else:
        tok = train_bpe([render(r) for d in DOMAINS for r in read_records(corpus / f"{d}.train.jsonl")], args.vocab_size)
        save_hf_tokenizer(tok, out)
    print(json.dumps({"tokens": encode_corpus(corpus, tok, args.tokens)}, indent=2))
    return 0


def run_regen(args: argparse.Namespace) -> int:
    from dspark.train.regen import regenerate

    n = regenerate(args.model, args.corpus, args.out, args.split, args.per_domain, args.max_tokens, args.batch, args.seed,
                   temperature=args.temperature, style=args.style, domains=args.domains)
    print(f"{n} prompts answered -> {args.out}")
    return 0


def run_drafter(args: argparse.Namespace) -> int:
    from dspark.train.drafter import DrafterTrainConfig, train

    print(json.dumps(train(DrafterTrainConfig.from_file(args.config, kind=args.kind)), indent=2))
    return 0


def run_drafters(args: argparse.Namespace) -> int:
    from dspark.train.drafter import DrafterTrainConfig
    from dspark.train.joint import train_joint

    print(json.dumps(train_joint([DrafterTrainConfig.from_file(c) for c in args.config]), indent=2))
    return 0


def run_target(args: argparse.Namespace) -> int:
    from dspark.train.target import TargetTrainConfig, train

    train(TargetTrainConfig.from_file(args.config))
    return 0


def run_eval_target(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dspark.report import stamp
    from dspark.train.evaluate import EvalSettings, evaluate, render_markdown

    settings = EvalSettings(num_prompts=args.num_prompts, max_tokens=args.max_tokens, device=args.device)
    result = {**stamp(), **evaluate(args.model, args.corpus, args.tokens, settings)}
    if args.out:
        Path(args.out).expanduser().write_text(json.dumps(result, indent=2))
    print(render_markdown(result))
    return 0


def run_eval_drafter(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dspark.report import stamp
    from dspark.train.drafter import DrafterTrainConfig
    from dspark.train.eval_drafter import evaluate_drafters

    overrides = {"heldout": args.heldout} if args.heldout else {}
    cfg = DrafterTrainConfig.from_file(args.config, **overrides)
    result = {**stamp(), **evaluate_drafters(cfg, args.drafter, args.anchors)}
    if args.out:
        Path(args.out).expanduser().write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


def run_walk(args: argparse.Namespace) -> int:
    from dspark.train.drafter import DrafterTrainConfig
    from dspark.train.walked import write_walks

    print(json.dumps(write_walks(DrafterTrainConfig.from_file(args.config), args.drafter, args.data, args.out)))
    return 0
