"""The engines accept only the router: a shared internal key on every engine call (issue 12).

`./pd up` generates PD_INTERNAL_KEY into .env (as it does TAOTOKEN_API_KEY; never the clients' key).
The router sends `Authorization: Bearer <PD_INTERNAL_KEY>` on every engine request (upstream.new_session);
our engine checks it with `middleware(...)`, vLLM with `--api-key`. Refused callers get 401 on /v1/*
and /tokenize; GET /health and gRPC health stay open for probes. Unset (unit tests, a bare `python -m
stack.engine`): every caller is accepted and the engine says so once at start, as a WARNING.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from stack.common import events
from stack.common.errors import Unauthorized, error_response
from stack.common.logging import log_event, register_secret
from stack.common.secret_env import read_secret

ENV = "PD_INTERNAL_KEY"
_OPEN_PATHS = ("/health", "/metrics")


def internal_key(env: Mapping[str, str] | None = None) -> str | None:
    """PD_INTERNAL_KEY, registered with the log redactor, or None when unset."""
    key = read_secret(os.environ if env is None else env, ENV).strip()  # or the file PD_INTERNAL_KEY_FILE names
    if key:
        register_secret(key)
    return key or None


def middleware(env: Mapping[str, str] | None = None) -> Callable:
    """An aiohttp middleware refusing /v1/* and /tokenize without the internal key (see the module doc)."""
    key = internal_key(env)
    if key is None:
        log_event(events.INTERNAL_AUTH_OPEN, f"{ENV} is unset: this engine accepts any caller on /v1/* (run it behind ./pd up)")
    expected = f"Bearer {key}".encode() if key else b""

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if key is None or request.path in _OPEN_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            log_event(events.INTERNAL_AUTH_REJECTED, f"refused {request.method} {request.path}: not the router's {ENV}", "WARNING",
                      path=request.path, peer=request.remote or "-")
            return error_response(request, Unauthorized(f"this engine answers only its router (Authorization: Bearer <{ENV}>)",
                                                        code="internal_key_required"))
        return await handler(request)

    return check
