"""Issue 12, abuse and exposure: slow or bad clients get a 4xx and free their slot, the JSON limits hold before
any parser, engines refuse callers without the internal key, a wedged process exits so its restart policy applies."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from stack.common import internal_auth, safe_json
from stack.common.errors import InvalidRequest, error_middleware, request_id_middleware
from stack.common.logging import redact, setup_logging
from stack.common.server import LIVENESS_EXIT_CODE, LivenessWatchdog
from stack.router import config as router_config
from stack.router.app import create_app
from stack.router.appkeys import LIMITER
from tests.unit.router_front.conftest import KEY, KEY_ENV, MODEL, FakeEngine, write_settings


@pytest.fixture
async def router(tmp_path: Path):
    """A colocated router (body_timeout_ms = 1000) over the router_front stand-in engine; yields (client, engine)."""
    fake = FakeEngine()
    engine_server = TestServer(fake.app, host="127.0.0.1")
    await engine_server.start_server()
    settings = write_settings(tmp_path, f"http://127.0.0.1:{engine_server.port}", limits="max_concurrent = 2")
    text = settings.read_text().replace("max_body_bytes = 65536", "max_body_bytes = 65536\nbody_timeout_ms = 1000")
    settings.write_text(text)
    client = TestClient(TestServer(create_app(router_config.load(settings, env={}), env={KEY_ENV: KEY}), host="127.0.0.1"))
    await client.start_server()
    yield client, fake
    await client.close()
    await engine_server.close()


HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


@pytest.mark.parametrize(("raw", "code"), [
    (b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}", "json_too_deep"),
    (b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}", "json_number_too_long"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_json"),
])
async def test_json_past_a_limit_is_a_400_on_every_api(router, raw: bytes, code: str) -> None:
    """Deep nesting, huge number literals and lone surrogates are 400s in each API's shape, never 500/502."""
    client, fake = router
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/messages/count_tokens"):
        response = await client.post(path, data=raw, headers=HEADERS)
        body = await response.json()
        assert response.status == 400, (path, body)
        error = body["error"]
        assert (error.get("code") == code) if "code" in error else code in json.dumps(body) or error["type"] == "invalid_request_error"
    assert fake.requests == []


async def test_a_compressed_body_is_415(router) -> None:
    client, _ = router
    response = await client.post("/v1/chat/completions", data=json.dumps(chat()).encode(),
                                 headers={**HEADERS, "Content-Encoding": "gzip"})
    assert response.status == 415 and (await response.json())["error"]["code"] == "unsupported_content_encoding"


async def test_a_body_that_never_arrives_is_408_and_holds_no_slot(router) -> None:
    """Content-Length announced, body never sent: 408 after body_timeout_ms, and the key's in_flight never counted it."""
    client, _ = router
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"".encode())
    await writer.drain()
    await asyncio.sleep(0.3)
    limiter = client.app[LIMITER]
    assert limiter.in_flight("default") == 0  # still reading the body: not in flight
    started = time.monotonic()
    head = await asyncio.wait_for(reader.readline(), 10)
    # Lower bound: the body timeout (1 s) really waited; upper bound (10 s) catches a hang.
    assert b"408" in head and 0.5 <= time.monotonic() - started + 0.3 < 10
    writer.close()
    assert limiter.in_flight("default") == 0
    ok = await client.post("/v1/chat/completions", json=chat(), headers=HEADERS)
    assert ok.status == 200


async def test_request_ids_are_unique_even_when_clients_repeat_theirs(router) -> None:
    client, _ = router
    answers = [await client.post("/v1/chat/completions", json=chat(), headers={**HEADERS, "X-Request-ID": "same"})
               for _ in range(6)]
    ids = {a.headers["X-Request-ID"] for a in answers}
    assert len(ids) == 6 and all(a.headers["X-Client-Request-ID"] == "same" for a in answers)


