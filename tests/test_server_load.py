"""The server under load, with faults, and against fuzzed bodies (real uvicorn, loopback).

- load: 64 concurrent streaming clients x 4 requests; no errors, the KV pool is empty
  afterwards, and each streamed text equals the non-streamed text of the same request
  (greedy, and temperature > 0 with a seed);
- faults: clients that vanish mid-stream (or mid-wait) under load, with a KV pool small
  enough to force preemption, leave no blocks behind (the engine is held at each leaver's
  point until its client has left, so every leaver leaves mid-request at any speed);
- fuzz: hypothesis bodies (random JSON, wrong types, huge numbers, missing fields) never
  get a 5xx, and the server is healthy afterwards.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import time

import httpx
import pytest

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_server import CHAT, MODEL, make_server, metric, state, wait_idle  # noqa: E402

PROMPTS = ["The quick brown fox", "def add(a, b):\n", "Natalia sold clips to 48", "Explain list",
           "jumps over the lazy dog", "return a + b", "In April she sold", "They build lists"]
CLIENTS, PER_CLIENT = 64, 4


def request_for(i: int) -> tuple[str, dict]:
    """The i-th request of the load test: endpoint and body (16 distinct ones)."""
    k = i % 16
    sampling = dict(temperature=0.0) if k % 2 == 0 else dict(temperature=0.8, top_p=0.95, seed=100 + k)
    if k % 4 == 1:
        return "/v1/chat/completions", dict(messages=[{"role": "user", "content": PROMPTS[k // 2]}],
                                            max_tokens=12, **sampling)
    return "/v1/completions", dict(prompt=PROMPTS[k // 2], max_tokens=12, **sampling)


def chunk_text(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice["text"] if "text" in choice else choice["delta"].get("content") or ""


async def stream_text(client: httpx.AsyncClient, path: str, body: dict) -> str:
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all("error" not in c for c in chunks), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    return "".join(chunk_text(c) for c in chunks)


async def full_text(client: httpx.AsyncClient, path: str, body: dict) -> str:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def async_client(srv) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=2 * CLIENTS, max_keepalive_connections=2 * CLIENTS)
    return httpx.AsyncClient(base_url=srv.url, limits=limits, timeout=120)


@pytest.fixture(scope="module")
def server(qwen3_dir):
    srv = make_server(qwen3_dir)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_64_streaming_clients_match_non_streamed_and_free_every_block(server):
    async def run() -> tuple[dict[int, set[str]], dict[int, str]]:
        streamed: dict[int, set[str]] = {}

        async def one_client(c: int) -> None:
            for j in range(PER_CLIENT):
                i = c * PER_CLIENT + j
                text = await stream_text(client, *request_for(i))
                streamed.setdefault(i % 16, set()).add(text)

        async with async_client(server) as client:
            await asyncio.gather(*(one_client(c) for c in range(CLIENTS)))
            full = await asyncio.gather(*(full_text(client, *request_for(k)) for k in range(16)))
        return streamed, dict(enumerate(full))

    before = metric(server, "dspark_requests_finished_total")
    streamed, full = asyncio.run(run())
    assert metric(server, "dspark_requests_finished_total") - before == CLIENTS * PER_CLIENT + 16
    assert metric(server, 'dspark_requests_finished_total{finish_reason="error"}') == 0
    for k, texts in streamed.items():
        assert texts == {full[k]}, f"request kind {k}: streamed {texts} vs full {full[k]!r}"
    assert wait_idle(server) == 0


class LeavePoints:
    """Makes every leaving client leave mid-request, whatever the machine's speed.

    Seeds name the leavers' requests (`seed` -> the output tokens after which the client
    leaves). The engine thread holds before a step while all requests are not yet submitted,
    and while some leaver's request has reached its point but the app has not yet asked to
    abort it; a non-streamed leaver is told its point came (it cannot see tokens) and then
    cancels its request. So no leaver's request can run to its end first.
    """

    def __init__(self, srv, points: dict[int, int], total: int) -> None:
        self.aengine, self.points, self.total = state(srv).aengine, points, total
        self.asked: set[str] = set()  # request ids the app asked to abort
        self.reached: dict[int, asyncio.Event] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.reached = {seed: asyncio.Event() for seed in self.points}
        real_abort = self.aengine.abort
        self.aengine.abort = lambda rid: (self.asked.add(rid), real_abort(rid))[-1]

        def hold(engine) -> None:
            real = engine.step

            def step():
                deadline = time.monotonic() + 120  # a safety net: a hang fails the counts below
                while time.monotonic() < deadline and self.due(engine):
                    time.sleep(0.005)
                return real()

            engine.step = step

        self.aengine.call(hold).result(timeout=10)

    def due(self, engine) -> bool:
        if self.aengine.num_in_flight < self.total and not self.asked:
            return True  # every request queued before the first step: the pool must preempt
        waiting = False
        for req in list(engine.requests.values()):
            point = self.points.get(req.params.seed)
            if point is not None and len(req.output_ids) >= point and req.request_id not in self.asked:
                with contextlib.suppress(RuntimeError):  # the clients' loop has closed: nobody waits on it
                    self.loop.call_soon_threadsafe(self.reached[req.params.seed].set)
                waiting = True  # the engine still holds until the app asks to abort
        return waiting


@pytest.mark.slow
def test_disconnects_under_load_leak_no_blocks(qwen3_dir):
    srv = make_server(qwen3_dir, num_kv_blocks=24, block_size=8)  # 192 slots: forces preemption
    rng = random.Random(0)
    plans = [(rng.random(), rng.randint(1, 5)) for _ in range(CLIENTS * 2)]  # (how it leaves, after n tokens)
    leavers = {i: after for i, (leave, after) in enumerate(plans) if leave < 0.75}
    gate = LeavePoints(srv, leavers, len(plans))

    async def one(client: httpx.AsyncClient, i: int) -> None:
        leave, after = plans[i]
        body = dict(prompt=PROMPTS[i % 8], max_tokens=16, temperature=0.7, seed=i, ignore_eos=True, logprobs=0)
        if leave < 0.25:  # non-streamed client that gives up once its request has `after` tokens
            post = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await gate.reached[i].wait()
            post.cancel()  # closes the connection under the server
            with contextlib.suppress(asyncio.CancelledError):
                await post
            return
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():  # logprobs: one chunk per token
                n += line.startswith("data: ")
                if i in leavers and n >= after:
                    return  # leaves mid-stream: the connection closes under the server

    async def run() -> None:
        gate.install()
        async with async_client(srv) as client:
            await asyncio.gather(*(one(client, i) for i in range(len(plans))))

    try:
        asyncio.run(run())
        assert wait_idle(srv) == 0
        aborted = metric(srv, 'dspark_requests_finished_total{finish_reason="abort"}')
        print(f"disconnects: {len(plans)} requests, {aborted:.0f} aborted, "
              f"{metric(srv, 'dspark_preemptions_total'):.0f} preemptions")
        assert aborted == len(leavers) and metric(srv, "dspark_preemptions_total") > 0
        assert metric(srv, 'dspark_requests_finished_total{finish_reason="length"}') == len(plans) - len(leavers)
        assert metric(srv, 'dspark_requests_finished_total{finish_reason="error"}') == 0
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.post(srv.url + "/v1/completions", json=dict(prompt="hi", max_tokens=3)).status_code == 200
    finally:
        srv.stop()


# ---- fuzz -----------------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
HUGE = st.sampled_from([10**30, -(10**30), 2**63, 2**64, 1e308, -1e308, 2**31])


def mostly(common: st.SearchStrategy, rare: st.SearchStrategy, rare_in: int) -> st.SearchStrategy:
    """`common`, except one draw in `rare_in` (plain one_of would draw them about evenly)."""
    return st.integers(0, rare_in - 1).flatmap(lambda i: rare if i == 0 else common)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a valid value (so many requests do generate), sometimes anything at all."""
    return mostly(valid, st.one_of(JSON, HUGE), 8)


