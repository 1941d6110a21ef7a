"""The OpenAI-compatible server on a real uvicorn (loopback, background thread).

The official `openai` client for both endpoints, streamed and not; streamed text equals the
non-streamed text; logprobs shapes; stop strings; errors (400/404/503) in OpenAI's shape;
disconnects and a raising engine step free their KV blocks; `dspark serve` wiring.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from dspark.cli import build_parser  # noqa: E402
from dspark.config import EngineConfig  # noqa: E402
from dspark.engine.factory import assemble  # noqa: E402
from dspark.models.loader import load_model  # noqa: E402
from dspark.server.app import ServeSettings, create_app  # noqa: E402
from dspark.server.launch import ServerThread, build_engine, drafter_name  # noqa: E402

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Explain list comprehensions."}]


def make_server(path: Path, max_waiting: int | None = 256, **engine_kw) -> ServerThread:
    net, tok = load_model(path)
    cfg = dict(device="cpu", num_kv_blocks=256, max_num_batched_tokens=512)
    cfg.update(engine_kw)
    app = create_app(assemble(net, tok, EngineConfig(**cfg)), ServeSettings(model_name=MODEL, max_waiting=max_waiting))
    return ServerThread(app).start()


def state(srv: ServerThread):
    return srv.server.config.app.state


def wait_idle(srv: ServerThread, timeout_s: float = 120.0) -> int:
    """Wait until no request is in flight; -> KV blocks still used (read on the engine thread)."""
    aengine = state(srv).aengine
    deadline = time.monotonic() + timeout_s
    while aengine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert aengine.num_in_flight == 0, "requests still in flight"
    return aengine.call(lambda e: e.kv.pool.num_used_blocks).result(timeout=10)


class HeldSteps:
    """Holds the server's engine thread before each step until the test allows it, and records
    every abort the app asks for: disconnect tests then decide what happens in which order,
    instead of racing the engine with a client timeout (no verdict depends on machine speed).

        with HeldSteps(srv) as held:   # the engine steps only when allowed
            held.allow(1)              # one step
            held.aborted.wait(30)      # the app asked to abort a request
        # leaving releases the engine and restores its step
    """

    def __init__(self, srv: ServerThread) -> None:
        self.aengine = state(srv).aengine
        self.permits = threading.Semaphore(0)
        self.free = threading.Event()
        self.aborted = threading.Event()

    def __enter__(self) -> HeldSteps:
        def hold(engine) -> None:
            real = engine.step

            def step():
                while not self.free.is_set() and not self.permits.acquire(timeout=0.05):
                    pass
                return real()

            engine.step, self.real = step, real

        self.aengine.call(hold).result(timeout=10)
        real_abort = self.aengine.abort

        def abort(request_id: str) -> None:
            real_abort(request_id)
            self.aborted.set()

        self.aengine.abort = abort
        return self

    def allow(self, steps: int) -> None:
        self.permits.release(steps)

    def __exit__(self, *exc: object) -> None:
        del self.aengine.abort  # the instance attribute: back to the method
        self.free.set()

        def restore(engine) -> None:
            engine.step = self.real

        self.aengine.call(restore).result(timeout=60)


def metric(srv: ServerThread, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


@pytest.fixture(scope="module")
def server(qwen3_dir):
    srv = make_server(qwen3_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)


def sse_stream(url: str, path: str, body: dict) -> list[dict]:
    """POST with stream=True; -> the parsed `data:` chunks (the last must be [DONE])."""
    chunks = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    return chunks


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=11)])
def test_openai_client_completions(client, sampling):
    full = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, **sampling)
    assert full.object == "text_completion" and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens >= 1 and full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    usage = full.usage.model_dump()
    assert usage["tau"] == 1.0 and usage["draft_tokens"] == usage["accepted_tokens"] == 0
    stream = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, stream=True, **sampling)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=5)])
def test_openai_client_chat(client, sampling):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, **sampling)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **sampling)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    for name in ("dspark_requests_running", "dspark_requests_waiting", "dspark_prompt_tokens_total",
                 "dspark_generation_tokens_total", "dspark_draft_tokens_total", "dspark_verified_tokens_total",
                 "dspark_accepted_tokens_total", "dspark_verification_budget_tokens_bucket",
                 "dspark_mean_accepted_length", "dspark_time_to_first_token_seconds_bucket",
                 "dspark_inter_token_latency_seconds_bucket", "dspark_kv_blocks_used", "dspark_kv_blocks_free"):
        assert name in text, name
    assert metric(server, "dspark_generation_tokens_total") >= 4
    assert metric(server, "dspark_mean_accepted_length") == 1.0  # plain decoding: tau = 1
    assert metric(server, "dspark_verification_budget_tokens_count") > 0
    assert metric(server, "dspark_kv_blocks_used") + metric(server, "dspark_kv_blocks_free") == 256
    assert 'dspark_engine_steps_total{drafter="skipped"}' in text and "dspark_gate_open" not in text  # plain: no gate


def test_speculative_counters_reach_metrics():
    """Plain decoding leaves them 0, so feed RequestStats as a speculative step would."""
    from dspark.engine.request import RequestStats
    from dspark.server.metrics import RequestMeter, ServerMetrics

    m, meter = ServerMetrics(), RequestMeter(arrival=0.0)
    stats = RequestStats(completion_tokens=3, rounds=1, draft_tokens=4, verified_tokens=3, accepted_tokens=2,
                         accepted_per_position=[1, 1, 0], verified_per_position=[1, 1, 1], first_token_time=0.5)
    m.observe_request(meter, stats, now=0.5)
    stats.completion_tokens, stats.rounds, stats.accepted_tokens = 4, 2, 2
    stats.verified_per_position = [2, 1, 1]
    m.observe_request(meter, stats, now=0.7)
    value = m.registry.get_sample_value
    assert value("dspark_accepted_tokens_total") == 2 and value("dspark_draft_tokens_total") == 4
    assert value("dspark_accepted_tokens_per_position_total", {"position": "2"}) == 1
    assert value("dspark_verified_tokens_per_position_total", {"position": "1"}) == 2
    assert value("dspark_mean_accepted_length") == 2.0  # 4 tokens in 2 rounds
    assert value("dspark_time_to_first_token_seconds_count") == 1
    assert value("dspark_inter_token_latency_seconds_count") == 1


def test_logprobs(server, client):
    out = client.completions.create(model=MODEL, prompt="The quick", max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert all(0 < len(top) <= 3 for top in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    chunks = sse_stream(server.url, "/v1/completions", dict(prompt="The quick", max_tokens=6, temperature=0, logprobs=3))
    streamed = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(lp.token_logprobs)


def test_stop_string_streams_like_full(server, client):
    base = client.completions.create(model=MODEL, prompt="Natalia sold", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next((base[i:i + 2] for i in range(4, len(base) - 2) if base[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip("the random model produced no usable stop string")
    body = dict(prompt="Natalia sold", max_tokens=16, temperature=0, stop=[stop, "zzzz"], ignore_eos=True)
    full = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
    assert full["finish_reason"] == "stop" and stop not in full["text"] and base.startswith(full["text"])
    chunks = sse_stream(server.url, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 7}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "word " * 400}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**6]}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, n=3)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    aborted = metric(server, 'dspark_requests_finished_total{finish_reason="abort"}')
    body = dict(prompt="The quick brown fox", max_tokens=200, temperature=0, ignore_eos=True, stream=True)
    with HeldSteps(server) as held:
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
            held.allow(1)  # the prefill step: the first token, the first chunk
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        assert held.aborted.wait(30)  # the client left while the engine was held at step 2
    assert wait_idle(server) == 0
    assert metric(server, 'dspark_requests_finished_total{finish_reason="abort"}') == aborted + 1


def test_non_streamed_disconnect_aborts(server):
    aborted = metric(server, 'dspark_requests_finished_total{finish_reason="abort"}')
    body = json.dumps(dict(prompt="The quick brown fox", max_tokens=240, temperature=0, ignore_eos=True))
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    with HeldSteps(server) as held:
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(request)
            until(lambda: held.aengine.num_in_flight == 1)  # submitted; the engine may not step
        assert held.aborted.wait(30)  # the app saw the disconnect before any step ran
    assert wait_idle(server) == 0
    assert metric(server, 'dspark_requests_finished_total{finish_reason="abort"}') == aborted + 1


def until(condition, timeout_s: float = 30.0) -> None:
    """Wait for a condition that must come (a generous bound: a safety net, not a verdict)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never came"
        time.sleep(0.01)


