"""`dspark train ...` subcommands: corpus, tokenizer, target (drafters join in [D]).

    dspark train corpus --out ~/.cache/dspark/corpus
    dspark train tokenizer --corpus ~/.cache/dspark/corpus --out ~/.cache/dspark/tokenizer \
        --tokens ~/.cache/dspark/tokens
    dspark train target --config configs/target-tiny.toml
"""

from __future__ import annotations

import argparse
import json


def add_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="train_command", required=True)
    c = sub.add_parser("corpus", help="build the math/code/chat corpus with held-out splits")
    c.add_argument("--gsm8k", default=None)
    c.add_argument("--docs", default=None)
    c.add_argument("--stdlib", default="")
    c.add_argument("--out", default="~/.cache/dspark/corpus")
    c.set_defaults(func=run_corpus)
    t = sub.add_parser("tokenizer", help="train the byte-level BPE and tokenise the corpus")
    t.add_argument("--corpus", default="~/.cache/dspark/corpus")
    t.add_argument("--out", default="~/.cache/dspark/tokenizer")
    t.add_argument("--tokens", default="~/.cache/dspark/tokens")
    t.add_argument("--vocab-size", type=int, default=8192)
    t.set_defaults(func=run_tokenizer)
    m = sub.add_parser("target", help="train the target (resumes from its run directory)")
    m.add_argument("--config", required=True)
    m.set_defaults(func=run_target)


def run(args: argparse.Namespace) -> int:
    return args.func(args)


def run_corpus(args: argparse.Namespace) -> int:
    from dspark.train.corpus import CorpusConfig, build

    cfg = CorpusConfig(**{k: v for k, v in {"gsm8k": args.gsm8k, "docs": args.docs}.items() if v}, stdlib=args.stdlib)
    print(json.dumps(build(cfg, args.out), indent=2))
    return 0


def run_tokenizer(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dspark.train.corpus import DOMAINS, read_records, render
    from dspark.train.tokenizer import save_hf_tokenizer, train_bpe
    from dspark.train.tokens import encode_corpus

    corpus = Path(args.corpus).expanduser()
    texts = [render(r) for d in DOMAINS for r in read_records(corpus / f"{d}.train.jsonl")]
    tok = train_bpe(texts, args.vocab_size)
    save_hf_tokenizer(tok, Path(args.out).expanduser())
    print(json.dumps({"tokens": encode_corpus(corpus, tok, args.tokens)}, indent=2))
    return 0


def run_target(args: argparse.Namespace) -> int:
    from dspark.train.target import TargetTrainConfig, train

    train(TargetTrainConfig.from_file(args.config))
    return 0
