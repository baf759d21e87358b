"""An engine that refuses the router's internal key (its VLLM_API_KEY ≠ the router's PD_INTERNAL_KEY): the client gets a
502 naming the mismatch, never a 400 that blames the client's request."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from stack.common import events
from stack.common.errors import UpstreamError
from tests.unit.router_pd.conftest import INTERNAL_KEY, typed

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


class KeyedEngine:
    """vLLM's API-key middleware in front of nothing: /health is open, every /v1 path needs `Bearer <its key>` and
    answers 401 {"error": "Unauthorized"} otherwise (vllm/entrypoints/openai/api_server.py AuthenticationMiddleware)."""

    def __init__(self, key: str, status: int = 401) -> None:
        self.key, self.status = key, status
        self.refused = 0
        self.url = self.health_addr = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> KeyedEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/v1/{tail:.*}", self._v1)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.health_addr = f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        self.url = f"http://{self.health_addr}"
        return self

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _v1(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            self.refused += 1
            return web.json_response({"error": "Unauthorized"}, status=self.status)
        return web.json_response({"error": {"message": "not a real engine"}}, status=500)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def keyed() -> AsyncIterator[list[KeyedEngine]]:
    started: list[KeyedEngine] = []
    yield started
    for engine in started:
        await engine.stop()


@pytest.mark.parametrize("status", [401, 403])
async def test_engine_refusing_the_internal_key_is_a_502_naming_the_mismatch(keyed, fake, pd, logs, status):
    """A prefill whose key is not the router's: 502 internal_key_rejected naming PD_INTERNAL_KEY; the engine's status is
    in the router's log for the doctor (router.upstream_error)."""
    prefill = await KeyedEngine("another-key", status).start()
    keyed.append(prefill)
    assert INTERNAL_KEY != "another-key"
    client = await pd([prefill], [await fake("decode")], health_check="http")
    with pytest.raises(UpstreamError) as caught:
        await client.complete("rkey", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    error = caught.value
    assert error.status == 502 and error.code == "internal_key_rejected"
    assert "PD_INTERNAL_KEY" in error.message and f"HTTP {status}" in error.message and "prefill engine" in error.message
    assert prefill.refused >= 1
    upstream = logs.events(events.ROUTER_UPSTREAM_ERROR)
    assert upstream and upstream[0]["status"] == status and upstream[0]["backend"] == prefill.url
