"""The one seam between the router and an engine's HTTP API: send a leg, map what goes wrong.

Every upstream failure becomes `LegFailed(error, retryable)`: `error` is the typed APIError the
client sees if no retry helps, `retryable` says whether another backend might succeed (connect
errors, 5xx, overload, timeouts, a broken connection) or not (the engine rejected the request:
4xx, the engine's own message passed on). Engine error bodies are logged verbatim as
`router.upstream_error`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from stack.common import events, json_text
from stack.common.errors import (
    CLIENT_REQUEST_ID_HEADER,
    REQUEST_ID_HEADER,
    APIError,
    InvalidRequest,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    UpstreamError,
    UpstreamTimeout,
)
from stack.common.logging import client_request_id, log_event
from stack.protocol.capabilities import unsupported
from stack.router.backends import Backend
from stack.router.engine_http import ConnectFailed, Disconnected, EngineHTTP, Response, Timeout

_JSON_HEADERS = {"Content-Type": "application/json"}
# A prefill leg's 503 when the decode cannot hold the prompt's KV (the engine's code): retried on another decode, and
# the client's 503 when none can (never a 502: nothing is broken, the decodes are full).
DECODE_KV_CAPACITY = "decode_kv_capacity"
# vLLM's 400 for tools with tool_choice "auto" (what an agent sends) when it was started without tool calling: the
# deployment cannot serve the field, the client's request is valid (vllm/entrypoints/openai/chat_completion/serving.py;
# recorded in tests/unit/doctor/bundles/vllm_no_tool_parser).
VLLM_NO_TOOL_PARSER = '"auto" tool choice requires --enable-auto-tool-choice'


class LegFailed(Exception):
    """One upstream leg failed; `error` is what the client gets if this is the last attempt."""

    def __init__(self, error: APIError, *, retryable: bool, status: int | None = None, unreachable: bool = False,
                 code: str | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.retryable = retryable
        self.status = status
        self.unreachable = unreachable  # connect refused, DNS failure, reset: the backend is down, not just failing
        self.code = code  # the engine's own error code, when it answered one

    @property
    def blames_decode(self) -> bool:
        """A prefill leg that failed because its KV push to decode failed (the engine's `kv_*` codes, not a timeout
        waiting for KV) or the decode has no room for the KV: the pair is re-picked and this decode not tried again."""
        if self.code == DECODE_KV_CAPACITY:
            return True
        return bool(self.code) and self.code.startswith("kv_") and self.code not in ("kv_not_a_producer", "kv_prompt_mismatch")

    def after_prefill(self, decode: Backend, windows: tuple[int | None, int | None]) -> LegFailed:
        """A decode leg that refused as a client error what the prefill engine already accepted. The prefill leg asks
        for one token, so only decode checks prompt + max_tokens against the window: with `windows` (prefill's,
        decode's) known and equal, such a refusal is the client's 400, as one engine would have answered. Otherwise
        the engines disagree (max_model_len, tokenizer, model): a deployment fault, a 502, not the client's."""
        if not isinstance(self.error, (InvalidRequest, NotFound, PayloadTooLarge)):
            return self
        prefill_window, decode_window = windows
        if prefill_window is not None and prefill_window == decode_window and _refuses_completion_budget(self.error):
            return self
        differ = (f"decode's max_model_len {decode_window} is not prefill's {prefill_window}"
                  if None not in windows and prefill_window != decode_window else
                  "compare their max_model_len, tokenizer and model")
        error = UpstreamError(f"decode engine {decode.url} refused a request the prefill engine accepted (HTTP {self.status}: "
                              f"{self.error.message}): prefill and decode disagree; {differ} (python -m doctor check)",
                              code="decode_rejected_after_prefill")
        return LegFailed(error, retryable=False, status=self.status, code=self.code)


def _refuses_completion_budget(error: APIError) -> bool:
    """Prompt + max_tokens past the window: our engine names the param, vLLM's older builds say "in the completion"."""
    return error.param in ("max_tokens", "max_completion_tokens") or "in the completion" in error.message


def _role_name(backend: Backend) -> str:
    return "engine" if backend.role == "both" else f"{backend.role} engine"


@dataclass(frozen=True)
class EngineError:
    """What an engine's error body says: its message and, in OpenAI's shape, the param and code it named."""

    message: str
    param: str | None = None
    code: str | None = None

    @classmethod
    def parse(cls, text: str) -> EngineError:
        """Read OpenAI, vLLM and plain error bodies."""
        try:
            data = json.loads(text)
        except ValueError:
            return cls(text.strip()[:500] or "(empty body)")
        if isinstance(data, dict):
            inner = data.get("error")
            if isinstance(inner, dict) and isinstance(inner.get("message"), str):
                param, code = inner.get("param"), inner.get("code")
                return cls(inner["message"], param if isinstance(param, str) else None, code if isinstance(code, str) else None)
            for key in ("message", "detail", "error"):
                if isinstance(data.get(key), str):
                    return cls(data[key])
        return cls(text.strip()[:500])


def status_failure(backend: Backend, status: int, error: EngineError) -> LegFailed:
    """Map an engine's HTTP error status to the client-facing error and whether to retry. A client error keeps
    the param and code the engine named (e.g. max_tokens, context_length_exceeded: a limit only the model knows);
    the failure keeps the engine's code either way (`blames_decode` reads it)."""
    message, name = error.message, _role_name(backend)
    client_errors: dict[int, type[APIError]] = {400: InvalidRequest, 404: NotFound, 413: PayloadTooLarge, 422: InvalidRequest}
    api_error: APIError
    if status in (401, 403):
        # The engine refused the router's own key, not the client's: a deployment fault the client cannot fix (502).
        api_error = UpstreamError(f"{name} refused the router's internal key (HTTP {status}: {message}): the router's "
                                  "PD_INTERNAL_KEY does not match the engine's key (VLLM_API_KEY for vLLM)",
                                  code="internal_key_rejected")
    elif status == 400 and message.startswith(VLLM_NO_TOOL_PARSER):
        api_error = unsupported("tool_choice", f"\"auto\" (the default with tools): the {name} runs without tool calling; "
                                "send tool_choice \"none\" to use the model without tools (the deployment's fix is in "
                                "`python -m doctor diagnose`)")
    elif status in client_errors:
        api_error = client_errors[status](message, code=error.code or "upstream_rejected", param=error.param)
    elif 400 <= status < 500 and status != 429:
        api_error = InvalidRequest(message, code=error.code or f"upstream_{status}", param=error.param)
    elif status == 503 and error.code == DECODE_KV_CAPACITY:
        api_error = Overloaded(message, code=DECODE_KV_CAPACITY, headers={"Retry-After": "1"})
    elif status in (429, 503):
        api_error = Overloaded(f"{name} is overloaded: {message}", code="upstream_overloaded")
    elif status == 504:
        api_error = UpstreamTimeout(f"{name} timed out: {message}")
    else:
        api_error = UpstreamError(f"{name} failed (HTTP {status}): {message}")
    return LegFailed(api_error, retryable=not isinstance(api_error, (InvalidRequest, NotFound, PayloadTooLarge)), status=status,
                     code=error.code)


async def response_failure(backend: Backend, response: Response) -> LegFailed:
    """Read a non-2xx answer, log its body, and map it."""
    try:
        text = await response.text()
    except (ConnectionError, TimeoutError, ValueError) as exc:
        text = f"(body unreadable: {exc!r})"
    log_event(events.ROUTER_UPSTREAM_ERROR, f"{backend.role} {backend.url} answered HTTP {response.status}", "WARNING",
              backend=backend.url, role=backend.role, status=response.status, body=text[:2000])
    return status_failure(backend, response.status, EngineError.parse(text))


def exception_failure(backend: Backend, exc: BaseException, phase: str) -> LegFailed:
    """Map a transport exception on one leg: engine_http.py's failures, JSON or UTF-8 that does not parse."""
    name = _role_name(backend)
    if isinstance(exc, ConnectFailed):
        return LegFailed(UpstreamError(f"cannot connect to the {name}"), retryable=True, unreachable=True)
    if isinstance(exc, TimeoutError):
        return LegFailed(UpstreamTimeout(f"the {name} did not answer in time ({phase})"), retryable=True)
    if isinstance(exc, ConnectionError):
        # Reset or closed before the status line: the engine process is gone, down at once. Mid-answer it may have
        # stopped only this stream.
        mid_body = isinstance(exc, Disconnected) and exc.mid_body
        return LegFailed(UpstreamError(f"the {name} broke the connection ({phase}: {type(exc).__name__})"), retryable=True,
                         unreachable=not mid_body)
    if isinstance(exc, ValueError):  # JSON that does not parse, bytes that are not UTF-8 or not HTTP (BadAnswer)
        return LegFailed(UpstreamError(f"the {name} sent an unreadable answer ({phase}: {exc})"), retryable=True)
    raise exc


def new_session(internal_key: str | None = None) -> aiohttp.ClientSession:
    """The one upstream session for the app's lifetime: health checks, KV discovery, /tokenize, /v1/models (the legs
    go through engine_http.py, which takes this session's headers).

    No connection cap (the scheduler's max_concurrent is the limit; aiohttp's default pool of 100
    would make requests wait unseen), keep-alive reuse, no total timeout (legs set their own), no
    cookie jar (the session serves every client: a cookie an engine set must not ride along on another
    client's request, and the jar's look-up costs every leg).
    `internal_key` (PD_INTERNAL_KEY) goes as `Authorization: Bearer …` on every engine request: legs,
    /tokenize, /v1/models, KV discovery (stack/common/internal_auth.py).
    """
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=60)
    headers = {"Authorization": f"Bearer {internal_key}"} if internal_key else None
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None), headers=headers,
                                 cookie_jar=aiohttp.DummyCookieJar())


