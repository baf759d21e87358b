"""A tiny in-process OpenAI-style SSE server for the load generator tests.

It streams `tokens` chat chunks (first after `first_delay` s, then every `gap` s), then the usage
chunk with empty `choices` and `data: [DONE]`, and records how many requests were in flight at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from stack.common import sse


@dataclass
class StreamPlan:
    tokens: int = 3
    first_delay: float = 0.0
    gap: float = 0.0
    status: int = 200
    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)


PLAN = web.AppKey("plan", StreamPlan)


async def _chat(request: web.Request) -> web.StreamResponse:
    plan = request.app[PLAN]
    body = await request.json()
    plan.bodies.append(body)
    plan.headers.append(dict(request.headers))
    if plan.status != 200:
        return web.json_response({"error": {"message": "invalid api key", "type": "authentication_error"}},
                                 status=plan.status)
    plan.in_flight += 1
    plan.max_in_flight = max(plan.max_in_flight, plan.in_flight)
    try:
        stream = await sse.open_stream(request)
        await asyncio.sleep(plan.first_delay)
        for i in range(plan.tokens):
            if i:
                await asyncio.sleep(plan.gap)
            await sse.send_event(stream, {"choices": [{"index": 0, "delta": {"content": "x"}}]})
        await sse.send_event(stream, {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": plan.tokens}})
        await sse.send_done(stream)
        return stream
    finally:
        plan.in_flight -= 1


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "dummy:small", "object": "model"}]})


@pytest.fixture
def plan() -> StreamPlan:
    return StreamPlan()


def make_app(plan: StreamPlan) -> web.Application:
    app = web.Application()
    app[PLAN] = plan
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    return app


@pytest.fixture
async def sse_server(aiohttp_server, plan: StreamPlan):
    """Started on a free port by pytest-aiohttp and stopped after the test."""
    return await aiohttp_server(make_app(plan))
