"""`dspark serve --backend ray`: the same OpenAI-compatible app, one engine per Ray Serve replica.

    dspark serve --backend ray --replicas 2 --model PATH --port 8000
    dspark serve --backend ray --autoscale 1,4 --device cuda          # Ray Serve scales 1..4
    ray start --head; dspark serve --backend ray --replicas 8         # join a running cluster

Each replica process builds its engine and the FastAPI app of app.py (`launch.build_app`),
so routes, streaming, errors and draining are the single-process server's. Ray Serve's proxy
routes every request to a replica (and queues beyond `--max-num-seqs + --max-waiting` in
flight per replica); `--autoscale MIN,MAX` hands the replica count to Ray Serve's autoscaler,
which aims at `--max-num-seqs` requests in flight per replica (a full running batch).

Every response carries an `x-dspark-replica` header. Metrics: each replica pushes its own
Prometheus text to a `MetricsHub` deployment every second; `GET /metrics` (answered by any
replica) returns all replicas' metrics merged, each sample labelled `replica="<id>"`.
`--api-key` (or DSPARK_API_KEY, read where `dspark serve` runs) reaches every replica with
the other arguments, so each replica's app checks it (auth.py), /metrics too with --metrics-auth.
Only this module imports Ray; the `local` backend never loads it (commands.py imports it lazily).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading
import time
from typing import Any

from ray import serve
from starlette.responses import Response

from dspark.server.auth import refused, send_unauthorized
from dspark.server.metrics import CONTENT_TYPE
from dspark.server.metrics_merge import merge_metrics

log = logging.getLogger("dspark.server")
APP_NAME = "dspark"
REPLICA_HEADER = "x-dspark-replica"
PUSH_INTERVAL_S = 1.0  # how often a replica sends its metrics to the hub
STALE_AFTER_S = 30.0  # a replica silent this long (gone, or scaled down) leaves /metrics

_replica: DsparkReplica | None = None  # the replica of this worker process (Serve runs one per process)


def set_replica(replica: DsparkReplica) -> None:
    """Called from the replica's __init__. A function of this module, so the write lands in this
    module's globals: Ray pickles the deployment class by value, with its own globals dict."""
    global _replica
    _replica = replica


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})  # a push every second: no log line each
class MetricsHub:
    """The latest Prometheus text of every replica; merges them on request."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, str]] = {}  # replica -> (monotonic time, text)

    def push(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def merged(self) -> bytes:
        now = time.monotonic()
        self._texts = {r: v for r, v in self._texts.items() if now - v[0] < STALE_AFTER_S}
        return merge_metrics({r: text for r, (_, text) in self._texts.items()})


class ReplicaAsgi:
    """The ASGI app Serve's ingress holds. Serve takes the app when the class is defined,
    but ours needs the replica's engine, built in the replica's __init__: so this forwards
    to the app of the replica living in this process, adding the replica header, and it
    answers GET /metrics with the merged metrics of all replicas."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        replica = _replica
        if replica is None:
            raise RuntimeError("the dspark replica of this process is not initialised")
        replica.start_pushing()  # the first call (lifespan startup) runs in Serve's event loop
        if scope["type"] != "http":
            await replica.fastapi(scope, receive, send)
            return
        send = with_header(send, REPLICA_HEADER, replica.replica_id)
        settings = replica.fastapi.state.settings
        if refused(scope, settings.api_key, settings.metrics_auth):  # the app's own guard never sees /metrics
            await send_unauthorized(send)
        elif scope["path"] == "/metrics" and scope["method"] == "GET":
            await Response(await replica.merged_metrics(), media_type=CONTENT_TYPE)(scope, receive, send)
        else:
            await replica.fastapi(scope, receive, send)


def with_header(send: Any, name: str, value: str) -> Any:
    """An ASGI `send` that adds one header to the response start."""
    raw = (name.encode("latin-1"), value.encode("latin-1"))

    async def wrapped(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), raw]}
        await send(message)

    return wrapped


