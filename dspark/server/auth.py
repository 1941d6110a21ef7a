"""Who may call the server: an API key checked on every `/v1/*` request, as vLLM does.

    dspark serve --api-key SECRET            # or DSPARK_API_KEY=SECRET dspark serve
    curl -H 'Authorization: Bearer SECRET' localhost:8000/v1/models
    dspark serve --api-key SECRET --metrics-auth   # /metrics needs the key too

`ApiKeyGuard` is a plain ASGI middleware (Starlette's BaseHTTPMiddleware would sit between
a streaming response and its client's disconnect). A request without the right bearer token
gets OpenAI's 401 error body; the key is compared in constant time. `/health` stays open.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Mapping
from typing import Any

from dspark.server.protocol import ApiError

ENV_VAR = "DSPARK_API_KEY"


def resolve_api_key(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The flag wins over the environment; an empty key is refused (it would admit anyone)."""
    key = flag if flag is not None else environ.get(ENV_VAR)
    if key is not None and not key.strip():
        raise ValueError(f"the API key (--api-key or {ENV_VAR}) is empty")
    return key


def protected(path: str, metrics_auth: bool) -> bool:
    return path == "/v1" or path.startswith("/v1/") or (metrics_auth and path == "/metrics")


def refused(scope: Mapping[str, Any], api_key: str | None, metrics_auth: bool) -> bool:
    """True when this HTTP request must get a 401 (no key configured: nothing is refused)."""
    return (api_key is not None and scope.get("type") == "http" and protected(scope["path"], metrics_auth)
            and not authorized(scope, api_key))


def authorized(scope: Mapping[str, Any], key: str) -> bool:
    """True when the request carries `Authorization: Bearer <key>` (constant-time compare)."""
    header = b""
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            header = value
            break
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


UNAUTHORIZED = ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                        code="invalid_api_key")


async def send_unauthorized(send: Any) -> None:
    body = json.dumps(UNAUTHORIZED.body()).encode()
    await send({"type": "http.response.start", "status": 401, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})


class ApiKeyGuard:
    """ASGI middleware: 401 for a protected path without the key; everything else passes."""

    def __init__(self, app: Any, api_key: str, metrics_auth: bool = False) -> None:
        self.app, self.api_key, self.metrics_auth = app, api_key, metrics_auth

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if refused(scope, self.api_key, self.metrics_auth):
            await send_unauthorized(send)
            return
        await self.app(scope, receive, send)