def test_full_queue_gets_503_with_retry_after(qwen3_dir):
    srv = make_server(qwen3_dir, max_waiting=1, max_num_seqs=1)
    body = dict(prompt="The quick brown fox", max_tokens=200, temperature=0, ignore_eos=True, stream=True)
    try:
        with HeldSteps(srv), httpx.Client(base_url=srv.url) as c, c.stream("POST", "/v1/completions", json=body) as a, \
                c.stream("POST", "/v1/completions", json=body) as b:
            assert a.status_code == b.status_code == 200  # one running, one waiting; held: neither ends
            r = httpx.post(srv.url + "/v1/completions", json=dict(body, stream=False))
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
        assert wait_idle(srv) == 0
        assert httpx.post(srv.url + "/v1/completions", json=dict(prompt="hi", max_tokens=2)).status_code == 200
    finally:
        srv.stop()


def test_raising_step_fails_its_requests_and_serving_goes_on(qwen3_dir):
    srv = make_server(qwen3_dir)
    aengine = state(srv).aengine
    try:
        def break_next_step(engine):
            real = engine.runner.step

            def step(*args, **kwargs):
                engine.runner.step = real  # only this one step fails
                raise RuntimeError("injected fault")

            engine.runner.step = step

        aengine.call(break_next_step).result(timeout=10)
        r = httpx.post(srv.url + "/v1/completions", json=dict(prompt="hello", max_tokens=4), timeout=30)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        aengine.call(break_next_step).result(timeout=10)
        chunks = sse_stream(srv.url, "/v1/chat/completions", dict(messages=CHAT, max_tokens=4))
        assert "injected fault" in chunks[-1]["error"]["message"]
        assert wait_idle(srv) == 0
        ok = httpx.post(srv.url + "/v1/completions", json=dict(prompt="hello", max_tokens=4), timeout=30)
        assert ok.status_code == 200 and httpx.get(srv.url + "/health").status_code == 200
        assert metric(srv, "dspark_engine_step_errors_total") == 2
    finally:
        srv.stop()


