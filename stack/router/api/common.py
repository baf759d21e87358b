"""What every API handler shares: reading the body, the model map, the engine body, relaying a stream.

Each API parses its body into the request contract (stack.protocol) once; `engine_body` turns that
into the normalised body PDClient sends. Every client mistake is an `InvalidRequest` naming the
parameter, so a client gets a precise 400 in its API's shape from the error middleware.
"""

from __future__ import annotations

import asyncio
import fnmatch
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from stack.common import events, json_text, sse
from stack.common.errors import REQUEST_ID, REQUEST_ID_HEADER, APIError, InvalidRequest, NotFound, PayloadTooLarge
from stack.common.logging import log_event
from stack.protocol.body import decode_body
from stack.protocol.capabilities import VLLM_EXTRAS, Capabilities, fit
from stack.protocol.serialise import to_body
from stack.protocol.types import Request
from stack.router.appkeys import CONFIG, PD, STREAM_ERROR, TOKENS

if TYPE_CHECKING:
    from stack.router.pd import DecodeStream


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or 413 / 400 saying exactly what is wrong with it."""
    limit = request.app[CONFIG].server.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"Request body is {request.content_length} bytes; this router accepts at most {limit} bytes.",
                              code="request_too_large")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"Request body exceeds {limit} bytes, the most this router accepts.", code="request_too_large") from None
    return decode_body(raw)


def resolve_model(request: web.Request, model: str) -> str:
    """The backend model for a public model name, or 404 model_not_found naming what is served."""
    taotoken = request.app[CONFIG].taotoken
    public = taotoken.model_id
    backend = request.app[PD].backend_model
    if model not in (public, backend) and not any(fnmatch.fnmatchcase(model, alias) for alias in taotoken.model_aliases):
        raise NotFound(f"The model '{model}' does not exist on this router; it serves '{public}' (see GET /v1/models).",
                       param="model", code="model_not_found")
    return backend


def charge(request: web.Request, usage: dict[str, Any] | None) -> None:
    """Note the tokens a request used; the front middleware charges them to the key when it ends."""
    if usage:
        request[TOKENS] = (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))


def json_answer(value: dict[str, Any]) -> web.Response:
    """A whole answer's JSON: compact UTF-8 (json_text.compact, msgspec's encoder), as vLLM answers."""
    return web.Response(body=json_text.compact(value), content_type="application/json", charset="utf-8")


def capabilities(request: web.Request) -> Capabilities:
    """What every backend this request may reach honours (monitor.py: learned or set in settings.toml)."""
    return request.app[PD].monitor.capabilities


def engine_body(request: web.Request, req: Request, api: str, extras: dict[str, Any] | None = None,
                names: dict[str, str] | None = None) -> dict[str, Any]:
    """The normalised body the engines receive: `req` fitted to what the backends honour, for the backend model.

    `extras`: the client's vLLM fields outside the contract (VLLM_EXTRAS), forwarded verbatim to backends with
    pools declared vLLM (monitor.vllm_fields); refused with the unknown-parameter 400 elsewhere. `names`: the chat field → the field the
    client sent, for refusals. A refusal is logged with the capabilities it was decided on (router.unsupported_parameter)."""
    caps = capabilities(request)
    try:
        if extras and not request.app[PD].monitor.vllm_fields:
            name = next(iter(extras))
            raise InvalidRequest(f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")
        body = to_body(fit(req, caps))
    except InvalidRequest as err:
        err = client_field(err, names or {})
        if err.code in ("unsupported_parameter", "unknown_parameter"):
            log_event(events.ROUTER_UNSUPPORTED, f"{api}: refused {err.param}: {err.message}", api=api, param=err.param,
                      capabilities=list(caps.names))
        raise err from None
    body["model"] = resolve_model(request, req.model)
    return {**body, **(extras or {})}


def client_field(err: InvalidRequest, names: dict[str, str]) -> InvalidRequest:
    """A refusal that names a chat field (the router's, or an engine's: max_tokens past the window), naming instead the
    field a translated API's client sent (`names`: max_tokens → max_output_tokens, response_format → text.format)."""
    if err.param not in names:
        return err
    return InvalidRequest(err.message.replace(f"'{err.param}'", f"'{names[err.param]}'", 1), param=names[err.param], code=err.code)


def vllm_extras(body: dict[str, Any]) -> dict[str, Any]:
    """The fields of `body` that are vLLM's own (VLLM_EXTRAS), in the client's order."""
    return {k: v for k, v in body.items() if k in VLLM_EXTRAS and v is not None}


def deltas(chunk: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any], str | None]]:
    """A chat chunk's choices as (choice, its delta, the delta's text): what every API's stream translator reads."""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        yield choice, delta, delta.get("content")


class Translator(Protocol):
    """Turns the engine's chat/completion chunks (parsed) into one API's SSE frames. An ordinary token chunk that
    PDClient.open(raw_model=…, or text_frame=…) made into its frame already is sent by the relay as it is."""

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def end(self) -> list[bytes]: ...  # the API's terminal frames after the last chunk

    def error(self, err: APIError) -> list[bytes]: ...  # in-band error frames, terminal too


async def relay(request: web.Request, stream: DecodeStream, translator: Translator) -> web.StreamResponse:
    """Relay `stream` (PDClient.open) to the client through `translator`, one write per network read of the engine's;
    every path ends the stream properly and closes `stream`.

    The first batch is taken before the client's stream opens: an error there is a normal HTTP error. After it, the
    translator's in-band error frames close the stream. A client that went away closes the decode leg, which the engine
    sees and cancels.
    """
    try:
        batch = await stream.next()
        out = await sse.open_stream(request, {REQUEST_ID_HEADER: request[REQUEST_ID]})
        stream.forward_to(sse.WriteNow(request, out))  # most token chunks go on from here without waking this loop
        try:
            try:
                while batch is not None:
                    frames: list[bytes] = []
                    for chunk in batch:
                        if isinstance(chunk, bytes):  # a token chunk's frame, ready (relay.Passthrough): no usage in it
                            stream.sent += 1
                            frames.append(chunk)
                            continue
                        if chunk.get("usage"):
                            charge(request, chunk["usage"])
                        stream.sent += bool(chunk.get("choices"))
                        frames += translator.chunk(chunk)
                    if frames:
                        await out.write(frames[0] if len(frames) == 1 else b"".join(frames))
                    batch = await stream.next()
                tail = translator.end()
            except APIError as err:
                request[STREAM_ERROR] = err.type
                tail = translator.error(err)
            await out.write(b"".join(tail))
            await out.write_eof()
        except ConnectionResetError:
            request[STREAM_ERROR] = "client_disconnected"  # DecodeStream.close logs router.client_disconnected
        return out
    except asyncio.CancelledError:  # the client left while the relay waited: aiohttp cancels the handler
        request[STREAM_ERROR] = "client_disconnected"
        raise
    finally:
        if TOKENS not in request:
            # No usage chunk reached the client: the tokens it was sent. A client that left also pays for its prompt
            # (the router's estimate), which was computed for it: leaving before the end is no way around a quota.
            # A stream the engine broke charges no prompt: an engine's failure is not the client's.
            left = request.get(STREAM_ERROR) == "client_disconnected"
            request[TOKENS] = (stream.job.prompt_tokens if left else 0, stream.sent)
        stream.close()