SAMPLING = {
    "model": field(mostly(st.just(MODEL), st.just("other"), 8)),
    "max_tokens": field(st.integers(1, 24) | st.integers(-2, 60)),
    "temperature": field(st.floats(0, 2) | st.floats(-1, 3)),
    "top_p": field(st.floats(1e-9, 1) | st.floats(0, 1.5)),
    "top_k": field(st.integers(-1, 500)),
    "seed": field(st.integers(-(2**63), 2**64 - 1) | st.integers(-(2**65), 2**65)),
    "stop": field(st.lists(st.text(min_size=1, max_size=3), max_size=3) | st.text(max_size=3)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "n": field(st.just(1) | st.integers(0, 3)),
    "ignore_eos": field(st.booleans()),
}
COMPLETION = st.fixed_dictionaries({
    "prompt": field(st.text(min_size=1, max_size=30) | st.lists(st.integers(-5, 500), max_size=8)),
}, optional={**SAMPLING, "logprobs": field(st.integers(0, 20) | st.integers(-1, 25))})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer", "tool"]),
                                 "content": st.text(max_size=20)})
CHAT_BODY = st.fixed_dictionaries({"messages": field(st.lists(MESSAGE, min_size=1, max_size=3))}, optional={
    **SAMPLING,
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(0, 20) | st.integers(-1, 25)),
    "max_completion_tokens": field(st.integers(1, 24) | st.integers(-1, 60)),
})
GARBAGE = st.one_of(JSON, st.binary(max_size=40),
                    st.sampled_from([b'{"prompt": "\\ud800"}', b'{"prompt": NaN}', b'{"prompt": "x"']))
BODIES = st.tuples(
    st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.integers(0, 4)
).flatmap(lambda pk: st.tuples(st.just(pk[0]), GARBAGE if pk[1] == 0 else
                               COMPLETION if pk[0] == "/v1/completions" else CHAT_BODY))


@pytest.fixture(scope="module")
def small_server(qwen3_dir):
    srv = make_server(qwen3_dir, max_model_len=48)  # bounds every generation to a few tokens
    yield srv
    srv.stop()


def check_no_5xx(srv, path: str, body) -> int:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.stream("POST", srv.url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json"}) as r:
        payload = r.read()
    assert r.status_code < 500, (r.status_code, payload[:300])
    if r.status_code >= 400:
        assert set(json.loads(payload)["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert payload.endswith(b"data: [DONE]\n\n") and b'"error"' not in payload, payload[-300:]
    return r.status_code


def fuzz(srv, max_examples: int) -> collections.Counter:
    statuses: collections.Counter = collections.Counter()

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(BODIES)
    def run(case) -> None:
        statuses[check_no_5xx(srv, *case)] += 1

    run()
    print(f"fuzz: {sum(statuses.values())} requests, by status {dict(statuses)}")
    assert httpx.get(srv.url + "/health").status_code == 200
    assert wait_idle(srv) == 0
    assert metric(srv, "dspark_engine_step_errors_total") == 0
    ok = httpx.post(srv.url + "/v1/chat/completions", json=dict(messages=CHAT, max_tokens=3))
    assert ok.status_code == 200
    return statuses


def test_fuzzed_bodies_never_get_5xx(small_server):
    fuzz(small_server, max_examples=60)


@pytest.mark.slow
def test_fuzzed_bodies_never_get_5xx_long(small_server):
    fuzz(small_server, max_examples=500)
