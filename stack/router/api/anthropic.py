"""Anthropic Messages API (Claude Code): POST /v1/messages (+ /v1/messages/count_tokens), translated to one chat completion.

Request shapes follow the anthropic SDK's types (anthropic/types: `MessageCreateParams`, `ToolParam`,
`ToolUseBlockParam`, `ToolResultBlockParam`, `ToolChoice*Param`, `TextBlockParam`, `OutputConfigParam`,
`JSONOutputFormatParam`) and https://docs.anthropic.com/en/api/messages; the chat side is OpenAI's
(vLLM's `ChatCompletionRequest`). Both ways:

    system: string | text blocks (cache_control ignored)     → the system message
    user text blocks                                          → a user message (blocks joined)
    user tool_result {tool_use_id, content: str | blocks,     → a `tool` message {tool_call_id, content}, before the
                      is_error}                                 user's text (is_error: content prefixed "Error: ")
    assistant text + tool_use {id, name, input}               → an assistant message with content + tool_calls
                                                                (arguments = json.dumps(input))
    thinking / redacted_thinking blocks in history            → dropped: Anthropic strips thinking of earlier turns
                                                                from the context itself ("Thinking blocks from previous
                                                                turns are removed", docs: build-with-claude/extended-thinking)
    tools [{name, description, input_schema}]                 → tools [{type: function, function: {name, description,
                                                                parameters: input_schema}}]; server tools (a `type`
                                                                other than "custom") are a 400 naming tools[i].type
    tool_choice auto | any | tool {name} | none               → "auto" | "required" | {function: name} | "none";
               disable_parallel_tool_use                      → parallel_tool_calls: false
    stop_sequences                                            → stop
    output_config.format {type: json_schema, schema}          → response_format json_schema (name "output")
    top_k                                                     → top_k (dropped for a backend without top_k: Claude Code sends it)
    max_tokens                                                → max_tokens, clamped to what fits the context (below)

    finish_reason stop                                        → stop_reason "end_turn", or "stop_sequence" with
                                                                `stop_sequence` = the string that matched: vLLM's choice
                                                                `stop_reason` (vllm/entrypoints/openai/protocol.py), or
                                                                the stop the text ends with, asked for with vLLM's
                                                                `include_stop_str_in_output` and cut (cut_stop)
    finish_reason length                                      → "max_tokens", or "model_context_window_exceeded" when
                                                                max_tokens was clamped to the window (StopReason in
                                                                anthropic/types/stop_reason.py; docs: "the model stopped
                                                                because it reached its context window limit")
    finish_reason tool_calls, message.tool_calls              → stop_reason "tool_use", tool_use content blocks

Clamping (issue 10): Claude Code asks for max_tokens 32000 whatever the model; OpenAI's APIs keep vLLM's 400 for a
request beyond the context, but here max_tokens becomes min(max_tokens, max_model_len - prompt tokens), the prompt
counted by the engine (vLLM's POST /tokenize on the translated chat request, tools included). The count is asked
first when the request might not fit: max_tokens at least a quarter of the context, or twice the request's UTF-8 size
(room for the chat template's own text) + max_tokens beyond it. A smaller request beyond the context gets the
engine's 400.

Streams follow Anthropic's event sequence (`message_start`, `content_block_start`, `ping`, `content_block_delta`
text_delta / input_json_delta…, `content_block_stop`, `message_delta`, `message_stop`; no `[DONE]`): one text block,
then one tool_use block per streamed tool call (vLLM's `delta.tool_calls[i]` with id and name first, then argument
fragments → `input_json_delta.partial_json`). `message_start.usage.input_tokens` is the engine's exact count, from
/tokenize asked in parallel with the prefill leg (the router's estimate only if no engine answers). Errors are
`{"type":"error","error":{type,message}}`; mid-stream as `event: error`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from stack.common import sse
from stack.common.errors import REQUEST_ID, APIError, InvalidRequest
from stack.protocol.capabilities import Capabilities, unsupported
from stack.protocol.fields import Fields
from stack.protocol.parse import parse
from stack.protocol.types import Request
from stack.router.api.common import capabilities, charge, engine_body, read_json, received, relay
from stack.router.api.openai import CHAT_PATH
from stack.router.appkeys import PD
from stack.router.job import estimate_prompt_tokens

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
_DROPPED_BLOCKS = ("thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result")  # a tuple: a list `type` is compared, not hashed


_NAMES = {"response_format": "output_config.format", "stop": "stop_sequences"}  # chat field -> the field this API's client sent (refusals name it)


def anthropic_error_body(err: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def _unsupported_block(kind: Any, where: str, allowed: str) -> InvalidRequest:
    return InvalidRequest(f"Unsupported content block at '{where}' (type {kind!r}): only {allowed} blocks are supported.",
                          param=where, code="unsupported_content")


def _text_blocks(content: Any, where: str) -> str:
    """A string, or text blocks joined (system, tool_result content); other blocks are a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"Invalid type for '{where}': expected a string or an array of content blocks.", param=where,
                             code="invalid_type")
    texts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise _unsupported_block(kind, f"{where}[{i}]", "text")
        text = Fields(block, f"{where}[{i}].").string("text", required=True)
        texts.append(text or "")
    return "".join(texts)