def test_the_redactor_keeps_hints_readable() -> None:
    hint = "Missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`."
    assert redact(hint) == hint
    assert redact("Authorization: Bearer abcdef123456") == "Authorization: Bearer [REDACTED]"


def test_http_parser_garbage_is_a_warning_not_an_error() -> None:
    import logging

    from aiohttp.http_exceptions import BadStatusLine

    sink = io.StringIO()
    setup_logging("router", sink=sink)
    try:
        raise BadStatusLine(b"\x16\x03\x01")
    except BadStatusLine:
        logging.getLogger("aiohttp.server").exception("Error handling request from %s", "10.0.0.9")
    [line] = [json.loads(x) for x in sink.getvalue().splitlines()]
    assert line["level"] == "WARNING"


def test_safe_json_accepts_real_bodies_and_strings_full_of_brackets() -> None:
    body = {"messages": [{"role": "user", "content": "[[[{{{ \\\" ]]] 😀 " * 100}], "tools": [{"a": {"b": {"c": [1.5e10, -3]}}}]}
    safe_json.check_body(json.dumps(body).encode())
    safe_json.check_body(json.dumps(body, ensure_ascii=True).encode())  # a surrogate pair, escaped, is fine
    with pytest.raises(InvalidRequest):
        safe_json.check_body(b"[" * (safe_json.MAX_DEPTH + 1) + b"]" * (safe_json.MAX_DEPTH + 1))


@pytest.mark.parametrize("text", ['ends in a backslash \\', 'a \\" b', '\\\\"[[[', '"{"{"{', 'x\\\\\\" ]]]] \\u005c"'])
def test_safe_json_finds_the_strings_whatever_their_escapes(text: str) -> None:
    """Escaped quotes and backslashes in any order never make string text count as structure, nor hide real nesting
    after the string: the limits are exact (MAX_DEPTH passes, one more level fails; a long number outside a string)."""
    deep = lambda n: "[" * n + "1" + "]" * n  # noqa: E731
    pad = json.dumps([text] * 40 + ["[" * 80, "9" * 200])  # strings full of brackets, digits and escapes
    safe_json.check_body(f'{{"s": {pad}, "d": {deep(safe_json.MAX_DEPTH - 1)}}}'.encode())
    with pytest.raises(InvalidRequest, match="nests JSON 65 levels"):
        safe_json.check_body(f'{{"s": {pad}, "d": {deep(safe_json.MAX_DEPTH)}}}'.encode())
    with pytest.raises(InvalidRequest, match="number literal"):
        safe_json.check_body(f'{{"s": {pad}, "n": {"9" * (safe_json.MAX_NUMBER_CHARS + 1)}}}'.encode())


async def test_an_engine_refuses_callers_without_the_internal_key(aiohttp_client) -> None:
    """/v1/* needs `Bearer <PD_INTERNAL_KEY>` (the clients' key is refused too); /health stays open."""
    async def ok(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[request_id_middleware, internal_auth.middleware({"PD_INTERNAL_KEY": "inside-secret"}),
                                       error_middleware()])
    app.router.add_get("/v1/models", ok)
    app.router.add_get("/health", ok)
    client = await aiohttp_client(app)
    assert (await client.get("/v1/models")).status == 401
    assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).status == 401
    assert (await client.get("/v1/models", headers={"Authorization": "Bearer inside-secret"})).status == 200
    assert (await client.get("/health")).status == 200


def test_the_liveness_watchdog_exits_after_failures_in_a_row() -> None:
    """Its own health check failing N times in a row (nothing listens here) → exit 70; the restart policy does the rest."""
    exited = threading.Event()
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        exited.set()

    watchdog = LivenessWatchdog("127.0.0.1:9", interval_s=0.05, failures=3, exit=fake_exit)
    setup_logging("engine", sink=io.StringIO())
    watchdog.start()
    # Upper bound (10 s): three 50 ms probes of a closed port; catches a watchdog that never fires.
    assert exited.wait(10) and codes == [LIVENESS_EXIT_CODE]
