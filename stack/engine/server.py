"""The engine's HTTP face: OpenAI chat/completions (streamed or not, n choices), /v1/models, /tokenize, /detokenize, /health.

`create_app(config, model)` wires the scheduler and the KV hand-off into one aiohttp app (state in
`web.AppKey`s, started and stopped in `cleanup_ctx`). A generation request is parsed here, then
goes to the hand-off (a PD leg: handoff.py) or straight to the scheduler (an ordinary request),
and its outputs are rendered here. Errors leave through `stack.common.errors.error_middleware` in
OpenAI's shape; engine errors are mapped to API errors here, at one seam (`_api_error`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from stack.common import events, internal_auth
from stack.common.errors import (
    REQUEST_ID, REQUEST_ID_HEADER, APIError, InvalidRequest, Overloaded, ServerError, UpstreamError, UpstreamTimeout,
    error_middleware, openai_error_body, request_id_middleware,
)
from stack.common.logging import log_event
from stack.common.sse import open_stream, send_done, send_event
from stack.engine import protocol
from stack.engine.config import EngineConfig
from stack.engine.errors import CacheCapacityError, KVTransferError
from stack.engine.handoff import KVHandoff, pd_leg
from stack.engine.kv_cache import KVPool
from stack.engine.metrics import EngineMetrics
from stack.protocol.body import decode_body
from stack.engine.model import Model
from stack.engine.protocol import CompletionRequest, Kind, ResponseIds
from stack.engine.choices import Choice
from stack.engine.prefix_cache import PrefixCache
from stack.engine.scheduler import Scheduler
from stack.engine.sequence import Output, Sequence

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks that its client is still there
T = TypeVar("T")


@dataclass
class Engine:
    """Everything a request handler needs, built once per app."""

    config: EngineConfig
    model: Model
    scheduler: Scheduler
    handoff: KVHandoff
    max_model_len: int
    started: int
    ready: bool = False


ENGINE = web.AppKey("engine", Engine)


def create_app(config: EngineConfig, model: Model) -> web.Application:
    max_model_len = min(config.max_model_len or model.config.max_seq_len, model.config.max_seq_len)
    pool = KVPool(model.config, config.pool_bytes, config.block_size)
    metrics = EngineMetrics(config.model)
    prefix = PrefixCache(pool, model.fingerprint, enabled=config.prefix_caching, metrics=metrics)
    scheduler = Scheduler(model, pool, max_num_batched_tokens=config.max_num_batched_tokens,
                          max_num_seqs=config.max_num_seqs, chunked_prefill=config.chunked_prefill, metrics=metrics, prefix=prefix,
                          attention=config.attention)
    engine = Engine(config, model, scheduler, KVHandoff(config, model, scheduler, metrics), max_model_len, int(time.time()))
    metrics.watch(scheduler, engine.handoff.consumer)

    app = web.Application(middlewares=[request_id_middleware, internal_auth.middleware(), error_middleware()], client_max_size=16 * 1024 * 1024)
    app[ENGINE] = engine
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_text)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE]
    engine.scheduler.start()
    await engine.handoff.start()
    yield
    await engine.handoff.close()
    await engine.scheduler.stop()


async def warm_up(app: web.Application) -> None:
    """One real forward before health says SERVING (`serve(..., warmup=…)`)."""
    engine = app[ENGINE]
    await engine.scheduler.warmup()
    engine.ready = True


# -- handlers --------------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    card = {"id": engine.config.model, "object": "model", "created": engine.started, "owned_by": "pd-deploy",
            "root": engine.model.name, "max_model_len": engine.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize (vLLM's): the prompt's token ids and count, as a completion would see them."""
    engine = request.app[ENGINE]
    data = decode_body(await request.read())
    tokens = protocol.parse_tokenize(data, model_id=engine.config.model, tokenizer=engine.model.tokenizer)
    return web.json_response({"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens, "token_strs": None})


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize (vLLM's: vllm/entrypoints/openai/protocol.py `DetokenizeRequest` -> `DetokenizeResponse` {prompt})."""
    engine = request.app[ENGINE]
    data = decode_body(await request.read())
    tokens = protocol.parse_detokenize(data, model_id=engine.config.model, tokenizer=engine.model.tokenizer)
    return web.json_response({"prompt": engine.model.tokenizer.decode(tokens)})


async def health(request: web.Request) -> web.Response:
    """200 once warm (503 before), with the load numbers a router may use."""
    engine = request.app[ENGINE]
    body = {"status": "ok" if engine.ready else "starting", "role": engine.config.role, "model": engine.config.model,
            "fingerprint": engine.model.fingerprint, "capabilities": protocol.capability_names(),
            "max_model_len": engine.max_model_len, **engine.scheduler.load(), **engine.handoff.health()}
    return web.json_response(body, status=200 if engine.ready else 503)


async def metrics_text(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text (vLLM's names where vLLM has the metric; stack/engine/metrics.py)."""
    body, content_type = request.app[ENGINE].scheduler.metrics.render()
    return web.Response(body=body.encode(), headers={"Content-Type": content_type})


class _ClientGone(Exception):
    """The client closed its connection; the request is cancelled."""


_ARRIVED = web.RequestKey("arrived", float)  # monotonic time the handler started (for engine.request_abandoned)


def _log_abandoned(request: web.Request, req: CompletionRequest) -> None:
    """The caller (a router giving up on a leg, or a client) closed the connection: say so once, with what was asked."""
    waited_ms = round((time.monotonic() - request[_ARRIVED]) * 1000, 1)
    log_event(events.ENGINE_REQUEST_ABANDONED,
              f"caller closed the connection after {waited_ms} ms: cancelling {len(req.prompt_tokens)} prompt tokens' work"
              " (the KV is freed and any push stopped)", "WARNING",
              prompt_tokens=len(req.prompt_tokens), pd_leg=pd_leg(req), waited_ms=waited_ms)


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    engine = request.app[ENGINE]
    request_id = request[REQUEST_ID]
    request[_ARRIVED] = time.monotonic()
    data = decode_body(await request.read())
    req = protocol.parse_request(kind, data, model_id=engine.config.model, tokenizer=engine.model.tokenizer,
                                 max_model_len=engine.max_model_len)
    kv, leg = req.kv_transfer, pd_leg(req)
    max_tokens = 1 if leg == "prefill" else req.sampling.max_tokens  # the prefill leg computes the first token only
    log_event(events.ENGINE_REQUEST_RECEIVED, f"{kind} request: {len(req.prompt_tokens)} prompt tokens" + (f", PD {leg} leg" if leg else ""),
              prompt_tokens=len(req.prompt_tokens), max_tokens=max_tokens, stream=req.stream,
              role=engine.config.role, pd_leg=leg, transfer_id=kv.transfer_id if kv else None)
    seqs: list[Sequence] = []
    try:
        if leg == "prefill":  # stream=false (parse_request): the whole leg, KV push included, then one body
            prefilled = await _unless_client_gone(request, engine.handoff.prefill(request_id, req))
            choice = Choice(req, 0, engine.model.tokenizer)
            choice.add(prefilled.output)
            return _completion(request, engine, req, [choice], [prefilled.output], prefilled.cached_tokens,
                               kv_transfer_params=prefilled.kv_transfer_params)
        if leg == "decode":
            seqs.append(await _unless_client_gone(request, engine.handoff.decode(request_id, req), orphan=engine.scheduler.cancel))
        else:
            for i in range(req.n):
                seqs.append(engine.scheduler.submit(request_id, list(req.prompt_tokens), req.sampling, choice=i))
    except (KVTransferError, CacheCapacityError) as err:
        for seq in seqs:
            engine.scheduler.cancel(seq)
        raise _api_error(err, req) from None
    except _ClientGone:
        _log_abandoned(request, req)
        return web.Response(status=499)  # nginx's "client closed request"; nobody reads it
    except asyncio.CancelledError:  # handler_cancellation: the caller left; the awaited work was cancelled with us
        _log_abandoned(request, req)
        raise
    try:
        if req.stream:
            return await _stream(request, engine, req, seqs)
        return await _complete(request, engine, req, seqs)
    except _ClientGone:
        _log_abandoned(request, req)
        return web.Response(status=499)
    except asyncio.CancelledError:
        _log_abandoned(request, req)
        raise
    finally:
        for seq in seqs:
            engine.scheduler.cancel(seq)  # no-op when it finished


async def _complete(request: web.Request, engine: Engine, req: CompletionRequest, seqs: list[Sequence]) -> web.Response:
    choices = [Choice(req, i, engine.model.tokenizer) for i in range(len(seqs))]
    lasts: list[Output] = []
    for choice, seq in zip(choices, seqs):
        out = None
        async for out in _outputs(request, seq):
            choice.add(out)
        assert out is not None, "output stream ended without a finish"
        lasts.append(out)
    return _completion(request, engine, req, choices, lasts, seqs[0].cached_tokens)


def _completion(request: web.Request, engine: Engine, req: CompletionRequest, choices: list[Choice], lasts: list[Output],
                cached_tokens: int, **extra: Any) -> web.Response:
    """The non-streamed body of `choices` (each ended by its output in `lasts`); `extra` adds top-level keys (kv_transfer_params)."""
    for out in lasts:
        _raise_if_failed(out)
    ids = ResponseIds.new(req.kind, request[REQUEST_ID], engine.config.model)
    body = protocol.completion_body(req.kind, ids, [c.body() for c in choices], len(req.prompt_tokens), sum(o.num_tokens for o in lasts),
                                    cached_tokens)
    return web.json_response(body | extra)


async def _stream(request: web.Request, engine: Engine, req: CompletionRequest, seqs: list[Sequence]) -> web.StreamResponse:
    ids = ResponseIds.new(req.kind, request[REQUEST_ID], engine.config.model)
    merged: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(i, seq, merged)) for i, seq in enumerate(seqs)]
    choices = [Choice(req, i, engine.model.tokenizer) for i in range(len(seqs))]
    try:
        index, out = await _unless_client_gone(request, merged.get())  # before the 200 goes out: an engine error can still be a status
        _raise_if_failed(out)
        stream = await open_stream(request, {REQUEST_ID_HEADER: request[REQUEST_ID]})
        done, completion_tokens = 0, 0
        try:
            while True:
                if out.finish_reason in ("error", "abort"):
                    await send_event(stream, openai_error_body(ServerError(f"generation ended early ({out.finish_reason}); see the engine log")))
                    break
                for chunk in choices[index].chunks(out, ids):
                    await send_event(stream, chunk)
                if out.finish_reason:
                    done += 1
                    completion_tokens += out.num_tokens
                    if done == len(seqs):
                        if req.include_usage:
                            await send_event(stream, protocol.usage_chunk(req.kind, ids, len(req.prompt_tokens), completion_tokens,
                                                                                 seqs[0].cached_tokens))
                        break
                index, out = await _unless_client_gone(request, merged.get())
            await send_done(stream)
        except (ConnectionResetError, _ClientGone):
            _log_abandoned(request, req)  # mid-stream; _generate's finally cancels the sequences
        return stream
    finally:
        for pump in pumps:
            pump.cancel()


async def _pump(index: int, seq: Sequence, merged: asyncio.Queue[tuple[int, Output]]) -> None:
    while True:
        out = await seq.outputs.get()
        merged.put_nowait((index, out))
        if out.finish_reason is not None:
            return


async def _outputs(request: web.Request, seq: Sequence) -> AsyncIterator[Output]:
    """The sequence's outputs until its finish; raises _ClientGone when the client disconnects."""
    while True:
        out = await _unless_client_gone(request, seq.outputs.get())
        yield out
        if out.finish_reason is not None:
            return


async def _unless_client_gone(request: web.Request, awaitable: Awaitable[T], orphan: Callable[[T], None] | None = None) -> T:
    """Await `awaitable`; if the client disconnects meanwhile, cancel it and raise _ClientGone.

    Covers both ways a departure shows: aiohttp cancelling the handler, or a closing transport. A result that
    arrived in the loop turn the handler was cancelled reaches nobody: `orphan(result)` stops its work.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if request.transport is None or request.transport.is_closing():
                raise _ClientGone()
    except asyncio.CancelledError:
        if orphan is not None and task.done() and not task.cancelled() and task.exception() is None:
            orphan(task.result())
        raise
    finally:
        task.cancel()  # no-op once it is done


def _raise_if_failed(out: Output) -> None:
    if out.finish_reason == "error":
        raise ServerError("the engine step for this request failed; see the engine log for this request id")
    if out.finish_reason == "abort":
        raise Overloaded("the engine is shutting down", code="engine_stopping")


_KV_STATUS: dict[str, type[APIError]] = {
    "timeout": UpstreamTimeout,  # decode waited kv_transfer_timeout_ms (policy fail)
    "buffer_full": Overloaded,  # decode's receive buffer cannot take the KV now: another decode (or later) may
    "pool_too_small": Overloaded,  # this decode's KV pool can never hold the prompt: another decode may
    "prompt_mismatch": InvalidRequest,  # the decode leg's prompt is not the one prefilled
    "not_a_consumer": InvalidRequest,  # do_remote_prefill sent to an engine that does not receive KV
    "not_a_producer": InvalidRequest,  # do_remote_decode sent to an engine that does not send KV
}


def _api_error(err: KVTransferError | CacheCapacityError, req: CompletionRequest) -> APIError:
    """The one seam where engine errors become API errors."""
    if isinstance(err, CacheCapacityError):
        log_event(events.ENGINE_REQUEST_REJECTED, f"can never fit: {err}", "WARNING",
                  prompt_tokens=len(req.prompt_tokens), max_tokens=req.sampling.max_tokens, limit=str(err))
        return InvalidRequest(f"this request can never fit the engine's KV cache: {err}", code="kv_cache_too_small", param="max_tokens")
    cls = _KV_STATUS.get(err.reason, UpstreamError)  # the rest: the KV peer refused or broke (502)
    return cls(err.message, code=_KV_CODES.get(err.reason, f"kv_{err.reason}"))


# error.code of a KV failure when not `kv_<reason>`; decode_kv_capacity is the router's cue to retry another decode
_KV_CODES = {"timeout": "kv_transfer_timeout", "buffer_full": "decode_kv_capacity", "pool_too_small": "decode_kv_capacity"}
