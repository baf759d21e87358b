"""OpenAI API: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

Bodies are checked strictly, as OpenAI does: an unknown parameter is a 400 naming it. What this
deployment cannot honour is a 400 `unsupported_parameter` rather than silently ignored:
`n` > 1, `logprobs`/`top_logprobs`, `response_format` other than text, `logit_bias`, non-zero
penalties, audio, forcing a tool call (`tool_choice` "required" or a named function), image parts,
and `tool` messages. `tools` with `tool_choice` "auto"/"none" are accepted and have no effect (the
model never emits tool calls), so agents that always send their tool list still work.

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
from stack.router.api.common import (CHAT_ROLES, Params, charge, read_json, received, relay, resolve_model, sampling, text_content,
                                     upstream_body)
from stack.router.appkeys import CONFIG, PD

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

_SHARED = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "user",
           "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "metadata", "store", "service_tier",
           "ignore_eos"}  # vLLM's extension, sent by `vllm bench serve` for random datasets
_CHAT_PARAMS = _SHARED | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
                          "parallel_tool_calls", "functions", "function_call", "modalities", "audio", "reasoning_effort",
                          "prediction", "web_search_options"}
_COMPLETION_PARAMS = _SHARED | {"prompt", "echo", "best_of", "suffix"}
_CHAT_PARTS = frozenset({"text", "input_text"})


def _check_known(body: dict[str, Any], known: set[str]) -> None:
    for name in body:
        if name not in known:
            raise InvalidRequest(f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")


def _check_shared(params: Params) -> bool:
    """The checks chat and completions share; returns whether the client asked for a usage chunk."""
    params.integer("n", minimum=1)
    params.reject_unsupported("n", 1, "must be 1: this deployment returns one choice per request")
    params.reject_unsupported("logit_bias", {}, "is not supported by this deployment")
    for penalty in ("presence_penalty", "frequency_penalty"):
        params.number(penalty, -2.0, 2.0)
        params.reject_unsupported(penalty, 0, "is not supported by this deployment (only 0)")
    params.string("user")
    options = params.obj("stream_options") or {}
    include_usage = Params(options, "stream_options.").boolean("include_usage")
    if options and not params.boolean("stream"):
        raise params.bad("stream_options", "only allowed when 'stream' is true.")
    return include_usage


def _chat_messages(params: Params) -> list[dict[str, str]]:
    messages = params.array("messages", required=True) or []
    if not messages:
        raise params.bad("messages", "must contain at least one message.")
    result = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"Invalid type for '{where}': expected an object.", param=where, code="invalid_type")
        role = message.get("role")
        if role == "tool" or role == "function":
            raise InvalidRequest(f"Unsupported message role '{role}' at '{where}.role': this deployment has no tool calling.",
                                 param=f"{where}.role", code="unsupported_parameter")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"Invalid value for '{where}.role': expected one of system, developer, user, assistant, got {role!r}.",
                                 param=f"{where}.role", code="invalid_value")
        if "content" not in message or message["content"] is None:
            raise InvalidRequest(f"Missing required parameter: '{where}.content'.", param=f"{where}.content",
                                 code="missing_required_parameter")
        result.append({"role": CHAT_ROLES[role], "content": text_content(message["content"], f"{where}.content", _CHAT_PARTS)})
    return result


def _check_chat_only(params: Params) -> None:
    params.reject_unsupported("logprobs", False, "is not supported by this deployment")
    params.reject_unsupported("top_logprobs", None, "is not supported by this deployment")
    response_format = params.obj("response_format")
    if response_format is not None and response_format.get("type") != "text":
        raise InvalidRequest("Unsupported parameter: 'response_format' other than {\"type\": \"text\"} is not supported by this deployment.",
                             param="response_format", code="unsupported_parameter")
    params.array("tools")
    tool_choice = params.body.get("tool_choice")
    if tool_choice is not None and tool_choice not in ("auto", "none"):
        raise InvalidRequest("Unsupported parameter: 'tool_choice' may only be \"auto\" or \"none\": this model never calls tools.",
                             param="tool_choice", code="unsupported_parameter")
    if params.body.get("function_call") not in (None, "auto", "none"):
        raise InvalidRequest("Unsupported parameter: 'function_call' cannot force a call: this model never calls functions.",
                             param="function_call", code="unsupported_parameter")
    params.reject_unsupported("audio", None, "is not supported by this deployment")
    modalities = params.array("modalities")
    if modalities is not None and modalities != ["text"]:
        raise params.bad("modalities", "only [\"text\"] is supported.", code="unsupported_parameter")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    body = await read_json(request)
    _check_known(body, _CHAT_PARAMS)
    params = Params(body)
    model = params.string("model", required=True) or ""
    messages = _chat_messages(params)
    include_usage = _check_shared(params)
    _check_chat_only(params)
    max_tokens = params.integer("max_completion_tokens", minimum=1)
    max_tokens = params.integer("max_tokens", minimum=1) if max_tokens is None else max_tokens
    stream = params.boolean("stream")
    upstream = upstream_body(resolve_model(request, model), stream, max_tokens, sampling(params), messages=messages)
    received(request, "chat", model, stream)
    return await _answer(request, CHAT_PATH, upstream, model, include_usage)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions (legacy text completions)."""
    body = await read_json(request)
    _check_known(body, _COMPLETION_PARAMS)
    params = Params(body)
    model = params.string("model", required=True) or ""
    prompt = params.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise InvalidRequest("Missing required parameter: 'prompt'.", param="prompt", code="missing_required_parameter")
    if not isinstance(prompt, str):
        raise InvalidRequest("Unsupported parameter: 'prompt' must be one string (batches and token arrays are not supported).",
                             param="prompt", code="unsupported_parameter")
    include_usage = _check_shared(params)
    params.reject_unsupported("logprobs", None, "is not supported by this deployment")
    params.reject_unsupported("echo", False, "is not supported by this deployment")
    params.reject_unsupported("best_of", 1, "must be 1")
    params.reject_unsupported("suffix", None, "is not supported by this deployment")
    stream = params.boolean("stream")
    upstream = upstream_body(resolve_model(request, model), stream, params.integer("max_tokens", minimum=1), sampling(params),
                             prompt=prompt)
    received(request, "completions", model, stream)
    return await _answer(request, COMPLETIONS_PATH, upstream, model, include_usage)


async def _answer(request: web.Request, path: str, upstream: dict[str, Any], model: str, include_usage: bool) -> web.StreamResponse:
    pd = request.app[PD]
    if not upstream["stream"]:
        result = await pd.complete(request[REQUEST_ID], path, upstream)
        charge(request, result.get("usage"))
        return web.json_response({**result, "model": model})
    return await relay(request, pd.stream(request[REQUEST_ID], path, upstream), _ChunkRelay(model, include_usage))


class _ChunkRelay:
    """OpenAI chunks pass through with the public model id; usage only if asked; errors in-band."""

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
