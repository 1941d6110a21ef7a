"""The OpenAI-compatible FastAPI app: /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics, over one `AsyncEngine`; with an API key, `/v1/*` needs it (auth.py).

    app = create_app(engine, ServeSettings(model_name="dspark-small"))
    uvicorn.run(app)             # or `dspark serve`; the engine thread starts with the app

A route parses and validates the body (400/404 before anything is queued), renders the
prompt, submits it, then either streams server-sent events or collects the whole answer.
Whichever way the response ends (finished, client gone, server error), an unfinished
request is aborted, so its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from dspark.engine.engine import LLMEngine
from dspark.server.async_engine import AsyncEngine, RequestStream
from dspark.server.auth import ApiKeyGuard
from dspark.server.metrics import CONTENT_TYPE, ServerMetrics
from dspark.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
    sampling_params,
)
from dspark.server.responses import Shaper, TextStream, sse

log = logging.getLogger("dspark.server")


@dataclass(frozen=True)
class ServeSettings:
    model_name: str = "dspark-small"
    max_waiting: int | None = 256  # requests queued beyond the running batch; more: 503
    retry_after_s: int = 1
    drafter: str | None = None  # what /v1/models reports; the engine holds the real ones
    policy: str = "none"
    api_key: str | None = field(default=None, repr=False)  # None: anyone may call (auth.py)
    metrics_auth: bool = False  # /metrics needs the key too

    def __post_init__(self) -> None:
        if self.metrics_auth and self.api_key is None:
            raise ValueError("--metrics-auth needs an API key (--api-key or DSPARK_API_KEY)")


def create_app(engine: LLMEngine, settings: ServeSettings | None = None) -> FastAPI:
    settings = settings or ServeSettings()
    metrics = ServerMetrics()
    capacity = None if settings.max_waiting is None else engine.cfg.max_num_seqs + settings.max_waiting
    aengine = AsyncEngine(engine, metrics, capacity)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        yield
        await asyncio.to_thread(aengine.stop)

    app = FastAPI(title="dspark", lifespan=lifespan)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=settings.api_key, metrics_auth=settings.metrics_auth)
    app.state.engine, app.state.aengine, app.state.metrics, app.state.settings = engine, aengine, metrics, settings

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        headers = {"Retry-After": str(settings.retry_after_s)} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody reads it; keeps a vanished client out of the error log

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}").body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = aengine.alive and aengine.accepting
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "dspark",
                "max_model_len": engine.max_model_len, "drafter": settings.drafter, "policy": settings.policy}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()  # TTFT counts parsing and tokenising too
        body = parse_body(CompletionRequest, await request.body())
        check_model(body.model, settings)
        ids = encode(engine, body.single_prompt(), "prompt")
        return await respond(request, aengine, body, ids, f"cmpl-{uuid.uuid4().hex}", arrival, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        body = parse_body(ChatCompletionRequest, await request.body())
        check_model(body.model, settings)
        try:
            prompt = engine.tokenizer.apply_chat_template([m.rendered() for m in body.messages])
        except Exception as exc:  # the template's own raise_exception, or a Jinja error
            raise ApiError(400, f"cannot render the chat template: {exc}", param="messages") from None
        ids = encode(engine, prompt, "messages")
        return await respond(request, aengine, body, ids, f"chatcmpl-{uuid.uuid4().hex}", arrival, chat=True)

    return app


def check_model(name: str | None, settings: ServeSettings) -> None:
    if name is not None and name != settings.model_name:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {settings.model_name!r}",
                       param="model", code="model_not_found")


def encode(engine: LLMEngine, prompt: str | list[int], param: str) -> list[int]:
    """Tokenise and check against the context here, so a bad prompt is a 400 up front.
    (`encode_prompt` only reads the tokenizer and fixed sizes: safe off the engine thread.)"""
    try:
        return engine.encode_prompt(prompt)
    except ValueError as exc:
        code = "context_length_exceeded" if "context" in str(exc) else "invalid_value"
        raise ApiError(400, str(exc), param=param, code=code) from None
    except Exception as exc:  # e.g. text the tokenizer cannot take (lone surrogates)
        raise ApiError(400, f"cannot tokenise the prompt: {exc}", param=param, code="invalid_value") from None


async def respond(request: Request, aengine: AsyncEngine, body: CompletionRequest | ChatCompletionRequest,
                  ids: list[int], request_id: str, arrival: float, chat: bool) -> Response:
    params = sampling_params(body, len(ids), aengine.engine.max_model_len)
    settings: ServeSettings = request.app.state.settings
    shaper = Shaper(request_id, settings.model_name, chat, aengine.engine.tokenizer, params.logprobs is not None)
    stream = aengine.submit(ids, params, request_id, arrival)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        events = stream_events(stream, shaper, TextStream(params.stop), usage)
        return AbortingStreamingResponse(events, lambda: release(aengine, stream), media_type="text/event-stream")
    try:
        return JSONResponse(await collect_or_disconnect(request, stream, shaper))
    finally:
        release(aengine, stream)


def release(aengine: AsyncEngine, stream: RequestStream) -> None:
    """However the response ended: abort the request if the engine still runs it."""
    if not stream.finished:
        aengine.abort(stream.request_id)


class AbortingStreamingResponse(StreamingResponse):
    """A StreamingResponse that calls `on_close` however it ends (even never iterated)."""

    def __init__(self, content: AsyncIterator[bytes], on_close, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def stream_events(stream: RequestStream, shaper: Shaper, text: TextStream, usage: bool) -> AsyncIterator[bytes]:
    first = True
    async for delta in stream:
        if delta.error is not None:
            yield sse(delta.error.body())
            break
        if delta.finish_reason is None:
            piece = text.push(delta.piece)
        else:  # the final text: cut before a stop string, a trailing incomplete character decoded
            piece = text.finish(delta.text or "")
        if piece or delta.logprobs or delta.finish_reason or first:
            yield sse(shaper.chunk(piece, delta.logprobs, delta.finish_reason, first))
            first = False
        if delta.finish_reason is not None and usage:
            yield sse(shaper.usage_chunk(delta.stats or {}))
    yield sse("[DONE]")


async def collect(stream: RequestStream, shaper: Shaper) -> dict:
    logprobs: list[dict] = []
    async for delta in stream:
        if delta.error is not None:
            raise delta.error
        logprobs += delta.logprobs
        if delta.finish_reason is not None:
            return shaper.full(delta.text or "", delta.finish_reason, logprobs, delta.stats or {})
    raise ApiError(500, "the request ended without a result")


async def collect_or_disconnect(request: Request, stream: RequestStream, shaper: Shaper) -> dict:
    """Collect the answer, but stop early when the client goes away (then it is aborted)."""
    result = asyncio.ensure_future(collect(stream, shaper))
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()
    if not result.done() or result.cancelled():  # cancelled, but the task may not have run yet
        raise ApiError(499, "the client closed the request", code="client_closed")
    return result.result()


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
