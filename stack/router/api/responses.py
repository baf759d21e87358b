"""OpenAI Responses API, the subset current Codex uses: POST /v1/responses.

`input` is a string or a list of message items (`role` + string content or `input_text` /
`output_text` parts); `instructions` becomes the system message; `stream`, `max_output_tokens`,
`temperature`, `top_p` are honoured. `reasoning` items are dropped; `tools`, `reasoning`, `store`,
`include`, `text`, `metadata`, `prompt_cache_key`, `parallel_tool_calls` and unknown fields are
ignored (Codex sends them; this model never calls tools). A forced `tool_choice`,
`previous_response_id` (nothing is stored), images/files and tool-call output items are a 400.

Streams emit `response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`…, `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`, then `response.completed` (or
`response.incomplete` when max_output_tokens cut it short, as OpenAI does), each with a
`sequence_number`. A failure after the start ends the stream with `response.failed`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from stack.common import sse
from stack.common.errors import REQUEST_ID, APIError, InvalidRequest
from stack.protocol.capabilities import unsupported
from stack.protocol.fields import Fields
from stack.protocol.messages import CHAT_ROLES, text_content
from stack.protocol.parse import parse
from stack.protocol.types import Request
from stack.router.api.common import charge, engine_body, read_json, received, relay
from stack.router.api.openai import CHAT_PATH
from stack.router.appkeys import PD

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_ROLES = {"user", "assistant", "system", "developer"}


def _messages(f: Fields) -> list[dict[str, str]]:
    result = []
    instructions = f.string("instructions")
    if instructions:
        result.append({"role": "system", "content": instructions})
    items = f.body.get("input")
    if isinstance(items, str):
        return [*result, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("Invalid value for 'input': expected a string or a non-empty array of message items.", param="input",
                             code="invalid_value" if isinstance(items, list) else "invalid_type")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "reasoning":
            continue
        if kind != "message" or item.get("role") not in _ROLES:
            raise InvalidRequest(f"Unsupported input item at '{where}' (type {kind!r}): only message items with role "
                                 "user, assistant, system or developer are supported.", param=where, code="unsupported_input")
        result.append({"role": CHAT_ROLES[item["role"]], "content": text_content(item.get("content", ""), f"{where}.content", _TEXT_PARTS)})
    return result


def _parse(body: dict[str, Any]) -> Request:
    """A Responses body as the chat request the engines receive (Responses-only fields checked here)."""
    f = Fields(body)
    model = f.string("model", required=True)
    if "input" not in body:
        raise InvalidRequest("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    chat = _messages(f)
    if body.get("previous_response_id") is not None:
        raise unsupported("previous_response_id", "is not supported: this router stores no responses; send the whole conversation in 'input'")
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        # Responses names the function at the top level ({"type": "function", "name": …}); choosing a
        # hosted tool ({"type": "web_search"}) forces a tool call too.
        choice = {"type": "function", "function": {"name": choice.get("name")}} if choice.get("type") == "function" else "required"
    fields = {"model": model, "messages": chat, "max_tokens": body.get("max_output_tokens"), "stream": body.get("stream"),
              "tool_choice": choice, **{name: body.get(name) for name in ("temperature", "top_p", "ignore_eos")}}
    return parse("chat", fields, labels={"max_tokens": "max_output_tokens"})


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    body = await read_json(request)
    req = _parse(body)
    upstream = engine_body(request, req)
    received(request, "responses", req.model, req.stream)
    shape = _Shape(req, body.get("instructions"))
    pd = request.app[PD]
    if req.stream:
        return await relay(request, pd.stream(request[REQUEST_ID], CHAT_PATH, upstream), _EventRelay(shape))
    result = await pd.complete(request[REQUEST_ID], CHAT_PATH, upstream)
    charge(request, result.get("usage"))
    choice = (result.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or ""
    status = _status(choice.get("finish_reason"))
    return web.json_response(shape.response(status, [shape.item(text, status)], result.get("usage")))


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class _Shape:
    """Builds the Response object and its output message the way the openai SDK types expect them."""

    def __init__(self, req: Request, instructions: str | None) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model, self.sampling, self.instructions = req.model, req.sampling, instructions

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        prompt = (usage or {}).get("prompt_tokens", 0)
        completion = (usage or {}).get("completion_tokens", 0)
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.instructions, "max_output_tokens": self.sampling.max_tokens, "output": output,
            "parallel_tool_calls": False, "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
            "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "truncation": "disabled",
            "metadata": {}, "usage": None if usage is None else {
                "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion},
        }


class _EventRelay:
    """Chat chunks → Responses stream events for one output message with one text part."""

    def __init__(self, shape: _Shape) -> None:
        self.shape = shape
        self.sequence = 0
        self.started = False
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse.frame(data, event=kind)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.shape.item_id, "output_index": 0, "content_index": 0}

    def _start(self) -> list[bytes]:
        self.started = True
        pending = self.shape.response("in_progress", [])
        return [self._event("response.created", response=pending),
                self._event("response.in_progress", response=pending),
                self._event("response.output_item.added", output_index=0, item=self.shape.item(None, "in_progress")),
                self._event("response.content_part.added", **self._where(), part=self.shape.part(""))]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        frames = [] if self.started else self._start()
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = (choice.get("delta") or {}).get("content")
            if delta:
                self.text.append(delta)
                frames.append(self._event("response.output_text.delta", **self._where(), delta=delta, logprobs=[]))
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return frames

    def end(self) -> list[bytes]:
        text = "".join(self.text)
        status = _status(self.finish_reason)
        item = self.shape.item(text, status)
        return [*([] if self.started else self._start()),
                self._event("response.output_text.done", **self._where(), text=text, logprobs=[]),
                self._event("response.content_part.done", **self._where(), part=self.shape.part(text)),
                self._event("response.output_item.done", output_index=0, item=item),
                self._event(f"response.{status}", response=self.shape.response(status, [item], self.usage or {}))]

    def error(self, err: APIError) -> list[bytes]:
        error = {"code": "rate_limit_exceeded" if err.status == 429 else "server_error", "message": err.message}
        failed = self.shape.response("failed", [], self.usage, error)
        return [*([] if self.started else self._start()), self._event("response.failed", response=failed)]