@serve.deployment
@serve.ingress(ReplicaAsgi())
class DsparkReplica:
    """One engine and its FastAPI app; `options` are `dspark serve`'s arguments."""

    def __init__(self, options: dict[str, Any], hub: Any) -> None:
        from dspark.server.launch import build_app

        self.fastapi = build_app(argparse.Namespace(**options))
        self.hub = hub  # DeploymentHandle of MetricsHub
        self.replica_id = serve.get_replica_context().replica_tag
        self._pusher: asyncio.Task | None = None
        set_replica(self)

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        dead = self.fastapi.state.aengine.dead
        if dead is not None:
            raise RuntimeError(f"the engine loop died: {dead!r}")

    def metrics_text(self) -> str:
        return self.fastapi.state.metrics.render().decode()

    async def merged_metrics(self) -> bytes:
        try:
            await self.hub.push.remote(self.replica_id, self.metrics_text())  # this replica's, fresh
            return await self.hub.merged.remote()
        except Exception as exc:  # no hub (restarting): at least this replica's own metrics
            log.warning("metrics hub unavailable: %r", exc)
            return merge_metrics({self.replica_id: self.metrics_text()})

    def start_pushing(self) -> None:
        if self._pusher is None:
            self._pusher = asyncio.get_running_loop().create_task(self._push_forever())

    async def _push_forever(self) -> None:
        while True:
            try:
                await self.hub.push.remote(self.replica_id, self.metrics_text())
            except Exception as exc:  # the hub restarting: try again next time
                log.warning("metrics push failed: %r", exc)
            await asyncio.sleep(PUSH_INTERVAL_S)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments a replica needs to build its engine and app (picklable, no callables)."""
    return {k: v for k, v in vars(args).items() if not callable(v)}


def deployment_options(args: argparse.Namespace) -> dict[str, Any]:
    """Ray Serve options of the replica deployment, from `dspark serve` arguments."""
    if args.replicas < 1:
        raise ValueError("--replicas must be >= 1")
    gpus = args.replica_gpus
    if gpus is None:
        gpus = 1.0 if (args.device or "").startswith("cuda") else 0.0
    opts: dict[str, Any] = {
        "name": APP_NAME,
        "max_ongoing_requests": args.max_num_seqs + args.max_waiting,  # the replica's own capacity
        "graceful_shutdown_timeout_s": args.drain_timeout,
        "ray_actor_options": {"num_cpus": args.replica_cpus, "num_gpus": gpus},
    }
    if args.autoscale is None:
        opts["num_replicas"] = args.replicas
    else:
        lo, hi = args.autoscale
        opts["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi,
                                      "initial_replicas": min(max(args.replicas, lo), hi),
                                      "target_ongoing_requests": args.max_num_seqs}
    return opts


def build_application(args: argparse.Namespace):  # -> ray.serve.Application
    replicas = DsparkReplica.options(**deployment_options(args))
    return replicas.bind(engine_options(args), MetricsHub.bind())


def deploy(args: argparse.Namespace) -> None:
    """Start Serve's HTTP proxy on --host/--port and run the app; returns once replicas are up."""
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_application(args), name=APP_NAME, route_prefix="/")


def run(args: argparse.Namespace) -> int:
    """The foreground command: join or start Ray, deploy, serve until SIGINT/SIGTERM, tear down."""
    import ray

    ray.init(address=args.ray_address)
    try:
        deploy(args)
        replicas = f"{args.autoscale[0]}..{args.autoscale[1]}" if args.autoscale else str(args.replicas)
        print(f"dspark: {replicas} replicas behind Ray Serve on http://{args.host}:{args.port} "
              f"(/v1/completions, /v1/chat/completions, /metrics); Ctrl-C stops", flush=True)
        wait_for_signal()
    finally:
        serve.shutdown()  # replicas drain for up to --drain-timeout seconds
        ray.shutdown()
    return 0


def wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