def _no_tools(where: str) -> InvalidRequest:
    return unsupported(where, "cannot be replayed: the backends have no tool calling (their declared capabilities)")


def _blocks(content: Any, where: str) -> list[tuple[str, Any, Any, Fields]]:
    """A turn's content blocks as (where, type, block, its fields); content that is no array is a 400."""
    if not isinstance(content, list):
        raise InvalidRequest(f"Invalid type for '{where}.content': expected a string or an array of content blocks.",
                             param=f"{where}.content", code="invalid_type")
    return [(f"{where}.content[{i}]", block.get("type") if isinstance(block, dict) else None, block,
             Fields(block if isinstance(block, dict) else {}, f"{where}.content[{i}]."))
            for i, block in enumerate(content)]


def _user(message: dict[str, Any], where: str, caps: Capabilities) -> list[dict[str, Any]]:
    """A user turn: one `tool` message per tool_result block, then the text (if any) as a user message."""
    content = message["content"]
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results, texts = [], []
    for at, kind, block, f in _blocks(content, where):
        if kind == "text":
            texts.append(f.string("text", required=True) or "")
        elif kind == "tool_result":
            if not caps.tools:
                raise _no_tools(at)
            text = _text_blocks(block.get("content", ""), f"{at}.content")
            if f.boolean("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": f.string("tool_use_id", required=True), "content": text})
        elif kind not in _DROPPED_BLOCKS:
            raise _unsupported_block(kind, at, "text and tool_result")
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _assistant(message: dict[str, Any], where: str, caps: Capabilities) -> list[dict[str, Any]]:
    """An assistant turn: its text, and its tool_use blocks as tool_calls (thinking dropped, see the module doc)."""
    content = message["content"]
    if isinstance(content, str):
        return [{"role": "assistant", "content": content}]
    texts, calls = [], []
    for at, kind, _block, f in _blocks(content, where):
        if kind == "text":
            texts.append(f.string("text", required=True) or "")
        elif kind == "tool_use":
            if not caps.tools:
                raise _no_tools(at)
            arguments = f.obj("input", required=True)
            calls.append({"id": f.string("id", required=True), "type": "function",
                          "function": {"name": f.string("name", required=True), "arguments": json.dumps(arguments)}})
        elif kind not in _DROPPED_BLOCKS:
            raise _unsupported_block(kind, at, "text, tool_use and thinking")
    if not texts and not calls:
        return []  # only thinking: nothing for the model
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return [turn]


def _messages(f: Fields, caps: Capabilities) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = []
    system = f.body.get("system")
    if system is not None:
        result.append({"role": "system", "content": _text_blocks(system, "system")})
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
        result += _user(message, where, caps) if message["role"] == "user" else _assistant(message, where, caps)
    return result


