"""Build the served engine and run the app under uvicorn (in the foreground or on a thread).

    engine = build_engine(args)                  # args: see `dspark serve --help`
    serve(create_app(engine, settings), host, port)   # SIGTERM drains, then exits
    app = build_app(args)                        # engine + settings + app in one call (also each Ray replica)
    with ServerThread(app) as srv: httpx.get(srv.url + "/health")   # tests, benchmarks

On SIGTERM (or Ctrl-C) uvicorn stops listening and waits for in-flight responses; the app
also refuses new requests on open connections (503) and reports unhealthy meanwhile.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from dspark.config import PAD_ROWS, EngineConfig, default_device
from dspark.engine.engine import LLMEngine
from dspark.engine.gate import GateConfig
from dspark.models.loader import DEFAULT_MODEL


def model_name(args: argparse.Namespace) -> str:
    if getattr(args, "served_model_name", None):
        return args.served_model_name
    return Path(args.model).name if getattr(args, "model", None) else DEFAULT_MODEL


def build_engine(args: argparse.Namespace) -> LLMEngine:
    """The engine `dspark serve` runs: model, drafter and policy by name (engine/factory.py)."""
    from dspark.engine.factory import build_engine as from_names  # loads drafters: only when serving

    cfg = EngineConfig(
        device=getattr(args, "device", None) or default_device(), dtype=getattr(args, "dtype", "") or "",
        max_num_seqs=getattr(args, "max_num_seqs", 64),
        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", 1024),
        max_model_len=getattr(args, "max_model_len", None), num_kv_blocks=getattr(args, "num_kv_blocks", None),
        seed=getattr(args, "seed", 0),
        pad_rows=PAD_ROWS if getattr(args, "pad_rows", None) is None else args.pad_rows,
    )
    return from_names(getattr(args, "model", None), drafter=getattr(args, "drafter", None),
                      policy=getattr(args, "policy", None), cfg=cfg, gamma=getattr(args, "gamma", None),
                      draft_vocab=getattr(args, "draft_vocab", None),
                      gate=GateConfig.parse(getattr(args, "gate", "")))


def build_app(args: argparse.Namespace) -> FastAPI:
    """The whole served app from `dspark serve` arguments (one per process or Ray replica)."""
    from dspark.server.app import ServeSettings, create_app
    from dspark.server.auth import resolve_api_key

    if args.max_waiting < 0:
        raise ValueError("--max-waiting must be >= 0")
    api_key = resolve_api_key(getattr(args, "api_key", None))
    metrics_auth = getattr(args, "metrics_auth", False)
    engine = build_engine(args)
    settings = ServeSettings(model_name=model_name(args), max_waiting=args.max_waiting,
                             drafter=drafter_name(engine), policy=engine.policy.name,
                             api_key=api_key, metrics_auth=metrics_auth)
    return create_app(engine, settings)


def drafter_name(engine: LLMEngine) -> str | None:
    drafter = engine.drafter
    return None if drafter is None else f"{drafter.config.kind}:{drafter.config.gamma}"


class DrainingServer(uvicorn.Server):
    """uvicorn's graceful shutdown, plus: the app refuses new requests from the first signal."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        aengine = getattr(getattr(self.config.app, "state", None), "aengine", None)
        if aengine is not None:
            aengine.accepting = False
        super().handle_exit(sig, frame)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          drain_timeout_s: float | None = 60.0) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout_s)
    DrainingServer(config).run()


class ServerThread:
    """uvicorn on a background thread, bound to a free loopback port (tests, benchmarks)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, **config: Any) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        config.setdefault("log_level", "warning")
        self.server = uvicorn.Server(uvicorn.Config(app, **config))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
