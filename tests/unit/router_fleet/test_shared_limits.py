"""Per-key limits hold across two router processes through one real redis-server; a crashed router's slots come
back by their lease; Redis down is a 503 `limits_unavailable` in each API's shape, and Redis back is service back."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from tests.unit.router_fleet.conftest import KEYS, LEASE_MS, Fleet, RouterProcess, auth
from tests.unit.router_front.conftest import MODEL

SHORT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "write"}], "max_tokens": 3000, "stream": True,
        "ignore_eos": True}


async def chat(http: aiohttp.ClientSession, router: RouterProcess, key: str) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with http.post(f"{router.url}/v1/chat/completions", json=SHORT, headers=auth(key)) as response:
        return response.status, await response.json(), dict(response.headers)


async def usage(http: aiohttp.ClientSession, router: RouterProcess, key: str) -> dict[str, Any]:
    async with http.get(f"{router.url}/v1/usage", headers=auth(key)) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def hold(http: aiohttp.ClientSession, router: RouterProcess, key: str) -> aiohttp.ClientResponse:
    """A long streamed request, returned once its first chunk arrived: it holds one of the key's slots until closed."""
    response = await http.post(f"{router.url}/v1/chat/completions", json=LONG, headers=auth(key))
    assert response.status == 200, await response.text()
    await asyncio.wait_for(response.content.readline(), 60)
    return response


async def test_rpm_holds_across_both_routers(fleet: Fleet) -> None:
    """rpm = 4 allows four requests a minute in total, whichever router each reaches; the fifth is a 429 on either."""
    a, b = fleet.routers
    async with aiohttp.ClientSession() as http:
        assert [(await chat(http, router, "rpm4"))[0] for router in (a, b, a, b)] == [200, 200, 200, 200]
        for router in (a, b):
            status, body, headers = await chat(http, router, "rpm4")
            assert (status, body["error"]["code"]) == (429, "rpm_limit_exceeded")
            assert 1 <= int(headers["Retry-After"]) <= 60
        totals = await usage(http, a, "rpm4")
        async with http.get(f"{b.url}/health") as response:
            health = await response.json()
    assert totals["requests"] == 4  # the shared totals: two requests went through each router
    assert health["limits_store"] == fleet.redis.url  # GET /health says where the limits are counted


async def test_concurrency_holds_across_both_routers(fleet: Fleet) -> None:
    """max_concurrent = 1: while router A streams the key's request, router B refuses a second one; after, B admits."""
    a, b = fleet.routers
    async with aiohttp.ClientSession() as http:
        held = await hold(http, a, "one_at_a_time")
        status, body, _ = await chat(http, b, "one_at_a_time")
        assert (status, body["error"]["code"]) == (429, "concurrency_limit_exceeded")
        assert (await usage(http, b, "one_at_a_time"))["in_flight"] == 1  # B sees A's request
        held.close()  # the client leaves: A cancels the request and gives the slot back
        deadline = time.monotonic() + 10
        while (status := (await chat(http, b, "one_at_a_time"))[0]) == 429:
            assert time.monotonic() < deadline, "B still refuses 10 s after A's request ended"
            await asyncio.sleep(0.1)
        assert status == 200


async def test_quota_holds_across_both_routers(fleet: Fleet) -> None:
    """token_quota = 60: tokens spent through router A count on router B, which then refuses with insufficient_quota."""
    a, b = fleet.routers
    async with aiohttp.ClientSession() as http:
        spent = 0
        while spent < 60:
            status, body, _ = await chat(http, a, "quota")
            assert status == 200, body
            spent += body["usage"]["total_tokens"]
        status, body, headers = await chat(http, b, "quota")
        assert (status, body["error"]["code"], headers.get("x-should-retry")) == (429, "insufficient_quota", "false")
        assert (await usage(http, b, "quota"))["total_tokens"] == spent


async def test_killed_router_frees_its_slots_by_lease_and_the_other_keeps_counting(fleet: Fleet, tmp_path) -> None:
    """A router killed -9 mid-request never gives its slot back: the lease frees it, and the surviving router serves and counts."""
    b = fleet.routers[1]
    c = RouterProcess(tmp_path / "router3", fleet.engine, fleet.redis.url)
    try:
        async with aiohttp.ClientSession() as http:
            before = (await usage(http, b, "crash"))["requests"]
            held = await hold(http, c, "crash")
            c.kill()
            killed = time.monotonic()
            held.close()
            status, body, _ = await chat(http, b, "crash")
            assert (status, body["error"]["code"]) == (429, "concurrency_limit_exceeded")  # the dead router's slot still counts
            while (status := (await chat(http, b, "crash"))[0]) == 429:
                # The lease is 3 s; the bound only catches a slot that never comes back.
                assert time.monotonic() - killed < LEASE_MS / 1000 + 10, "the killed router's slot was never freed"
                await asyncio.sleep(0.2)
            freed_after = time.monotonic() - killed
            assert status == 200
            assert (await usage(http, b, "crash"))["requests"] == before + 1  # B counted its request (the killed one: never)
    finally:
        c.stop()
    assert freed_after >= LEASE_MS / 1000 * 0.5  # freed by the lease running out, not by anyone giving it back


async def test_redis_down_is_503_in_each_api_shape_and_back_with_its_totals(fleet: Fleet) -> None:
    """Redis stopped: generation requests fail closed with a prompt 503 limits_unavailable (OpenAI and Anthropic shapes);
    Redis restarted on its append-only file: the routers serve again and the key's totals from before are still there."""
    a, b = fleet.routers
    async with aiohttp.ClientSession() as http:
        assert (await chat(http, a, "outage"))[0] == 200
        fleet.redis.stop()
        try:
            started = time.monotonic()
            status, body, headers = await chat(http, b, "outage")
            assert (status, body["error"]["code"], headers["Retry-After"]) == (503, "limits_unavailable", "2")
            assert time.monotonic() - started < 5  # timeout_ms = 500 bounds it; 5 s only catches a hang
            messages = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(f"{b.url}/v1/messages", json=messages, headers={"x-api-key": KEYS["outage"][1]}) as response:
                anthropic = await response.json()
            assert response.status == 503 and anthropic["type"] == "error" and anthropic["error"]["type"] == "overloaded_error"
        finally:
            fleet.redis.start()
        deadline = time.monotonic() + 15
        while (status := (await chat(http, b, "outage"))[0]) == 503:
            assert time.monotonic() < deadline, "still 503 15 s after Redis came back"
            await asyncio.sleep(0.2)
        assert status == 200
        assert (await usage(http, a, "outage"))["requests"] == 2  # the one before the outage survived Redis's restart
    lines = [json.loads(line) for line in b.log_path.read_text().splitlines() if line.startswith("{")]
    assert any(line["event"] == "limit_store.unavailable" and line["op"] == "take" for line in lines)
    assert not any(KEYS["outage"][1] in line for line in b.log_path.read_text().splitlines())  # the key is never logged