def _tools(f: Fields) -> list[dict[str, Any]] | None:
    if f.body.get("tools") is None:
        return None
    tools = []
    for i, t in enumerate(f.objects("tools")):
        kind = t.string("type")
        if kind not in (None, "custom"):
            raise unsupported(f"tools[{i}].type", f"{kind!r}: only client tools (no type, or \"custom\") are supported, "
                                                  "this router runs no server tools")
        function: dict[str, Any] = {"name": t.string("name", required=True), "parameters": t.obj("input_schema", required=True)}
        if t.string("description") is not None:
            function["description"] = t.body["description"]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(f: Fields) -> tuple[str | dict[str, Any] | None, bool | None]:
    """Anthropic's tool_choice as OpenAI's (auto, none, any = required, tool = a named function) and parallel_tool_calls."""
    choice = f.nested("tool_choice")
    if choice is None:
        return None, None
    kind = choice.string("type", required=True)
    parallel = False if choice.boolean("disable_parallel_tool_use") else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.string("name", required=True)}}, parallel
    if kind not in ("auto", "any", "none"):
        raise choice.bad("type", f"expected one of auto, any, tool, none, got {kind!r}.")
    return {"any": "required"}.get(kind, kind), parallel


def _response_format(f: Fields) -> dict[str, Any] | None:
    """`output_config.format` (or the structured-outputs beta's top-level `output_format`) as response_format."""
    config = f.nested("output_config")
    holder, key = (config, "format") if config is not None and config.body.get("format") is not None else (f, "output_format")
    fmt = holder.nested(key)
    if fmt is None:
        return None
    kind = fmt.string("type", required=True)
    if kind != "json_schema":
        raise fmt.bad("type", f"expected 'json_schema', got {kind!r}.")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.obj("schema", required=True)}}


def _chat(body: dict[str, Any], max_tokens: int | None, caps: Capabilities) -> dict[str, Any]:
    """A Messages body as the chat body it stands for (Anthropic-only fields checked here)."""
    f = Fields(body)
    model = f.string("model", required=True)
    chat = _messages(f, caps)
    top_k = f.integer("top_k", minimum=0)
    tool_choice, parallel = _tool_choice(f)
    fields = {"model": model, "messages": chat, "max_tokens": max_tokens, "stream": body.get("stream"),
              "tools": _tools(f), "tool_choice": tool_choice, "parallel_tool_calls": parallel,
              "response_format": _response_format(f), "top_k": top_k if caps.top_k else None,
              **{name: body.get(name) for name in ("temperature", "top_p", "ignore_eos")}, "stop": body.get("stop_sequences")}
    return {k: v for k, v in fields.items() if v is not None}


def _parse(body: dict[str, Any], max_tokens: int | None, caps: Capabilities) -> Request:
    return parse("chat", _chat(body, max_tokens, caps), labels={"stop": "stop_sequences", "tools": "tools",
                                                                 "response_format": "output_config.format"})


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


