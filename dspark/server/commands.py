"""`dspark serve`: the OpenAI-compatible HTTP server (needs the `server` extra).

    dspark serve --model PATH --port 8000 --max-num-seqs 64 --max-waiting 256
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0}'

    dspark serve --backend ray --replicas 2 [--autoscale 1,4]   # Ray Serve (docs/scaling.md)

Only argument parsing lives here (importing it never imports FastAPI or Ray); see launch.py
and ray_backend.py. --model/--device/--dtype and --drafter/--policy/--gamma are the CLI's
shared engine options.
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
    p.add_argument("--api-key", default=None,
                   help="clients must send 'Authorization: Bearer KEY' on /v1/* (default: $DSPARK_API_KEY; none: open)")
    p.add_argument("--metrics-auth", action="store_true", help="/metrics needs the API key too")
    add_ray_args(p)
    p.set_defaults(func=run)


def add_ray_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="local: one process (default); ray: Ray Serve replicas, one engine each")
    p.add_argument("--replicas", type=int, default=1, help="ray: engine replicas (with --autoscale: the initial count)")
    p.add_argument("--autoscale", type=min_max, default=None, metavar="MIN,MAX",
                   help="ray: let Ray Serve scale the replicas between MIN and MAX")
    p.add_argument("--ray-address", default=None,
                   help="ray: cluster to join (default: one started with `ray start` on this node, else a new local one)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="ray: CPUs reserved per replica")
    p.add_argument("--replica-gpus", type=float, default=None, help="ray: GPUs per replica (default: 1 with --device cuda*)")


def min_max(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (two integers), got {text!r}") from None
    if not 0 <= lo <= hi or hi < 1:
        raise argparse.ArgumentTypeError(f"need 0 <= MIN <= MAX and MAX >= 1, got {text!r}")
    return lo, hi


def run(args: argparse.Namespace) -> int:
    from dspark.server.auth import resolve_api_key

    args.api_key = resolve_api_key(args.api_key)  # here: Ray replicas get it with the other arguments
    if args.backend == "ray":
        from dspark.server.ray_backend import run as run_ray  # imports Ray: only on this path

        return run_ray(args)
    from dspark.server.launch import build_app, serve

    serve(build_app(args), args.host, args.port, args.log_level, args.drain_timeout)
    return 0
