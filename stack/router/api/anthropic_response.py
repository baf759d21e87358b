"""A chat answer as an Anthropic Messages answer: the message body, or its stream of events.

    finish_reason stop                          → stop_reason "end_turn", or "stop_sequence" with `stop_sequence` = the
                                                  string that matched: vLLM's choice `stop_reason`
                                                  (vllm/entrypoints/openai/protocol.py), or the stop the text ends with,
                                                  asked for with vLLM's `include_stop_str_in_output` and cut (cut_stop)
    finish_reason length                        → "max_tokens", or "model_context_window_exceeded" when max_tokens was
                                                  clamped to the window (StopReason in anthropic/types/stop_reason.py)
    finish_reason tool_calls, message.tool_calls → stop_reason "tool_use", tool_use content blocks
    usage prompt_tokens, cached_tokens          → input_tokens (without cache reads), cache_read_input_tokens

Streams follow Anthropic's event sequence (`message_start`, `content_block_start`, `ping`, `content_block_delta`
text_delta / input_json_delta…, `content_block_stop`, `message_delta`, `message_stop`; no `[DONE]`): one text block,
then one tool_use block per streamed tool call (vLLM's `delta.tool_calls[i]` with id and name first, then argument
fragments → `input_json_delta.partial_json`). Errors are `{"type":"error","error":{type,message}}`; mid-stream as
`event: error`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from stack.common import sse
from stack.common.errors import APIError
from stack.router.api.common import deltas

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def anthropic_error_body(err: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def cut_stop(text: str, stops: tuple[str, ...], said: Any) -> tuple[str, str | None]:
    """(the text without the stop string, the stop that matched or None) for an answer that finished with "stop".

    Which stop matched: vLLM's choice `stop_reason` (the matched string) when the engine gives it; else the stop the
    text ends with, since the router asks for `include_stop_str_in_output` (vLLM's field). Sound: a stop string in the
    output ends generation at once, so an answer can end with one only if it matched. An engine that neither reports
    nor includes it leaves the text stop-free: end_turn."""
    if isinstance(said, str) and said in stops:
        return (text[: -len(said)] if text.endswith(said) else text), said
    for stop in sorted(stops, key=len, reverse=True):
        if text.endswith(stop):
            return text[: -len(stop)], stop
    return text, None


def stop_reason(choice: dict[str, Any], matched: str | None, clamped: bool) -> str:
    """Anthropic's stop_reason for a chat choice's finish_reason (and the stop string that matched, if any)."""
    finish = choice.get("finish_reason")
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "model_context_window_exceeded" if clamped else "max_tokens"
    return "stop_sequence" if matched is not None else "end_turn"


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as tool_use `input` (an object; text that is no JSON object is kept under "arguments")."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def usage_of(usage: dict[str, Any]) -> dict[str, Any]:
    """OpenAI usage in Anthropic's terms: `input_tokens` excludes cache reads (Anthropic's total input is
    input_tokens + cache_read_input_tokens), where OpenAI's `prompt_tokens` includes them."""
    prompt = usage.get("prompt_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if not isinstance(cached, int):
        return {"input_tokens": prompt, "output_tokens": usage.get("completion_tokens", 0)}
    return {"input_tokens": max(prompt - cached, 0), "output_tokens": usage.get("completion_tokens", 0),
            "cache_read_input_tokens": cached}


def message_body(result: dict[str, Any], message_id: str, model: str, stops: tuple[str, ...], clamped: bool) -> dict[str, Any]:
    """A non-streamed chat completion as the Messages answer."""
    choice = (result.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    text, matched = message.get("content") or "", None
    if choice.get("finish_reason") == "stop" and stops:
        text, matched = cut_stop(text, stops, choice.get("stop_reason"))
    if text or not message.get("tool_calls"):
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                        "input": tool_input(function.get("arguments") or "")})
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(choice, matched, clamped), "stop_sequence": matched, "usage": usage_of(result.get("usage") or {})}


def _event(data: dict[str, Any]) -> bytes:
    return sse.frame(data, event=data["type"])


