"""The router application: `create_app(config)` wires the front middleware, state and routes.

One middleware, `front`, does for every request, in order: a fresh request id (a client's X-Request-ID kept as
`client_request_id` and echoed in X-Client-Request-ID); the unified key on every /v1 route, and on POSTs the body,
read within `server.body_timeout_ms` and checked against the JSON limits of stack.common.safe_json, before the
request counts as in flight; per-key limits, usage and the `router.request_done` line around generation routes; and
the one boundary that turns exceptions into bodies (Anthropic's shape under /v1/messages, OpenAI's elsewhere).
`/health`, `/metrics` and `/api/hello` (Claude Code's connection probe) are open.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import zmq
from aiohttp import web

from stack.common import events
from stack.common.config import ConfigError
from stack.common import internal_auth, safe_json
from stack.common.errors import (
    APIError, PayloadTooLarge, RequestTimeout, UnsupportedMediaType, echo_request_ids, enter_request, error_answer,
    openai_error_body,
)
from stack.common.logging import SUMMARY_LOGGED, leave_context, log_event, ms
from stack.router.api import anthropic, openai, responses, tokens
from stack.router.appkeys import CALLER, CONFIG, INTERNAL_KEY, KEYRING, LIMITER, METRICS, PD, REGISTRY, STREAM_ERROR, TOKENS, USAGE
from stack.router.auth import Caller, KeyRing
from stack.router.config import RouterConfig, UsageConfig, load_keys_file
from stack.router.limits import Limiter
from stack.router.limits_redis import RedisCounters
from stack.router.metrics import Metrics
from stack.router.p2pnccl import Registry
from stack.router.fleet import Fleet
from stack.router.pd import PDClient
from stack.router.upstream import new_session
from stack.router.usage import UsageStore

# Generation routes (limited, counted) and the API name each one reports in logs and metrics.
_GENERATION = {openai.CHAT_PATH: "chat", openai.COMPLETIONS_PATH: "completions", "/v1/messages": "messages",
               "/v1/responses": "responses"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def render_error(request: web.Request, err: APIError) -> dict:
    """Each API answers errors in its own shape."""
    if request.path.startswith("/v1/messages"):
        return anthropic.anthropic_error_body(err)
    return openai_error_body(err)


@web.middleware
async def front(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request, in one middleware: its ids, the unified key and limits on /v1 routes, the one error boundary.

    One layer, not three: each layer of aiohttp's middleware chain is a coroutine every request creates, and a frame
    every stream chunk resumes on its way down to the relay (docs/router-performance.md)."""
    tokens = enter_request(request)  # X-Request-ID, the client's id kept, the logging context
    api: str | None = None
    status, caller, slot, charge = 500, None, "", None
    started = time.perf_counter()
    try:
        if not request.path.startswith("/v1/") or request.match_info.http_exception is not None:
            return await handler(request)  # open routes, and unknown paths (their 404/405 needs no key)
        api = _GENERATION.get(request.path)
        request[CALLER] = request.app[KEYRING].authenticate(request.headers)
        await _read_body(request)  # a body that never arrives must not hold one of the key's slots
        if api is None:
            return await handler(request)
        slot = await request.app[LIMITER].admit(request[CALLER])
        caller = request[CALLER]
        response = await handler(request)
        status = response.status
        if not response.prepared:
            # A whole answer leaves once its tokens are charged (a client that has it sees them in /v1/usage and in its
            # next quota check), before the usage commit and the summary line, which add nothing it waits for.
            # (A stream's relay has sent everything already; it is charged below.)
            charge = asyncio.ensure_future(_charge(request, caller, slot))  # held first: _request_done waits for it
            await asyncio.shield(charge)  # a client that leaves meanwhile must not stop its charge
            try:
                await response.prepare(request)
                await response.write_eof()
            except ConnectionResetError:
                request[STREAM_ERROR] = "client_disconnected"
        return response
    except asyncio.CancelledError:
        status = 499  # nginx's "client closed request": the handler was cancelled because the client left
        request[STREAM_ERROR] = "client_disconnected"
        raise
    except Exception as exc:
        answer = error_answer(request, exc, render_error)  # the error body in the API's shape (Anthropic's, OpenAI's)
        status = answer.status
        return answer
    finally:
        if api is not None:
            e2e = time.perf_counter() - started
            request.app[METRICS].observe_request(api, status, e2e)  # rejected requests count too
            if caller is not None:
                # Shielded: a client that leaves cancels the handler, and its slot must still be given back.
                await asyncio.shield(_request_done(request, api, caller, slot, status, e2e, charge))
        leave_context(tokens)