async def _fit_context(request: web.Request, upstream: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
    """Clamp upstream max_tokens to the context left after the prompt (the engine's count): (lowered?, the /tokenize
    answer if one was asked)."""
    window = request.app[PD].monitor.max_model_len
    wanted = upstream.get("max_tokens")
    if not window or not isinstance(wanted, int):
        return False, None
    size = len(json.dumps([upstream["messages"], upstream.get("tools")], ensure_ascii=False).encode())
    if wanted * 4 < window and size * 2 + wanted < window:
        return False, None  # a small answer after a prompt far from the window (the chat template's text included)
    answer = await _tokenize(request, upstream)
    count = (answer or {}).get("count")
    window = (answer or {}).get("max_model_len") or window
    if not isinstance(count, int) or count >= window or count + wanted <= window:
        return False, answer  # unknown, too long for any answer (the engine's 400 says so), or it fits
    upstream["max_tokens"] = window - count
    return True, answer


async def _known(answer: dict[str, Any]) -> dict[str, Any]:
    return answer


async def _tokenize(request: web.Request, upstream: dict[str, Any]) -> dict[str, Any] | None:
    """The engine's /tokenize answer for the chat prompt of `upstream` (vLLM's TokenizeChatRequest), or None."""
    body = {"model": upstream["model"], "messages": upstream["messages"]}
    if upstream.get("tools"):
        body["tools"] = upstream["tools"]
    answer = await request.app[PD].tokenizer_call(request[REQUEST_ID], "/tokenize", body)
    return answer[1] if answer is not None and answer[0] == 200 and isinstance(answer[1], dict) else None


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    body = await read_json(request)
    max_tokens = Fields(body).integer("max_tokens", minimum=1, required=True)
    req = _parse(body, max_tokens, capabilities(request))
    upstream = engine_body(request, req, "messages", names=_NAMES)
    received(request, "messages", req.model, req.stream)
    clamped, counted = await _fit_context(request, upstream)
    if req.sampling.stop:
        upstream["include_stop_str_in_output"] = True  # to tell which stop matched (cut_stop); ignored by engines without it
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    pd = request.app[PD]
    stops = req.sampling.stop
    if req.stream:
        # The prompt count for message_start: asked in parallel with the prefill leg, unless the clamp asked already.
        count = asyncio.ensure_future(_tokenize(request, upstream) if counted is None else _known(counted))
        relay_ = _EventRelay(message_id, req.model, stops, clamped)
        return await relay(request, _counted(pd.stream(request[REQUEST_ID], CHAT_PATH, req, upstream, request.headers), count, relay_, req), relay_)
    result = await pd.complete(request[REQUEST_ID], CHAT_PATH, req, upstream, request.headers)
    usage = result.get("usage") or {}
    charge(request, usage)
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
    return web.json_response({
        "id": message_id, "type": "message", "role": "assistant", "model": req.model, "content": content,
        "stop_reason": stop_reason(choice, matched, clamped), "stop_sequence": matched, "usage": _usage(usage),
    })


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """OpenAI usage in Anthropic's terms: `input_tokens` excludes cache reads (Anthropic's total input is
    input_tokens + cache_read_input_tokens), where OpenAI's `prompt_tokens` includes them."""
    prompt = usage.get("prompt_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if not isinstance(cached, int):
        return {"input_tokens": prompt, "output_tokens": usage.get("completion_tokens", 0)}
    return {"input_tokens": max(prompt - cached, 0), "output_tokens": usage.get("completion_tokens", 0),
            "cache_read_input_tokens": cached}


async def _counted(batches: AsyncIterator[list[dict[str, Any]]], count: asyncio.Future[dict[str, Any] | None],
                   relay_: _EventRelay, req: Request) -> AsyncIterator[list[dict[str, Any]]]:
    """`batches`, with the engine's prompt count handed to `relay_` before the first (message_start carries it)."""
    try:
        first = True
        async for batch in batches:
            if first:
                first = False
                answer = await count
                counted = (answer or {}).get("count")
                relay_.input_tokens = counted if isinstance(counted, int) else estimate_prompt_tokens(req)
            yield batch
    finally:
        count.cancel()
        await batches.aclose()  # type: ignore[attr-defined]


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the engines' own count (their /tokenize, as the messages request would be
    prompted, tools included), or the router's estimate (~4 characters a token) when no engine can say."""
    req = _parse(await read_json(request), None, capabilities(request))
    answer = await _tokenize(request, engine_body(request, req, "messages"))
    counted = (answer or {}).get("count")
    return web.json_response({"input_tokens": counted if isinstance(counted, int) else estimate_prompt_tokens(req)})


def _event(data: dict[str, Any]) -> bytes:
    return sse.frame(data, event=data["type"])


class _EventRelay:
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
        frames.append(_event({"type": "content_block_start", "index": self.index, "content_block": block}))
        return frames + ([_event({"type": "ping"})] if self.index == 0 else [])  # where Anthropic's own streams ping

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        frames = [] if self.started else self._start()
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content")
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
        usage = _usage({"prompt_tokens": self.input_tokens, **self.usage})  # with cache_read_input_tokens, as the body has
        return [*frames, *self._close(),
                _event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}),
                _event({"type": "message_stop"})]

    def error(self, err: APIError) -> list[bytes]:
        return [sse.frame(anthropic_error_body(err), event="error")]