def _text_delta_head(index: int) -> bytes:
    """A text delta's frame up to its text, as `_event` writes it (the text follows, then `"}}` and the blank line)."""
    return b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,"delta":{"type":"text_delta","text":"' % index


class EventRelay:
    """Chat chunks → Anthropic stream events: a text block, then a tool_use block per tool call (in their order)."""

    def __init__(self, message_id: str, model: str, stops: tuple[str, ...], clamped: bool) -> None:
        self.message_id, self.model, self.stops, self.clamped = message_id, model, stops, clamped
        self.input_tokens = 0  # set before the first chunk (_counted)
        self.started = False
        self.index = -1  # the open content block, -1 = none yet
        self.open: str | None = None  # "text" | "tool_use" | None (closed)
        self.tool_blocks: dict[int, int] = {}  # the chat tool call's index -> its content block index
        self.choice: dict[str, Any] = {}  # finish_reason and stop_reason as the engine said them
        self.usage: dict[str, Any] = {}
        self.held = ""  # text not sent yet: it may be the stop string the engine included (cut_stop)
        self.hold = max((len(stop) for stop in stops), default=0)
        self.text_head = b""  # the open text block's delta frame up to its text (text_frame)

    def _start(self) -> list[bytes]:
        self.started = True
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": self.input_tokens, "output_tokens": 1}}
        return [_event({"type": "message_start", "message": message})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event({"type": "content_block_stop", "index": self.index})]

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self.index += 1
        self.open = block["type"]
        self.text_head = _text_delta_head(self.index) if self.open == "text" else b""
        frames.append(_event({"type": "content_block_start", "index": self.index, "content_block": block}))
        return frames + ([_event({"type": "ping"})] if self.index == 0 else [])  # where Anthropic's own streams ping

    def text_frame(self, text: bytes) -> bytes | None:
        """The text delta for a token's text as the engine escaped it (the inside of a JSON string, so the inside of
        this frame's too), made without decoding the chunk (relay.Passthrough), when it is all the token needs: the
        text block is open and no stop string is held back. None: the chunk is parsed and goes through `chunk`."""
        if self.open != "text" or self.hold:
            return None
        return self.text_head + text + b'"}}\n\n'

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        frames = [] if self.started else self._start()
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice, delta, text in deltas(chunk):
            if text and self.hold:  # hold back what may be the stop string, until the end says
                self.held += text
                text, self.held = self.held[: -self.hold], self.held[-self.hold:]
            if text:
                frames += self._text(text)
            if delta.get("tool_calls") and self.held:
                frames += self._text(self.held)
                self.held = ""
            for call in delta.get("tool_calls") or []:
                frames += self._tool_delta(call)
            if choice.get("finish_reason"):
                self.choice = choice
        return frames

    def _text(self, text: str) -> list[bytes]:
        frames = self._open({"type": "text", "text": ""}) if self.open != "text" else []
        return [*frames, _event({"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": text}})]

    def _tool_delta(self, call: dict[str, Any]) -> list[bytes]:
        """vLLM's streamed tool call (vllm/entrypoints/openai/protocol.py DeltaToolCall: index, id and function.name
        on its first delta, then function.arguments fragments) as tool_use block events."""
        frames: list[bytes] = []
        position = call.get("index", len(self.tool_blocks))
        function = call.get("function") or {}
        if position not in self.tool_blocks:
            frames += self._open({"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                                  "name": function.get("name") or "", "input": {}})
            self.tool_blocks[position] = self.index
        arguments = function.get("arguments")
        if arguments:
            frames.append(_event({"type": "content_block_delta", "index": self.tool_blocks[position],
                                  "delta": {"type": "input_json_delta", "partial_json": arguments}}))
        return frames

    def end(self) -> list[bytes]:
        frames = [] if self.started else self._start()
        matched = None
        if self.choice.get("finish_reason") == "stop" and self.stops:
            self.held, matched = cut_stop(self.held, self.stops, self.choice.get("stop_reason"))
        if self.held:
            frames += self._text(self.held)
        if self.index < 0:
            frames += self._open({"type": "text", "text": ""})  # some clients expect a content block
        reason, sequence = stop_reason(self.choice, matched, self.clamped), matched
        usage = usage_of({"prompt_tokens": self.input_tokens, **self.usage})  # with cache_read_input_tokens, as the body has
        return [*frames, *self._close(),
                _event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}),
                _event({"type": "message_stop"})]

    def error(self, err: APIError) -> list[bytes]:
        return [sse.frame(anthropic_error_body(err), event="error")]