_THREAD_SCAN_BYTES = 256 * 1024  # bigger bodies are checked in a worker thread (~50 ms a MB)


async def _read_body(request: web.Request) -> None:
    """Read a POST body within body_timeout_ms and check it against safe_json's limits; the handler's own read() then
    gets it from aiohttp's cache. 408 if it does not arrive, 415 for a Content-Encoding, 400 for JSON past a limit."""
    if request.method != "POST" or not request.body_exists:
        return
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported; send the JSON body uncompressed.",
                                   code="unsupported_content_encoding")
    server = request.app[CONFIG].server
    limit = server.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        return  # read_json answers 413 with the precise message, without reading it
    try:
        # A body that came whole with the head has no wait to bound.
        async with contextlib.nullcontext() if request.content.is_eof() else asyncio.timeout(server.body_timeout_ms / 1000):
            raw = await request.read()
    except TimeoutError:
        log_event(events.HTTP_BODY_TIMEOUT, f"the request body did not arrive within {server.body_timeout_ms / 1000:g}s", "WARNING",
                  limit_s=server.body_timeout_ms / 1000)
        raise RequestTimeout(f"The request body did not arrive within {server.body_timeout_ms / 1000:g} s.", code="body_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"Request body exceeds {limit} bytes, the most this router accepts.", code="request_too_large") from None
    if len(raw) > _THREAD_SCAN_BYTES:
        await asyncio.to_thread(safe_json.check_body, raw)
    else:
        safe_json.check_body(raw)


async def _charge(request: web.Request, caller: Caller, slot: str) -> None:
    """Free the key's slot and charge the request's tokens to it (memory at once, the usage file at its group commit)."""
    prompt, completion = request.get(TOKENS, (0, 0))
    await request.app[LIMITER].release(caller, slot, prompt, completion)


async def _request_done(request: web.Request, api: str, caller: Caller, slot: str, status: int, e2e: float,
                        charge: asyncio.Future[None] | None) -> None:
    """Charge the request (or wait for the charge made before its answer left), and log its one summary line once the
    charge is in the usage file."""
    await (charge if charge is not None else _charge(request, caller, slot))
    prompt, completion = request.get(TOKENS, (0, 0))
    await request.app[USAGE].durable()  # the line below promises the request is in the usage file (usage.py)
    failed = status >= 400 or STREAM_ERROR in request
    log_event(events.ROUTER_REQUEST_DONE, f"{api} request done: {status}", "WARNING" if failed else "INFO",
              api=api, key_name=caller.name, status=status, error=request.get(STREAM_ERROR),
              prompt_tokens=prompt, completion_tokens=completion, e2e_ms=ms(e2e))
    request[SUMMARY_LOGGED] = True  # this line says what the access line would


async def health(request: web.Request) -> web.Response:
    """GET /health: the router is up; each backend's state as the router sees it."""
    registry = request.app.get(REGISTRY)
    extra = {"p2pnccl_instances": registry.snapshot()} if registry is not None else {}
    store = request.app[CONFIG].limits_store.redis_url or "memory"  # where per-key limits are counted (no password: config forbids it)
    return web.json_response({"status": "ok", **request.app[PD].health_snapshot(), "limits_store": store, **extra})


async def hello(_request: web.Request) -> web.Response:
    """GET/HEAD /api/hello: open, as Anthropic's API has it. Claude Code probes it when it starts and before its
    subagents (it warms its connection there); answered 404, each probe was a warning line and, for the doctor, a
    request that failed for no known reason."""
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text."""
    body, content_type = request.app[METRICS].render()
    return web.Response(body=body.encode(), headers={"Content-Type": content_type})


async def usage(request: web.Request) -> web.Response:
    """GET /v1/usage: the calling key's totals and limits (across every router sharing the limit store)."""
    caller = request[CALLER]
    counters = request.app[LIMITER].counters
    totals, in_flight = await counters.totals(caller.name), await counters.in_flight(caller.name)
    limits = caller.limits
    return web.json_response({
        "object": "usage", "key_name": caller.name, "requests": totals.requests, "prompt_tokens": totals.prompt_tokens,
        "completion_tokens": totals.completion_tokens, "total_tokens": totals.total_tokens,
        "in_flight": in_flight,
        "limits": {"rpm": limits.rpm, "tpm": limits.tpm, "max_concurrent": limits.max_concurrent, "token_quota": limits.token_quota},
        "quota_remaining": max(0, limits.token_quota - totals.total_tokens) if limits.token_quota else None,
    })


def create_app(config: RouterConfig, env: Mapping[str, str] | None = None) -> web.Application:
    """The router app for `config`; keys are read from `env` (default: the process environment)."""
    env = os.environ if env is None else env
    # One byte over the limit is enough for read_json to tell "too large" with its precise message.
    app = web.Application(middlewares=[front],
                          client_max_size=config.server.max_body_bytes + 1)
    app.on_response_prepare.append(echo_request_ids)
    app[CONFIG] = config
    app[KEYRING] = KeyRing.from_environment(config, load_keys_file(config), env)
    app[INTERNAL_KEY] = internal_auth.internal_key(env) or ""
    app[USAGE] = _open_usage(config)
    app[LIMITER] = Limiter(app[USAGE], RedisCounters.from_env(config.limits_store) if config.limits_store.redis_url else None)
    app[METRICS] = Metrics()
    app[METRICS].add_key_gauges(app[KEYRING].callers, app[USAGE], app[LIMITER])
    if config.p2pnccl.registry_port:  # vLLM P2pNccl engines: the pools are whoever registers, not the configured endpoints
        app[REGISTRY] = _open_registry(config)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post(openai.CHAT_PATH, openai.chat_completions)
    app.router.add_post(openai.COMPLETIONS_PATH, openai.completions)
    app.router.add_get("/v1/models", openai.models)
    app.router.add_get("/v1/models/{model}", tokens.model)
    app.router.add_post("/tokenize", tokens.tokenize)
    app.router.add_post("/detokenize", tokens.detokenize)
    app.router.add_post("/v1/messages", anthropic.messages)
    app.router.add_post("/v1/messages/count_tokens", anthropic.count_tokens)
    app.router.add_post("/v1/responses", responses.responses)
    app.router.add_get("/v1/usage", usage)
    app.router.add_get("/health", health)
    app.router.add_get("/api/hello", hello)
    app.router.add_get("/metrics", metrics)
    return app


def _open_usage(config: RouterConfig) -> UsageStore:
    """The usage file, or a ConfigError naming usage.db_path (e.g. a volume the router cannot write)."""
    try:
        return UsageStore(config.usage.db_path)
    except (OSError, sqlite3.Error) as exc:
        raise ConfigError(config.source, "usage.db_path", f"cannot open {config.usage.db_path!r} for writing: {exc}") from None


def _open_registry(config: RouterConfig) -> Registry:
    """The P2pNccl registry socket, or a ConfigError naming p2pnccl.registry_port (e.g. the port is taken)."""
    port = config.p2pnccl.registry_port
    try:
        registry = Registry(config.p2pnccl)
    except zmq.ZMQError as exc:
        raise ConfigError(config.source, "p2pnccl.registry_port", f"cannot listen on port {port}: {exc}") from None
    log_event(events.CONFIG_IGNORED, f"[prefill]/[decode] endpoints are ignored: P2pNccl engines register on port {port}",
              key="prefill.endpoints", value="(registry)")
    return registry


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """One upstream ClientSession, the PD client and the usage writer for the app's lifetime; the usage file closed last."""
    config = app[CONFIG]
    writer = asyncio.create_task(_write_usage(app[USAGE], config.usage), name="usage-writer")
    # One tuned session (no connection cap, no total timeout: the PD client sets per-leg timeouts).
    async with new_session(app[INTERNAL_KEY] or None) as session:
        registry = app.get(REGISTRY)
        fleet = Fleet(config, session, app[METRICS])
        pd = PDClient(fleet, app[METRICS])
        app[PD] = pd
        try:
            await app[LIMITER].counters.start()
            await fleet.start()
            if registry is not None:
                registry.start(fleet.monitor.join, fleet.monitor.leave)
            yield
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            if registry is not None:
                await registry.close()
            await fleet.close()
            await app[LIMITER].counters.close()
            app[USAGE].close()  # writes what is still queued


async def _write_usage(store: UsageStore, config: UsageConfig) -> None:
    """Write finished requests to the usage file once per interval (see usage.py for why not one by one)."""
    while True:
        await asyncio.sleep(config.flush_interval_ms / 1000)
        try:
            store.flush()
        except sqlite3.Error as exc:  # a full disk must not stop the router; the totals in memory stay right
            log_event(events.USAGE_FLUSH_FAILED, f"cannot write usage to {config.db_path}: {exc}; retrying", "ERROR",
                      db_path=config.db_path, requests=store.pending, error=str(exc))
