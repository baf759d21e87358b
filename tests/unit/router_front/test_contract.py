"""Router and engine give the same verdict on every boundary value of every sampling field.

The cases are generated from the bounds table (stack.protocol.bounds.BOUNDS): just outside, at and
just inside each limit, a wrong type and null, for each kind the row applies to. Each body goes
once through the real router to a real engine process (dummy:tiny) and once to the engine alone;
both must answer 200, or both 400 naming the same `param` with the same `code`. A 400 the router
relays from the engine (`upstream_rejected`) would mean the router accepted what the engine
refuses: the disagreement this test exists to catch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from stack.protocol.bounds import BOUNDS, Bound
from stack.router import config as router_config
from stack.router.app import create_app
from tests.unit.router_front.conftest import KEY, KEY_ENV, MODEL, RealEngine, auth, write_settings

pytestmark = pytest.mark.asyncio(loop_scope="module")

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
BASE: dict[str, dict[str, Any]] = {
    "chat": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0},
    "completion": {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0},
}


def probes(bound: Bound) -> list[Any]:
    """Values around each limit of `bound`, plus wrong types and null."""
    if bound.value in ("int", "number"):
        step = 1 if bound.value == "int" else 0.001
        edges = [edge for edge in (bound.low, bound.high) if edge is not None]
        near = [round(edge + d, 6) if bound.value == "number" else int(edge + d) for edge in edges for d in (-step, 0, step)]
        wrong = ["1", True] + ([1.5] if bound.value == "int" else [])
        return [*near, *wrong, None]
    if bound.value == "bool":
        return [True, False, "true", 1, None]
    if bound.value == "strings":
        most = bound.max_items or 1
        return ["x", "", [], [""], ["x"] * most, ["x"] * (most + 1), 5, ["x", 5], None]
    if bound.value == "token_ids":
        return [[], [0], [1, 2], [-1], [1.5], "1", None]
    low, high = bound.low or 0, bound.high or 0
    return [{}, {"1": low}, {"1": high}, {"1": low - 1}, {"1": high + 1}, {"x": 1}, {"1": "a"}, [], None]


CASES = [(kind, bound.name, value) for bound in BOUNDS for kind in sorted(bound.kinds) for value in probes(bound)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(real_engine: RealEngine, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TestClient]:
    """One router over the module's real engine, shared by every case (a router per case would dominate the run)."""
    tmp: Path = tmp_path_factory.mktemp("contract-router")
    config = router_config.load(write_settings(tmp, real_engine.url, health=real_engine.health_addr), env={})
    client = TestClient(TestServer(create_app(config, env={KEY_ENV: KEY}), host="127.0.0.1"))
    await client.start_server()
    yield client
    await client.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def verdict(response: aiohttp.ClientResponse | Any) -> tuple[int, str | None, str | None]:
    body = await response.json()
    error = body.get("error") or {}
    return response.status, error.get("param"), error.get("code")


@pytest.mark.parametrize(("kind", "field", "value"), CASES, ids=[f"{k}-{f}-{v!r}"[:60] for k, f, v in CASES])
async def test_router_and_engine_agree(router: TestClient, session: aiohttp.ClientSession, real_engine: RealEngine,
                                       kind: str, field: str, value: Any) -> None:
    """The router's verdict on a sampling value equals the engine's own, and is never an engine refusal relayed."""
    body = {**BASE[kind], field: value}
    through_router = await verdict(await router.post(PATHS[kind], json=body, headers=auth()))
    async with session.post(real_engine.url + PATHS[kind], json=body) as response:
        engine_alone = await verdict(response)

    assert through_router[2] != "upstream_rejected", f"the router accepted {field}={value!r} and the engine refused it: {engine_alone}"
    assert through_router == engine_alone
    assert through_router[0] in (200, 400)


@pytest.mark.parametrize("kind", sorted(PATHS))
async def test_a_limit_only_the_model_knows_keeps_the_engines_param_and_code(router: TestClient, session: aiohttp.ClientSession,
                                                                             real_engine: RealEngine, kind: str) -> None:
    """The context length is the engine's to check (the router cannot know it): its 400 reaches the client with
    the engine's own param and code, not a generic upstream_rejected."""
    body = {**BASE[kind], "max_tokens": 10**6}
    through_router = await verdict(await router.post(PATHS[kind], json=body, headers=auth()))
    async with session.post(real_engine.url + PATHS[kind], json=body) as response:
        engine_alone = await verdict(response)
    assert engine_alone == (400, "max_tokens", "context_length_exceeded")
    assert through_router == engine_alone


async def test_a_responses_client_is_told_its_own_field(router: TestClient) -> None:
    """The same refusal on /v1/responses names max_output_tokens, the field that client sent (the engine saw max_tokens)."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 10**6}
    for stream in (False, True):
        answer = await router.post("/v1/responses", json={**body, "stream": stream}, headers=auth())
        assert await verdict(answer) == (400, "max_output_tokens", "context_length_exceeded")