def timeout(connect_ms: int, total_ms: int | None = None, read_ms: int | None = None) -> aiohttp.ClientTimeout:
    """The session's calls' timeouts."""
    return aiohttp.ClientTimeout(total=total_ms / 1000 if total_ms else None, sock_connect=connect_ms / 1000,
                                 sock_read=read_ms / 1000 if read_ms else None)


def leg_timeout(connect_ms: int, total_ms: int | None = None, read_ms: int | None = None,
                first_ms: int | None = None) -> Timeout:
    """A leg's timeouts: connect, the whole exchange, the longest silence (before the body's first bytes: first_ms)."""
    return Timeout(connect_ms / 1000, total_ms / 1000 if total_ms else None, read_ms / 1000 if read_ms else None,
                   first_ms / 1000 if first_ms else None)


def leg_headers(request_id: str) -> dict[str, str]:
    """The leg's id, and the client's own X-Request-ID so the engines' lines carry it too (client_request_id)."""
    client_id = client_request_id()
    return {**_JSON_HEADERS, REQUEST_ID_HEADER: request_id, **({CLIENT_REQUEST_ID_HEADER: client_id} if client_id else {})}


async def post_json(client: EngineHTTP, backend: Backend, path: str, body: bytes, request_id: str,
                    leg: Timeout) -> dict[str, Any]:
    """POST a non-streamed leg and return its JSON answer, or raise LegFailed. Cancelled (the request's deadline, the
    client gone) or timed out, the connection is closed, not returned to the pool: the engine sees the disconnect."""
    response: Response | None = None
    try:
        response = await client.post(backend.url + path, body, leg_headers(request_id), leg)
        if response.status >= 400:
            raise await response_failure(backend, response)
        data = json_text.loads(await response.read())  # engines answer UTF-8 JSON
    except LegFailed:
        raise
    except BaseException as exc:
        if response is not None:
            response.close()
        if not isinstance(exc, Exception):  # cancelled: not the leg's failure
            raise
        raise exception_failure(backend, exc, "non-streamed answer") from exc
    finally:
        if response is not None:
            response.release()  # read to the end (or closed above): the connection goes back to the pool
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        raise LegFailed(UpstreamError(f"the {_role_name(backend)} answered without choices"), retryable=True)
    return data


async def open_stream(client: EngineHTTP, backend: Backend, path: str, body: bytes, request_id: str,
                      leg: Timeout) -> Response:
    """POST a streamed leg and return the open 200 response (the caller reads and closes it)."""
    try:
        response = await client.post(backend.url + path, body, leg_headers(request_id), leg)
    except Exception as exc:  # noqa: BLE001
        raise exception_failure(backend, exc, "stream start") from exc
    if response.status >= 400:
        try:
            raise await response_failure(backend, response)
        finally:
            response.release()
    return response
