"""`dspark serve --api-key`: the official `openai` client with the right key, a wrong one and
none; OpenAI's 401 error shape; /health open; /metrics open unless --metrics-auth; the key
from DSPARK_API_KEY; and the key reaching every Ray replica's arguments.
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from test_server import CHAT, MODEL, serve_args  # noqa: E402

from dspark.server import commands  # noqa: E402
from dspark.server.auth import ENV_VAR, resolve_api_key  # noqa: E402
from dspark.server.launch import ServerThread, build_app  # noqa: E402

KEY = "sk-dspark-test-0123456789"


@pytest.fixture(scope="module")
def guarded(qwen3_dir):
    srv = ServerThread(build_app(serve_args(qwen3_dir, "--api-key", KEY, "--metrics-auth"))).start()
    yield srv
    srv.stop()


def client(srv: ServerThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


NO_KEY = {"extra_headers": {"Authorization": openai.Omit()}}  # the client sends no Authorization header


def test_the_right_key_is_served(guarded):
    c = client(guarded, KEY)
    assert [m.id for m in c.models.list().data] == [MODEL]
    out = c.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens >= 1
    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("key", ["wrong-key", KEY + "x", KEY[:-1], None])
def test_a_wrong_or_missing_key_gets_401(guarded, key):
    c, extra = client(guarded, key or "unused"), (NO_KEY if key is None else {})
    with pytest.raises(openai.AuthenticationError) as err:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=2, **extra)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stream=True, **extra)
    with pytest.raises(openai.AuthenticationError):
        c.models.list(**extra)


def test_401_is_openai_shaped_and_health_stays_open(guarded):
    for path, headers in [("/v1/models", {}), ("/v1/completions", {"Authorization": f"Basic {KEY}"}),
                          ("/v1/nowhere", {"Authorization": "Bearer"}), ("/metrics", {})]:
        r = httpx.get(guarded.url + path, headers=headers)
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert httpx.get(guarded.url + "/health").json() == {"status": "ok"}
    keyed = httpx.get(guarded.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert keyed.status_code == 200 and "dspark_requests_finished_total" in keyed.text


def test_metrics_stay_open_without_metrics_auth(qwen3_dir):
    with ServerThread(build_app(serve_args(qwen3_dir, "--api-key", KEY))) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 200
        assert httpx.get(srv.url + "/v1/models").status_code == 401


def test_the_key_comes_from_the_environment(qwen3_dir, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "from-env")
    assert resolve_api_key(None) == "from-env" and resolve_api_key("flag") == "flag"
    with ServerThread(build_app(serve_args(qwen3_dir))) as srv:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert client(srv, "from-env").models.list().data[0].id == MODEL
    for empty in ("", "  "):
        with pytest.raises(ValueError, match="empty"):
            resolve_api_key(empty)
    monkeypatch.delenv(ENV_VAR)
    assert resolve_api_key(None) is None
    with pytest.raises(ValueError, match="metrics-auth"):
        build_app(serve_args(qwen3_dir, "--metrics-auth"))


def test_the_ray_backend_hands_the_key_to_every_replica(qwen3_dir, monkeypatch):
    """`dspark serve --backend ray` resolves the key where it runs (flag or environment) and
    every replica builds its app from those arguments: the replica's app refuses a keyless call."""
    import warnings

    with warnings.catch_warnings():  # Ray's own pydantic deprecation warnings at import
        warnings.simplefilter("ignore", DeprecationWarning)
        pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
        from dspark.server import ray_backend

    seen = []
    monkeypatch.setattr(ray_backend, "run", lambda args: seen.append(ray_backend.engine_options(args)) or 0)
    monkeypatch.setenv(ENV_VAR, "ray-key")
    args = serve_args(qwen3_dir, "--backend", "ray", "--replicas", "2")
    assert commands.run(args) == 0 and seen[0]["api_key"] == "ray-key"
    monkeypatch.delenv(ENV_VAR)  # a replica's process need not have the variable
    import argparse

    with ServerThread(build_app(argparse.Namespace(**seen[0]))) as replica_app:
        assert httpx.get(replica_app.url + "/v1/models").status_code == 401
        assert client(replica_app, "ray-key").models.list().data[0].id == MODEL
