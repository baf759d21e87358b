"""Anthropic Messages API for Claude Code: POST /v1/messages (+ /v1/messages/count_tokens).

A Messages request becomes one chat completion: `system` (a string or text blocks) becomes the
system message; each message's text blocks are joined, `tool_result` blocks contribute their text,
`tool_use` and thinking blocks are dropped (this model never produces them). Image and document
blocks, and a `tool_choice` that forces a tool, are a 400. `tools`, `metadata`, `thinking`,
`top_k` and unknown fields are accepted and ignored, because Claude Code sends them on every call.
The translated chat request goes through the same contract parser as OpenAI's (stack.protocol),
naming Anthropic's fields in its errors (`stop_sequences`).

Streams follow Anthropic's event sequence (`message_start`, `content_block_start`, `ping`,
`content_block_delta`…, `content_block_stop`, `message_delta`, `message_stop`) with no `[DONE]`.
The engine reports input tokens only at the end: `message_start.usage` carries the router's
estimate (never zero: some clients treat zeroed usage as a broken stream) and `message_delta.usage`
the engine's count, which the SDK takes as final. Errors are `{"type":"error","error":{type,message}}`; mid-stream as `event: error`.
"""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from stack.common import sse
from stack.common.errors import REQUEST_ID, APIError, InvalidRequest
from stack.protocol.fields import Fields
from stack.protocol.parse import parse
from stack.protocol.types import Request
from stack.router.api.common import charge, engine_body, read_json, received, relay
from stack.router.api.openai import CHAT_PATH
from stack.router.appkeys import PD
from stack.router.pd import estimate_prompt_tokens

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
_DROPPED_BLOCKS = {"tool_use", "thinking", "redacted_thinking", "server_tool_use"}


def anthropic_error_body(err: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def _block_text(block: Any, where: str) -> str:
    if isinstance(block, str):
        return block
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text" and isinstance(block.get("text"), str):
        return block["text"]
    if kind == "tool_result":
        content = block.get("content", "")
        return content if isinstance(content, str) else "".join(_block_text(b, f"{where}.content") for b in content or [])
    if kind in _DROPPED_BLOCKS:
        return ""
    raise InvalidRequest(f"Unsupported content block at '{where}' (type {kind!r}): only text and tool_result blocks are supported.",
                         param=where, code="unsupported_content")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"Invalid type for '{where}': expected a string or an array of content blocks.", param=where,
                             code="invalid_type")
    return "".join(_block_text(block, f"{where}[{i}]") for i, block in enumerate(content))


def _messages(f: Fields) -> list[dict[str, str]]:
    result = []
    system = f.body.get("system")
    if system is not None:
        result.append({"role": "system", "content": _text(system, "system")})
    messages = f.array("messages", required=True) or []
    if not messages:
        raise f.bad("messages", "must contain at least one message.")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise InvalidRequest(f"Invalid value for '{where}.role': expected 'user' or 'assistant'.", param=f"{where}.role",
                                 code="invalid_value")
        if "content" not in message:
            raise InvalidRequest(f"Missing required parameter: '{where}.content'.", param=f"{where}.content",
                                 code="missing_required_parameter")
        result.append({"role": message["role"], "content": _text(message["content"], f"{where}.content")})
    return result


def _tool_choice(f: Fields) -> str | dict[str, Any] | None:
    """Anthropic's tool_choice as OpenAI's: auto, none, any (= required), or one named tool."""
    choice = f.obj("tool_choice")
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"any": "required"}.get(kind, kind)


def _parse(body: dict[str, Any], max_tokens: int | None) -> Request:
    """A Messages body as the chat request the engines receive (Anthropic-only fields checked here)."""
    f = Fields(body)
    model = f.string("model", required=True)
    chat = _messages(f)
    f.integer("top_k", minimum=0)  # Claude Code sends it on every call: checked, not forwarded (the engines have no top-k)
    f.array("tools")
    fields = {"model": model, "messages": chat, "max_tokens": max_tokens, "stream": body.get("stream"), "tool_choice": _tool_choice(f),
              **{name: body.get(name) for name in ("temperature", "top_p", "ignore_eos")}, "stop": body.get("stop_sequences")}
    return parse("chat", fields, labels={"stop": "stop_sequences"})


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    body = await read_json(request)
    max_tokens = Fields(body).integer("max_tokens", minimum=1, required=True)
    req = _parse(body, max_tokens)
    upstream = engine_body(request, req)
    received(request, "messages", req.model, req.stream)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    pd = request.app[PD]
    if req.stream:
        estimate = estimate_prompt_tokens(upstream)
        return await relay(request, pd.stream(request[REQUEST_ID], CHAT_PATH, upstream), _EventRelay(message_id, req.model, estimate))
    result = await pd.complete(request[REQUEST_ID], CHAT_PATH, upstream)
    usage = result.get("usage") or {}
    charge(request, usage)
    choice = (result.get("choices") or [{}])[0]
    return web.json_response({
        "id": message_id, "type": "message", "role": "assistant", "model": req.model,
        "content": [{"type": "text", "text": (choice.get("message") or {}).get("content") or ""}],
        "stop_reason": _STOP_REASONS.get(choice.get("finish_reason"), "end_turn"), "stop_sequence": None,
        "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)},
    })


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the engines' own count (their /tokenize, as the messages request would be
    prompted), or the router's estimate (~4 characters a token) when no engine can say."""
    req = _parse(await read_json(request), None)
    chat = engine_body(request, req)["messages"]
    counted = await request.app[PD].count_tokens(request[REQUEST_ID], {"messages": chat})
    return web.json_response({"input_tokens": counted if counted is not None else estimate_prompt_tokens({"messages": chat})})


def _event(data: dict[str, Any]) -> bytes:
    return sse.frame(data, event=data["type"])


class _EventRelay:
    """Chat chunks → Anthropic stream events, one text content block."""

    def __init__(self, message_id: str, model: str, input_estimate: int) -> None:
        self.message_id, self.model, self.input_estimate = message_id, model, input_estimate
        self.started = False
        self.stop_reason = "end_turn"
        self.usage: dict[str, Any] = {}

    def _start(self) -> list[bytes]:
        self.started = True
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": self.input_estimate, "output_tokens": 1}}
        return [_event({"type": "message_start", "message": message}),
                _event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                _event({"type": "ping"})]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        frames = [] if self.started else self._start()
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                frames.append(_event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}))
            if choice.get("finish_reason"):
                self.stop_reason = _STOP_REASONS.get(choice["finish_reason"], "end_turn")
        return frames

    def end(self) -> list[bytes]:
        usage = {"input_tokens": self.usage.get("prompt_tokens", 0), "output_tokens": self.usage.get("completion_tokens", 0)}
        return [*([] if self.started else self._start()),
                _event({"type": "content_block_stop", "index": 0}),
                _event({"type": "message_delta", "delta": {"stop_reason": self.stop_reason, "stop_sequence": None}, "usage": usage}),
                _event({"type": "message_stop"})]

    def error(self, err: APIError) -> list[bytes]:
        return [sse.frame(anthropic_error_body(err), event="error")]
