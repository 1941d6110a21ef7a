"""`dspark bench ...` subcommands. Results go to docs/results/ by default."""

from __future__ import annotations

import argparse


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", required=True)
    d = sub.add_parser("decode", help="plain decoding: this engine vs transformers generate()")
    d.add_argument("--model", default=None)
    d.add_argument("--concurrency", type=_ints, default=[1, 16])
    d.add_argument("--max-tokens", type=int, default=128)
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--quick", action="store_true", help="a ~1 minute smoke run (never a speed claim)")
    d.add_argument("--out", default=None)
    d.set_defaults(func=run_decode)


def run_decode(args: argparse.Namespace) -> int:
    from dspark.bench import decode
    from dspark.bench.report import DEFAULT_OUT

    if args.quick:
        args.concurrency, args.max_tokens, args.repeats = [1, 4], 16, 1
    decode.run(args.model, args.concurrency, args.max_tokens, args.repeats, args.out or (
        "/tmp/dspark-bench-quick" if args.quick else DEFAULT_OUT))
    return 0
