"""The typed error tree every HTTP service raises, and the one boundary that turns it into a body.

Handlers raise `APIError` subclasses; `error_middleware(render)` maps them (and any unexpected
exception, as a 500 without a stack trace) to a JSON response in the API's own shape. The engine
uses `openai_error_body`; the router picks a shape per endpoint (OpenAI, Anthropic, Responses).
`request_id_middleware` gives every request an id (X-Request-ID accepted, or a new one), puts it
in the logging context and echoes it on the response (the engines'); the router mints its own (`enter_request`).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from loguru import logger

from stack.common import events, json_text
from stack.common.logging import REQUEST_ID, RequestTokens, enter_context, log_event, request_context

REQUEST_ID_HEADER = "X-Request-ID"


class APIError(Exception):
    """Base: an error a client can see. Subclasses fix status and OpenAI `type`."""

    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}


class InvalidRequest(APIError):
    """The request body or parameters are wrong (400)."""

    status, type = 400, "invalid_request_error"


class Unauthorized(APIError):
    """Missing, malformed or unknown API key (401)."""

    status, type = 401, "authentication_error"


class PermissionDenied(APIError):
    """The key is valid but may not do this (403)."""

    status, type = 403, "permission_error"


class NotFound(APIError):
    """Unknown model or route (404)."""

    status, type = 404, "not_found_error"


class PayloadTooLarge(APIError):
    """The request body exceeds the size limit (413)."""

    status, type = 413, "request_too_large"


class RequestTimeout(APIError):
    """The client announced a body and did not send it within the server's body timeout (408)."""

    status, type = 408, "invalid_request_error"


class UnsupportedMediaType(APIError):
    """A body encoding the server does not decode (Content-Encoding: gzip …) (415)."""

    status, type = 415, "invalid_request_error"


class RateLimited(APIError):
    """A per-key rate or concurrency limit was hit; retry later (429)."""

    status, type = 429, "rate_limit_exceeded"


class QuotaExhausted(APIError):
    """The key's total token quota is used up; retrying will not help (429)."""

    status, type = 429, "insufficient_quota"


class Overloaded(APIError):
    """Every backend slot is busy and the queue is full, or no backend is up (503)."""

    status, type = 503, "overloaded_error"


class UpstreamError(APIError):
    """A backend answered with an error or broke the connection (502)."""

    status, type = 502, "upstream_error"


class UpstreamTimeout(APIError):
    """A backend did not answer in time (504)."""

    status, type = 504, "timeout_error"


class ServerError(APIError):
    """A bug or an unexpected condition inside the service (500)."""

    status, type = 500, "server_error"


def openai_error_body(err: APIError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


Renderer = Callable[[web.Request, APIError], dict[str, Any]]


def error_response(request: web.Request, err: APIError, render: Renderer = lambda _r, e: openai_error_body(e)) -> web.Response:
    headers = {REQUEST_ID_HEADER: request.get(REQUEST_ID, "-"), **err.headers}
    return web.json_response(render(request, err), status=err.status, headers=headers, dumps=json_text.dumps)


def error_answer(request: web.Request, exc: Exception, render: Renderer = lambda _r, e: openai_error_body(e)) -> web.Response:
    """The one mapping of an exception to an error answer in the API's shape (`error_middleware`, and the router's front
    middleware). An HTTP exception below 400 (a redirect) is raised again: it is an answer, not an error."""
    if isinstance(exc, APIError):
        # Client mistakes and capacity (a full queue, no slot in time: 503 with Retry-After) are WARNING; only
        # faults of ours or of a backend (500, 502, 504) are ERROR.
        level = "WARNING" if exc.status < 500 or isinstance(exc, Overloaded) else "ERROR"
        event = events.HTTP_BAD_REQUEST if exc.status < 500 else events.HTTP_ERROR
        # `param`: the field the error names, for the doctor to count by (checks/client_request.py)
        log_event(event, exc.message, level, status=exc.status, type=exc.type, code=exc.code,
                  **({"param": exc.param} if exc.param else {}))
        return error_response(request, exc, render)
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        # aiohttp's own 404/405/413 become errors in the API's shape.
        mapped = {404: NotFound, 405: InvalidRequest, 413: PayloadTooLarge}.get(exc.status, InvalidRequest)
        err = mapped(f"{exc.reason}: {request.method} {request.path}" if exc.status in (404, 405) else exc.reason, code=str(exc.status))
        err.status = exc.status
        log_event(events.HTTP_BAD_REQUEST, err.message, "WARNING", status=err.status, type=err.type)
        return error_response(request, err, render)
    logger.bind(event=events.HTTP_ERROR).opt(exception=exc).error(f"unhandled error on {request.method} {request.path}")
    return error_response(request, ServerError("internal error; see the service log for this request id"), render)


def error_middleware(render: Renderer = lambda _r, e: openai_error_body(e)) -> Callable:
    """The single place where exceptions become HTTP error bodies (`error_answer`)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            return await handler(request)
        except Exception as exc:
            return error_answer(request, exc, render)

    return middleware


def new_id() -> str:
    """A fresh random id (request, KV transfer, limiter slot): 32 hex digits, the form of uuid4().hex for a quarter of
    its cost; each request mints several on the router's hot path."""
    return os.urandom(16).hex()


CLIENT_REQUEST_ID = web.RequestKey("client_request_id", str)  # the X-Request-ID a client sent, when ours is minted (below)


def enter_request(request: web.Request) -> RequestTokens:
    """The router's: every request gets a fresh id (response ids, logs, the engine legs are named by it), so two
    requests never share one. A client's X-Request-ID is kept as `client_request_id` (on every log line of the request)
    and echoed back in X-Client-Request-ID; our id goes back in X-Request-ID (`echo_request_ids`, whoever answers).
    The ids are the logging context until `logging.leave_context` (the router's front middleware, app.py)."""
    request_id = new_id()
    client_id = request.headers.get(REQUEST_ID_HEADER, "").strip()[:128]
    request[REQUEST_ID] = request_id
    if client_id:
        request[CLIENT_REQUEST_ID] = client_id
    return enter_context(request_id, client_id or None)


CLIENT_REQUEST_ID_HEADER = "X-Client-Request-ID"


async def echo_request_ids(request: web.Request, response: web.StreamResponse) -> None:
    """The router's on_response_prepare: every answer (streams, and answers sent before the middlewares return) carries
    our id in X-Request-ID and echoes the client's X-Request-ID as X-Client-Request-ID."""
    if REQUEST_ID in request:
        response.headers.setdefault(REQUEST_ID_HEADER, request[REQUEST_ID])
    client_id = request.get(CLIENT_REQUEST_ID)
    if client_id:
        response.headers[CLIENT_REQUEST_ID_HEADER] = client_id


@web.middleware
async def request_id_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """The engines': accept X-Request-ID (the router names each leg; or mint one), log under it, and echo it back.
    X-Client-Request-ID (the router passes on its client's own id) goes on the lines as client_request_id."""
    request_id = request.headers.get(REQUEST_ID_HEADER, "").strip()[:128] or new_id()
    request[REQUEST_ID] = request_id
    with request_context(request_id, request.headers.get(CLIENT_REQUEST_ID_HEADER, "").strip()[:128] or None):
        response = await handler(request)
    if not response.prepared:
        response.headers[REQUEST_ID_HEADER] = request_id
    return response
