"""What every API handler shares: reading the body, typed parameter checks, the model map, peeking a stream.

Each check raises `InvalidRequest` naming the parameter (`param`) and what is wrong, so a client
gets a precise 400 in its API's shape from the error middleware instead of a 500 from deep inside.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol, TypeVar

from aiohttp import web

from stack.common import events, sse
from stack.common.errors import REQUEST_ID, REQUEST_ID_HEADER, APIError, InvalidRequest, NotFound, PayloadTooLarge
from stack.common.logging import log_event
from stack.router.appkeys import CONFIG, PD, STREAM_ERROR, TOKENS

T = TypeVar("T")
_MISSING = object()


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
    if not raw.strip():
        raise InvalidRequest("Request body is empty; send a JSON object.", code="invalid_json")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise InvalidRequest("Request body is not valid UTF-8 JSON.", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}.",
                             code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"Request body must be a JSON object, got a JSON {_json_type(body)}.", code="invalid_json")
    return body


def _json_type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


class Params:
    """Typed access to a request body's fields; every mistake is a 400 naming the field."""

    def __init__(self, body: dict[str, Any], prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix

    def _get(self, name: str, required: bool) -> Any:
        value = self.body.get(name, _MISSING)
        if value is _MISSING or (value is None and not required):
            if required:
                raise InvalidRequest(f"Missing required parameter: '{self.prefix}{name}'.", param=f"{self.prefix}{name}",
                                     code="missing_required_parameter")
            return _MISSING
        return value

    def _wrong(self, name: str, expected: str, value: Any) -> InvalidRequest:
        return InvalidRequest(f"Invalid type for '{self.prefix}{name}': expected {expected}, got a {_json_type(value)}.",
                              param=f"{self.prefix}{name}", code="invalid_type")

    def bad(self, name: str, problem: str, code: str = "invalid_value") -> InvalidRequest:
        return InvalidRequest(f"Invalid value for '{self.prefix}{name}': {problem}", param=f"{self.prefix}{name}", code=code)

    def string(self, name: str, required: bool = False, default: str | None = None) -> str | None:
        value = self._get(name, required)
        if value is _MISSING:
            return default
        if not isinstance(value, str):
            raise self._wrong(name, "a string", value)
        return value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self._get(name, False)
        if value is _MISSING:
            return default
        if not isinstance(value, bool):
            raise self._wrong(name, "true or false", value)
        return value

    def integer(self, name: str, minimum: int, required: bool = False) -> int | None:
        value = self._get(name, required)
        if value is _MISSING:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(name, "an integer", value)
        if value < minimum:
            raise self.bad(name, f"must be >= {minimum}, got {value}.")
        return value

    def number(self, name: str, low: float, high: float) -> float | None:
        value = self._get(name, False)
        if value is _MISSING:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._wrong(name, "a number", value)
        if not low <= value <= high:
            raise self.bad(name, f"must be between {low:g} and {high:g}, got {value}.")
        return float(value)

    def obj(self, name: str) -> dict[str, Any] | None:
        value = self._get(name, False)
        if value is _MISSING:
            return None
        if not isinstance(value, dict):
            raise self._wrong(name, "an object", value)
        return value

    def array(self, name: str, required: bool = False) -> list[Any] | None:
        value = self._get(name, required)
        if value is _MISSING:
            return None
        if not isinstance(value, list):
            raise self._wrong(name, "an array", value)
        return value

    def stop(self, name: str, max_items: int = 4) -> list[str] | None:
        """A stop parameter: one string or a short array of strings."""
        value = self._get(name, False)
        if value is _MISSING:
            return None
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise self._wrong(name, "a string or an array of strings", value)
        if len(items) > max_items:
            raise self.bad(name, f"at most {max_items} sequences, got {len(items)}.")
        return items

    def reject_unsupported(self, name: str, allowed: Any, why: str) -> None:
        """400 if `name` is present with a value other than `allowed` (None = any presence)."""
        value = self.body.get(name)
        if value is not None and value != allowed:
            raise InvalidRequest(f"Unsupported parameter: '{self.prefix}{name}' {why}.", param=f"{self.prefix}{name}",
                                 code="unsupported_parameter")


# OpenAI chat and Responses roles, as the engines' chat template knows them.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def text_content(content: Any, where: str, part_types: frozenset[str]) -> str:
    """A message's content as text: a string, or an array of text parts of `part_types` (others are a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"Invalid type for '{where}': expected a string or an array of content parts.", param=where,
                             code="invalid_type")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in part_types or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"Unsupported content part at '{where}[{i}]' (type {kind!r}): only {', '.join(sorted(part_types))} "
                                 "parts are supported.", param=f"{where}[{i}]", code="unsupported_content")
        texts.append(part["text"])
    return "".join(texts)


def resolve_model(request: web.Request, model: str) -> str:
    """The backend model for a public model name, or 404 model_not_found naming what is served."""
    taotoken = request.app[CONFIG].taotoken
    public = taotoken.model_id
    backend = request.app[PD].backend_model
    if model not in (public, backend) and not any(fnmatch.fnmatchcase(model, alias) for alias in taotoken.model_aliases):
        raise NotFound(f"The model '{model}' does not exist on this router; it serves '{public}' (see GET /v1/models).",
                       param="model", code="model_not_found")
    return backend


def received(request: web.Request, api: str, model: str, stream: bool) -> None:
    log_event(events.ROUTER_REQUEST_RECEIVED, f"{api} request for {model}", api=api, model=model, stream=stream)


def charge(request: web.Request, usage: dict[str, Any] | None) -> None:
    """Note the tokens a request used; the guard middleware charges them to the key when it ends."""
    if usage:
        request[TOKENS] = (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))


async def peek(stream: AsyncIterator[T]) -> T | None:
    """The first item of a stream (None if it is empty); errors before it surface as normal HTTP errors."""
    async for item in stream:
        return item
    return None


def upstream_body(model: str, stream: bool, max_tokens: int | None, sampling: dict[str, Any], **prompt: Any) -> dict[str, Any]:
    """The engine request: prompt (messages= or prompt=), limits and sampling; unset values left out."""
    body: dict[str, Any] = {"model": model, **prompt, "stream": stream}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    body.update({name: value for name, value in sampling.items() if value is not None})
    return body


def sampling(params: Params, stop_name: str = "stop") -> dict[str, Any]:
    """The sampling parameters every API shares, checked."""
    return {
        "temperature": params.number("temperature", 0.0, 2.0),
        "top_p": params.number("top_p", 0.0, 1.0),
        "stop": params.stop(stop_name),
        "seed": params.integer("seed", minimum=-(2**63)),
        "ignore_eos": params.boolean("ignore_eos") or None,  # vLLM's extension; only OpenAI routes accept the key
    }


class Translator(Protocol):
    """Turns the engine's chat/completion chunks into one API's SSE frames."""

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def end(self) -> list[bytes]: ...  # the API's terminal frames after the last chunk

    def error(self, err: APIError) -> list[bytes]: ...  # in-band error frames, terminal too


async def relay(request: web.Request, batches: AsyncIterator[list[dict[str, Any]]], translator: Translator) -> web.StreamResponse:
    """Stream the chunk `batches` of PDClient.stream to the client through `translator`, one write per
    batch; every path ends the stream properly.

    An error before the first chunk propagates (a normal HTTP error); after it, the translator's
    in-band error frames close the stream. A client that went away closes the upstream stream
    (aclosing), which cancels the engine legs.
    """
    async with contextlib.aclosing(batches):  # type: ignore[type-var]
        batch = await peek(batches)
        stream = await sse.open_stream(request, {REQUEST_ID_HEADER: request[REQUEST_ID]})
        relayed = 0  # token chunks sent: the charge when a broken stream never reports usage
        try:
            try:
                while batch is not None:
                    frames: list[bytes] = []
                    for chunk in batch:
                        if chunk.get("usage"):
                            charge(request, chunk["usage"])
                        relayed += bool(chunk.get("choices"))
                        frames += translator.chunk(chunk)
                    if frames:
                        await stream.write(b"".join(frames))
                    batch = await anext(batches, None)
                tail = translator.end()
            except APIError as err:
                request[STREAM_ERROR] = err.type
                tail = translator.error(err)
            await stream.write(b"".join(tail))
            await stream.write_eof()
        except ConnectionResetError:
            request[STREAM_ERROR] = "client_disconnected"  # the PD client logs router.client_disconnected
        if TOKENS not in request:
            request[TOKENS] = (0, relayed)
        return stream