def serve_args(path: Path, *extra: str):
    return build_parser().parse_args(["serve", "--model", str(path), "--device", "cpu", "--num-kv-blocks", "128",
                                      "--served-model-name", MODEL, *extra])


def test_serve_arguments_build_the_engine(qwen3_dir):
    args = serve_args(qwen3_dir, "--max-num-seqs", "8", "--drafter", "ngram", "--policy", "static:3")
    assert (args.policy, args.drafter, args.max_waiting, args.port) == ("static:3", "ngram", 256, 8000)
    engine = build_engine(args)
    assert engine.cfg.max_num_seqs == 8 and engine.kv.pool.num_blocks == 128
    assert drafter_name(engine).startswith("ngram:") and engine.policy.name == "static:3"
    assert build_engine(serve_args(qwen3_dir)).drafter is None  # no drafter named: plain decoding
    assert build_engine(serve_args(qwen3_dir, "--pad-rows", "0")).runner.pad_rows == 0
    assert engine.runner.base.pad_rows == engine.cfg.pad_rows == 48  # the default
    with pytest.raises(ValueError):
        build_engine(serve_args(qwen3_dir, "--drafter", "ngram", "--policy", "fastest"))


def test_speculative_server_is_lossless_and_reports_drafting(qwen3_dir, client):
    engine = build_engine(serve_args(qwen3_dir, "--drafter", "ngram", "--policy", "static:3"))
    srv = ServerThread(create_app(engine, ServeSettings(model_name=MODEL, drafter=drafter_name(engine),
                                                        policy=engine.policy.name))).start()
    try:
        spec = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0)
        prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
        body = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        out = spec.completions.create(**body)
        assert out.choices[0].text == client.completions.create(**body).choices[0].text  # same as plain
        usage = out.usage.model_dump()
        assert usage["draft_tokens"] > 0 and usage["verified_tokens"] > 0 and usage["tau"] >= 1.0
        streamed = "".join(c.choices[0].text for c in spec.completions.create(**body, stream=True))
        assert streamed == out.choices[0].text
        assert metric(srv, "dspark_verified_tokens_total") >= 2 * usage["verified_tokens"]
        assert spec.models.list().data[0].model_dump()["policy"] == "static:3"
        assert wait_idle(srv) == 0
    finally:
        srv.stop()


