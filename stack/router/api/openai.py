"""OpenAI API: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

Bodies are parsed by the request contract (stack.protocol) and checked strictly, as OpenAI does: an
unknown parameter is a 400 naming it. The request then goes to the engines as the contract says,
fitted to what the backends declare they can do (stack.protocol.capabilities; monitor.py learns it
or settings.toml sets it): with the "vllm" preset, tools, tool_choice, logprobs, `n`, structured
outputs, every sampling extra and vLLM's own fields (VLLM_EXTRAS, e.g. sent through the openai SDK's
`extra_body`) pass through unchanged; a backend without a capability gets no such request, the
client gets a 400 `unsupported_parameter` naming the parameter instead. `tools` with `tool_choice`
"auto"/"none" for a backend without tool calling are accepted and have no effect, so agents that
always send their tool list still work. OpenAI-only extras this router cannot do (audio, `suffix`…)
are refused here.

Streams relay the engine's chunks with the public model id; the usage chunk (empty `choices`)
reaches the client only if it asked with `stream_options.include_usage`. An error after the first
chunk is sent in-band as `data: {"error": {...}}` followed by `data: [DONE]` (the openai SDK
raises `APIError` on such a frame).
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from stack.common import events, sse
from stack.common.errors import REQUEST_ID, APIError, InvalidRequest, openai_error_body
from stack.common.logging import log_event
from stack.protocol.capabilities import unsupported
from stack.protocol.fields import Fields
from stack.protocol.parse import FIELDS, parse
from stack.protocol.types import Request
from stack.protocol.capabilities import VLLM_EXTRAS
from stack.router.api.common import charge, engine_body, json_answer, read_json, relay, vllm_extras
from stack.router.appkeys import CONFIG, PD

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

# OpenAI fields outside the engine contract: accepted (and left out of the engine body), or refused
# below when they ask for something this deployment cannot do. kv_transfer_params belong to the
# router's PD hand-off, never to a client.
_OPENAI_ONLY = {"user", "metadata", "store", "service_tier"}
_CHAT_PARAMS = (FIELDS["chat"] - {"kv_transfer_params"}) | _OPENAI_ONLY | {
    "functions", "function_call", "modalities", "audio", "reasoning_effort", "prediction", "web_search_options"}
_COMPLETION_PARAMS = (FIELDS["completion"] - {"kv_transfer_params"}) | _OPENAI_ONLY | {"echo", "best_of", "suffix"}
_CHAT_KNOWN, _COMPLETION_KNOWN = _CHAT_PARAMS | VLLM_EXTRAS, _COMPLETION_PARAMS | VLLM_EXTRAS  # made once, not per request


def _check_known(body: dict[str, Any], known: set[str] | frozenset[str]) -> None:
    for name in body:
        if name not in known:
            raise InvalidRequest(f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")


def _check_chat_only(f: Fields) -> None:
    f.string("user")
    if f.body.get("function_call") not in (None, "auto", "none"):
        raise unsupported("function_call", "cannot force a call: this model never calls functions")
    if f.body.get("audio") is not None:
        raise unsupported("audio", "is not supported by this deployment")
    modalities = f.array("modalities")
    if modalities is not None and modalities != ["text"]:
        raise f.bad("modalities", "only [\"text\"] is supported.", code="unsupported_parameter")


def _check_completion_only(f: Fields, vllm: bool) -> None:
    f.string("user")
    if vllm:
        return  # echo, best_of: vLLM's to check
    if f.body.get("echo") not in (None, False):
        raise unsupported("echo", "is not supported by this deployment")
    if f.body.get("best_of") not in (None, 1):
        raise unsupported("best_of", "must be 1")
    if f.body.get("suffix") is not None:
        raise unsupported("suffix", "is not supported by this deployment")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    body = await read_json(request)
    _check_known(body, _CHAT_KNOWN)
    req = parse("chat", body, checked=True)  # read_json: decode_body refused lone surrogates
    _check_chat_only(Fields(body))
    upstream = engine_body(request, req, "chat", vllm_extras(body))
    return await _answer(request, "chat", CHAT_PATH, req, upstream)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions (legacy text completions)."""
    body = await read_json(request)
    _check_known(body, _COMPLETION_KNOWN)
    req = parse("completion", body, checked=True)
    vllm = request.app[PD].monitor.vllm_fields
    _check_completion_only(Fields(body), vllm)
    extras = vllm_extras(body) if vllm else {k: v for k, v in vllm_extras(body).items() if k not in ("echo", "best_of")}
    upstream = engine_body(request, req, "completions", extras)
    return await _answer(request, "completions", COMPLETIONS_PATH, req, upstream)


async def _answer(request: web.Request, api: str, path: str, req: Request, upstream: dict[str, Any]) -> web.StreamResponse:
    pd = request.app[PD]
    if not req.stream:
        result = await pd.complete(request[REQUEST_ID], api, path, req, upstream, request.headers)
        charge(request, result.get("usage"))
        return json_answer({**result, "model": req.model})
    # Ordinary token chunks come as their frames, the engine's bytes with the client's model id in (relay.Passthrough).
    stream = await pd.open(request[REQUEST_ID], api, path, req, upstream, request.headers, raw_model=req.model)
    return await relay(request, stream, _ChunkRelay(req.model, req.include_usage))


class _ChunkRelay:
    """OpenAI chunks pass through with the public model id; usage only if asked; errors in-band. (Ordinary token
    chunks come as their frames, PDClient.open(raw_model=…), and the relay sends them as they are.)"""

    def __init__(self, model: str, include_usage: bool) -> None:
        self.model = model
        self.include_usage = include_usage

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        if not chunk.get("choices"):
            if not self.include_usage:
                return []
            # The doctor's choices diagnosis reads this: a chunk with `choices: []` reached the client.
            usage = chunk.get("usage") or {}
            log_event(events.ROUTER_USAGE_CHUNK, "sent the usage chunk (empty choices) the client asked for",
                      client_asked=True, prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"))
        return [sse.frame({**chunk, "model": self.model})]

    def end(self) -> list[bytes]:
        return [sse.frame(sse.DONE)]

    def error(self, err: APIError) -> list[bytes]:
        return [sse.frame(openai_error_body(err)), sse.frame(sse.DONE)]


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: the one public model id, mapped to the engines' model.

    The card carries both SDKs' fields (OpenAI `object`/`created`/`owned_by`, Anthropic
    `type`/`display_name`/`created_at`, and the list's `has_more`), so either client can list it.
    """
    model_id = request.app[CONFIG].taotoken.model_id
    created = int(time.time())
    card = {"id": model_id, "object": "model", "created": created, "owned_by": "pd-deploy", "root": request.app[PD].backend_model,
            "type": "model", "display_name": model_id,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))}
    return web.json_response({"object": "list", "data": [card], "has_more": False, "first_id": model_id, "last_id": model_id})
