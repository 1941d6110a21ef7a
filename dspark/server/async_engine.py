"""One background thread owns the synchronous `LLMEngine`; asyncio talks to it by messages.

    aengine = AsyncEngine(engine, ServerMetrics(), capacity=64 + 256).start()
    stream = aengine.submit(prompt_ids, params, "cmpl-1", arrival)   # in the event loop
    async for delta in stream: ...          # Delta: new tokens ..., then the finish (or error)
    aengine.abort("cmpl-1")                 # from any thread; frees the request's KV blocks
    used = aengine.call(lambda e: e.kv.pool.num_used_blocks).result()
    aengine.stop()

The engine is not thread-safe, so every engine call happens on the engine thread: other
threads only put closures on a command queue, and the thread hands results back to each
request's asyncio queue with `loop.call_soon_threadsafe`. The loop is: run the queued
commands, `engine.step()`, publish what each request gained. A failure stays as small as
it can: a bad request fails alone, a raising step fails that step's requests, and the
loop keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from dspark.engine.engine import LLMEngine
from dspark.engine.output import StepFailed
from dspark.engine.request import Request, Status
from dspark.sampling import SamplingParams
from dspark.server.metrics import RequestMeter, ServerMetrics
from dspark.server.protocol import ApiError

log = logging.getLogger("dspark.server")
IDLE_WAIT_S = 0.5  # how long an idle engine thread blocks on the command queue
STALL_WAIT_S = 0.005  # after a step that scheduled nothing: don't spin


@dataclass
class Delta:
    """What one request gained in one step; the last one has a finish_reason or an error."""

    token_ids: list[int]
    logprobs: list[dict] = field(default_factory=list)
    piece: str = ""  # the text these tokens completed (the engine's detokenizer; holds no stop cut)
    finish_reason: str | None = None
    text: str | None = None  # the final text (stop string removed), once finished
    stats: dict[str, Any] | None = None  # req.stats.as_dict(), once finished
    error: ApiError | None = None


class RequestStream:
    """The event-loop side of one request: an asyncio queue the engine thread fills."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._loop = loop
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()

    def put(self, delta: Delta) -> None:
        """Called on the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while not self.finished:
            delta = await self._queue.get()
            self.finished = delta.finish_reason is not None or delta.error is not None
            yield delta


@dataclass
class _Live:
    """The engine-thread side of one request."""

    req: Request
    stream: RequestStream
    meter: RequestMeter
    sent: int = 0  # output tokens already handed to the stream
    pieces: int = 0  # text pieces of the request's detokenizer already handed to the stream


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, capacity: int | None = None) -> None:
        self.engine, self.metrics = engine, metrics
        self.capacity = capacity  # requests held at once (running + waiting); beyond it: 503
        self.accepting = True
        self.dead: BaseException | None = None
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._in_flight = 0
        self._stalled = False
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)

    # ---- any thread -----------------------------------------------------------------
    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.accepting = False
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str,
               arrival: float | None = None) -> RequestStream:
        """Queue a request (call from the event loop); 503 when full, draining or dead."""
        if not self.accepting or not self.alive:
            self.metrics.requests_rejected.labels(reason="unavailable").inc()
            raise ApiError(503, "the server is shutting down or its engine stopped", code="unavailable")
        with self._lock:
            if self.capacity is not None and self._in_flight >= self.capacity:
                self.metrics.requests_rejected.labels(reason="queue_full").inc()
                raise ApiError(503, "the server is at capacity; retry later", code="queue_full")
            self._in_flight += 1
        stream = RequestStream(request_id, asyncio.get_running_loop())
        arrival = time.perf_counter() if arrival is None else arrival
        self._commands.put(partial(self._add, stream, list(prompt_ids), params, arrival))
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(partial(self._abort, request_id))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread, between steps; the future has its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn(self.engine))
            except Exception as exc:
                fut.set_exception(exc)

        self._commands.put(run)
        return fut

    # ---- the engine thread ----------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._run_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as exc:  # the loop itself broke: say so on every request
            self.dead = exc
            log.exception("engine loop died")
        finally:
            self.accepting = False
            while not self._commands.empty():  # adds that raced the stop become live, then fail
                command = self._commands.get_nowait()
                if command is not None:
                    self._guarded(command)
            for rid in list(self._live):
                self._fail(rid, ApiError(503, "the server is shutting down", code="unavailable"))

    def _run_commands(self, block: bool) -> bool:
        """Run every queued command; False once the stop command is seen."""
        wait = IDLE_WAIT_S if block else (STALL_WAIT_S if self._stalled else 0.0)
        try:
            command = self._commands.get(timeout=wait) if wait else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            self._guarded(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish_queues()
        return True

    @staticmethod
    def _guarded(command: Callable[[], None]) -> None:
        try:
            command()
        except Exception:  # each command guards its own request; this is a last resort
            log.exception("engine command failed")

    def _add(self, stream: RequestStream, prompt_ids: list[int], params: SamplingParams, arrival: float) -> None:
        try:
            req = self.engine.add_request(prompt_ids, params, stream.request_id)
        except ValueError as exc:  # bad input: the engine changed nothing
            self._end(stream, ApiError(400, str(exc), code="invalid_value"), "rejected")
            return
        except Exception as exc:
            log.exception("add_request failed")
            self._end(stream, ApiError(500, f"could not queue the request: {exc}"), "error")
            return
        self._live[stream.request_id] = _Live(req, stream, RequestMeter(arrival))
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return  # already finished or failed
        self.engine.abort(request_id)
        self.metrics.observe_request(live.meter, live.req.stats, time.perf_counter())  # final counters
        self._end(live.stream, None, "abort", Delta([], finish_reason="abort"))

    def _end(self, stream: RequestStream, error: ApiError | None, reason: str, last: Delta | None = None) -> None:
        with self._lock:
            self._in_flight -= 1
        self.metrics.requests_finished.labels(finish_reason=reason).inc()
        stream.put(last or Delta([], error=error))

    def _fail(self, request_id: str, error: ApiError) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        try:
            self.engine.abort(request_id)  # frees its KV blocks
        except Exception:
            log.exception("abort of failed request %s raised", request_id)
        self._end(live.stream, error, "error")

    def _step(self) -> None:
        try:
            step = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            self.metrics.step_errors.inc()
            if isinstance(exc, StepFailed):
                victims = exc.request_ids
            else:  # it failed before it ran: everything that could have been in the step
                victims = [rid for rid, lv in self._live.items() if lv.req.status is Status.RUNNING]
            for rid in victims or list(self._live):
                self._fail(rid, ApiError(500, f"the engine failed on this request: {exc}", code="engine_error"))
            return
        self._stalled = not step.ran
        if step.ran:  # the target's forward: prefill + sum(1 + l_r)
            self.metrics.observe_verification_budget(step.num_forward_tokens)
            self.metrics.observe_step(step.drafter_ran, self.engine.gate_state())
        self._publish(time.perf_counter())

    def _publish(self, now: float) -> None:
        for rid, live in list(self._live.items()):
            try:
                self._deliver(live, now)
            except Exception as exc:  # this request alone fails
                log.exception("delivering request %s failed", rid)
                self._fail(rid, ApiError(500, f"the server failed on this request: {exc}"))
        self._publish_queues()

    def _deliver(self, live: _Live, now: float) -> None:
        req = live.req
        n = len(req.output_ids)
        if n == live.sent and not req.is_finished:
            return
        delta = Delta(req.output_ids[live.sent:n], req.output_logprobs[live.sent:n])
        live.sent = n
        if req.detokenizer is not None:
            pieces = req.detokenizer.pieces
            delta.piece, live.pieces = "".join(pieces[live.pieces:]), len(pieces)
        self.metrics.observe_request(live.meter, req.stats, now)
        if req.is_finished:
            out = self.engine.output(req)
            delta.finish_reason, delta.text, delta.stats = out.finish_reason or "stop", out.text, out.stats
            del self._live[req.request_id]  # the engine retired it when it finished
            self._end(live.stream, None, delta.finish_reason, delta)
        else:
            live.stream.put(delta)

    def _publish_queues(self) -> None:
        running = sum(1 for lv in self._live.values() if lv.req.status is Status.RUNNING)
        pool = self.engine.kv.pool
        self.metrics.observe_queues(running, max(0, self._in_flight - running), pool.num_used_blocks,
                                    pool.num_free_blocks)