# `dspark serve` whose engine steps only once the file argv[1] exists: the SIGTERM test then
# signals while its request is surely in flight, on any machine
HELD_SERVE = """
import sys, time
from pathlib import Path
import dspark.engine.engine as engine
from dspark.cli import main
real, release = engine.LLMEngine.step, Path(sys.argv[1])
def step(self):
    while not release.exists():
        time.sleep(0.01)
    return real(self)
engine.LLMEngine.step = step
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits(qwen3_dir, tmp_path):
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, release = f"http://127.0.0.1:{port}", tmp_path / "release"
    proc = subprocess.Popen([sys.executable, "-c", HELD_SERVE, str(release), "serve", "--model", str(qwen3_dir),
                             "--device", "cpu", "--port", str(port), "--num-kv-blocks", "64",
                             "--served-model-name", MODEL, "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        submitted, lines = threading.Event(), []

        def read() -> None:
            body = dict(prompt="The quick brown fox", max_tokens=200, temperature=0, ignore_eos=True, stream=True,
                        logprobs=0)  # logprobs: one chunk per token, even while text is held back
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                submitted.set()  # the status came: the request is queued, and the engine is held
                lines.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=read)
        reader.start()
        assert submitted.wait(30)
        proc.send_signal(signal.SIGTERM)
        until(lambda: refused(url + "/health"))  # the signal was handled: draining
        try:  # new work is refused while draining: closed socket or 503
            assert httpx.post(url + "/v1/completions", json=dict(prompt="hi"), timeout=5).status_code == 503
        except httpx.TransportError:
            pass
        assert not lines  # nothing generated before the signal
        release.touch()
        reader.join(120)
        data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert lines[-1] == "data: [DONE]" and data[-1]["choices"][0]["finish_reason"] == "length"
        assert len(data) == 200  # every token was generated and streamed after the signal
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after draining
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def refused(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 503
    except httpx.TransportError:
        return True


def test_steps_and_the_gate_reach_metrics():
    """Steps count by whether the drafter ran; the gate's gauge and probe counter appear only once a gate judged."""
    from dspark.server.metrics import ServerMetrics

    m = ServerMetrics()
    value = m.registry.get_sample_value
    m.observe_step(False, None)
    assert value("dspark_engine_steps_total", {"drafter": "skipped"}) == 1
    assert value("dspark_gate_open") is None and b"dspark_gate" not in m.render()  # no gate: nothing to show
    m.observe_step(True, (True, False))
    m.observe_step(False, (False, False))
    m.observe_step(True, (False, True))  # a closed gate's probe
    assert value("dspark_engine_steps_total", {"drafter": "ran"}) == 2
    assert value("dspark_engine_steps_total", {"drafter": "skipped"}) == 2
    assert value("dspark_gate_open") == 0 and value("dspark_gate_probes_total") == 1
    m.observe_step(True, (True, False))
    assert value("dspark_gate_open") == 1 and value("dspark_gate_probes_total") == 1
