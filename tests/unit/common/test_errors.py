"""The one error boundary: typed errors become API-shaped bodies, bugs become a 500 without a trace."""

from __future__ import annotations

from aiohttp import web

from stack.common.errors import REQUEST_ID_HEADER, InvalidRequest, RateLimited, error_middleware, request_id_middleware


def _app() -> web.Application:
    async def bad(request: web.Request) -> web.Response:
        raise InvalidRequest("max_tokens must be > 0, got 0", param="max_tokens", code="invalid_value")

    async def limited(request: web.Request) -> web.Response:
        raise RateLimited("too many requests", headers={"Retry-After": "7"})

    async def bug(request: web.Request) -> web.Response:
        raise RuntimeError("secret internals")

    app = web.Application(middlewares=[request_id_middleware, error_middleware()])
    app.router.add_post("/bad", bad)
    app.router.add_post("/limited", limited)
    app.router.add_post("/bug", bug)
    return app


async def test_typed_error_maps_to_openai_shape(aiohttp_client) -> None:
    """InvalidRequest → 400 with message, type, param, code, and the request id echoed."""
    client = await aiohttp_client(_app())
    response = await client.post("/bad", headers={REQUEST_ID_HEADER: "rid-7"})
    assert response.status == 400
    assert response.headers[REQUEST_ID_HEADER] == "rid-7"
    assert await response.json() == {
        "error": {"message": "max_tokens must be > 0, got 0", "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_value"}
    }


async def test_error_headers_and_unknown_routes(aiohttp_client) -> None:
    """Retry-After travels with a 429; an unknown route is a 404 in the same JSON shape."""
    client = await aiohttp_client(_app())
    limited = await client.post("/limited")
    assert limited.status == 429 and limited.headers["Retry-After"] == "7"
    assert (await limited.json())["error"]["type"] == "rate_limit_exceeded"
    missing = await client.get("/nowhere")
    assert missing.status == 404
    assert (await missing.json())["error"]["type"] == "not_found_error"


async def test_unexpected_exception_is_500_without_internals(aiohttp_client) -> None:
    """A bug answers 500 with a generic message; the exception text never reaches the client."""
    client = await aiohttp_client(_app())
    response = await client.post("/bug")
    assert response.status == 500
    body = await response.text()
    assert "secret internals" not in body and "Traceback" not in body
    assert (await response.json())["error"]["type"] == "server_error"
    assert len(response.headers[REQUEST_ID_HEADER]) == 32
