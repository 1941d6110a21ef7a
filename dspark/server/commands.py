"""`dspark serve`: the OpenAI-compatible HTTP server (needs the `server` extra).

    dspark serve --model PATH --port 8000 --max-num-seqs 64 --max-waiting 256
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0}'

Only argument parsing lives here (importing it never imports FastAPI); see launch.py.
--model/--device/--dtype and --drafter/--policy/--gamma are the CLI's shared engine options.
"""

from __future__ import annotations

import argparse


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: the directory name)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch")
    p.add_argument("--max-waiting", type=int, default=256, help="requests queued beyond the batch; more get 503")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: by memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds SIGTERM waits for in-flight requests")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dspark.server.app import ServeSettings, create_app
    from dspark.server.launch import build_engine, drafter_name, model_name, serve

    if args.max_waiting < 0:
        raise ValueError("--max-waiting must be >= 0")
    engine = build_engine(args)
    settings = ServeSettings(model_name=model_name(args), max_waiting=args.max_waiting,
                             drafter=drafter_name(engine), policy=engine.policy.name)
    serve(create_app(engine, settings), args.host, args.port, args.log_level, args.drain_timeout)
    return 0
