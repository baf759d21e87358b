"""OpenAI Responses API (Codex): POST /v1/responses, translated to one chat completion and back.

Shapes follow the openai SDK's types (openai/types/responses: `ResponseCreateParams`, `ResponseInputItemParam`
`Message` / `FunctionCallOutput`, `ResponseFunctionToolCallParam`, `FunctionToolParam`, `ResponseTextConfigParam`,
the `Response*Event` stream events) and https://platform.openai.com/docs/api-reference/responses:

    instructions                                    → the system message
    input: string | items
      message {role, content: str | input_text /   → a chat message (developer → system)
               output_text parts}
      function_call {call_id, name, arguments}      → an assistant message's tool_calls (consecutive calls: one message)
      function_call_output {call_id, output}        → a `tool` message (output: a string or input_text parts)
      reasoning                                     → dropped (nothing here produces or reads it)
    tools [{type: function, name, description,      → chat tools (other tool types are a 400 naming tools[i].type)
            parameters, strict}]
    tool_choice auto | none | required |            → the same, or a named function
                {type: function, name}
    text.format text | json_object |                → response_format (json_schema: name, schema, strict, description)
                json_schema {name, schema, …}
    max_output_tokens, temperature, top_p,          → max_tokens, temperature, top_p, parallel_tool_calls
    parallel_tool_calls

    the answer's text                               → a `message` output item with one output_text part
    the answer's tool_calls                         → one `function_call` output item each {call_id, name, arguments}
    finish_reason length                            → status "incomplete", incomplete_details.reason max_output_tokens

`previous_response_id` is a 400 (nothing is stored); `store`, `include`, `metadata`, `reasoning`,
`prompt_cache_key` and unknown fields are accepted and ignored (Codex sends them).

Streams emit `response.created`, `response.in_progress`; for the text: `response.output_item.added` (message),
`response.content_part.added`, `response.output_text.delta`…, `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`; for each tool call (vLLM's streamed
`delta.tool_calls[i]`): `response.output_item.added` (function_call, arguments ""),
`response.function_call_arguments.delta`…, `response.function_call_arguments.done`, `response.output_item.done`;
then `response.completed` (or `response.incomplete`), every event with its `sequence_number`. An item is
closed (`….done`) before the next one is added. A failure after the start ends the stream with `response.failed`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from stack.common import json_text, sse
from stack.common.errors import REQUEST_ID, APIError, InvalidRequest
from stack.protocol.capabilities import Capabilities, unsupported
from stack.protocol.fields import Fields
from stack.protocol.messages import CHAT_ROLES, text_content
from stack.protocol.parse import parse
from stack.protocol.tools import function_tools
from stack.protocol.types import Request
from stack.router.api.common import capabilities, charge, client_field, deltas, engine_body, json_answer, read_json, relay
from stack.router.api.openai import CHAT_PATH
from stack.router.appkeys import PD

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_ROLES = {"user", "assistant", "system", "developer"}


_NAMES = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input"}  # chat field -> the field this API's client sent (refusals name it)


def _messages(f: Fields, caps: Capabilities) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = []
    instructions = f.string("instructions")
    if instructions:
        result.append({"role": "system", "content": instructions})
    items = f.body.get("input")
    if isinstance(items, str):
        return [*result, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("Invalid value for 'input': expected a string or a non-empty array of input items.", param="input",
                             code="invalid_value" if isinstance(items, list) else "invalid_type")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        g = Fields(item if isinstance(item, dict) else {}, f"{where}.")
        if kind == "reasoning":
            continue
        if kind in ("function_call", "function_call_output") and not caps.tools:
            raise unsupported(where, "cannot be replayed: the backends have no tool calling (their declared capabilities)")
        if kind == "function_call":
            call = {"id": g.string("call_id", required=True), "type": "function",
                    "function": {"name": g.string("name", required=True), "arguments": g.string("arguments", required=True)}}
            last = result[-1] if result else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            elif last is not None and last["role"] == "assistant" and last.get("tool_calls") is None:
                last["tool_calls"] = [call]  # the text the model said before calling
            else:
                result.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else text_content(output, f"{where}.output", _TEXT_PARTS)
            result.append({"role": "tool", "tool_call_id": g.string("call_id", required=True), "content": text})
            continue
        if kind != "message" or not isinstance(item.get("role"), str) or item["role"] not in _ROLES:  # a list role: no hash
            raise InvalidRequest(f"Unsupported input item at '{where}' (type {kind!r}): only message, function_call, "
                                 "function_call_output and reasoning items are supported.", param=where, code="unsupported_input")
        result.append({"role": CHAT_ROLES[item["role"]], "content": text_content(item.get("content", ""), f"{where}.content", _TEXT_PARTS)})
    return result


def _tool_choice(f: Fields) -> str | dict[str, Any] | None:
    choice = f.body.get("tool_choice")
    if not isinstance(choice, dict):
        return choice
    # Responses names the function at the top level ({"type": "function", "name": …}); hosted tools cannot be chosen here.
    if choice.get("type") != "function":
        raise unsupported("tool_choice", f"{choice.get('type')!r}: only a function can be chosen (this router runs no hosted tools)")
    return {"type": "function", "function": {"name": Fields(choice, "tool_choice.").string("name", required=True)}}


def _response_format(f: Fields) -> dict[str, Any] | None:
    text = f.nested("text")
    fmt = text.nested("format") if text is not None else None
    if fmt is None:
        return None
    kind = fmt.string("type", required=True)
    if kind != "json_schema":
        return {"type": kind}  # text | json_object (others: the contract's 400)
    schema = {"name": fmt.string("name", required=True), "schema": fmt.obj("schema", required=True)}
    for key in ("strict", "description"):
        if fmt.body.get(key) is not None:
            schema[key] = fmt.body[key]
    return {"type": "json_schema", "json_schema": schema}


def _parse(body: dict[str, Any], caps: Capabilities) -> Request:
    """A Responses body as the chat request the engines receive (Responses-only fields checked here)."""
    f = Fields(body)
    model = f.string("model", required=True)
    if "input" not in body:
        raise InvalidRequest("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    chat = _messages(f, caps)
    if body.get("previous_response_id") is not None:
        raise unsupported("previous_response_id", "is not supported: this router stores no responses; send the whole conversation in 'input'")
    tools = function_tools(f, kinds=("function",), refusal="only function tools are supported (this router runs no hosted tools)",
                           keys={key: key for key in ("description", "parameters", "strict")})
    fields = {"model": model, "messages": chat, "max_tokens": body.get("max_output_tokens"), "stream": body.get("stream"),
              "tools": tools, "tool_choice": _tool_choice(f), "response_format": _response_format(f),
              **{name: body.get(name) for name in ("temperature", "top_p", "ignore_eos", "parallel_tool_calls")}}
    return parse("chat", {k: v for k, v in fields.items() if v is not None},
                 labels={"max_tokens": "max_output_tokens", "response_format": "text.format"}, checked=True)


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    body = await read_json(request)
    req = _parse(body, capabilities(request))
    upstream = engine_body(request, req, "responses", names=_NAMES)
    shape = _Shape(req, body)
    events = _EventRelay(shape)
    pd = request.app[PD]
    try:  # an engine's refusal of a field names the one this client sent (max_output_tokens past the window)
        if req.stream:
            stream = await pd.open(request[REQUEST_ID], "responses", CHAT_PATH, req, upstream, request.headers,
                                   text_frame=events.text_frame)  # a token's text delta made from its bytes
        else:
            result = await pd.complete(request[REQUEST_ID], "responses", CHAT_PATH, req, upstream, request.headers)
    except InvalidRequest as err:
        raise client_field(err, _NAMES) from None
    if req.stream:
        return await relay(request, stream, events)
    charge(request, result.get("usage"))
    choice = (result.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    status = _status(choice.get("finish_reason"))
    output = [shape.item(message["content"], status)] if message.get("content") or not message.get("tool_calls") else []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        output.append(shape.call(call.get("id") or "", function.get("name") or "", function.get("arguments") or "", "completed"))
    return json_answer(shape.response(status, output, result.get("usage")))


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class _Shape:
    """Builds the Response object and its output items the way the openai SDK types expect them."""

    def __init__(self, req: Request, body: dict[str, Any]) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model, self.sampling, self.instructions = req.model, req.sampling, body.get("instructions")
        self.tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
        self.tool_choice = body.get("tool_choice") or "auto"
        self.text = {"format": ((body.get("text") or {}).get("format")) or {"type": "text"}}
        self.parallel = body.get("parallel_tool_calls") is not False

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def call(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict[str, Any]:
        return {"id": item_id or f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        prompt = (usage or {}).get("prompt_tokens", 0)
        completion = (usage or {}).get("completion_tokens", 0)
        cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.instructions, "max_output_tokens": self.sampling.max_tokens, "output": output,
            "parallel_tool_calls": self.parallel, "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
            "text": self.text, "tool_choice": self.tool_choice, "tools": self.tools, "truncation": "disabled",
            "metadata": {}, "usage": None if usage is None else {
                "input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion},
        }


class _EventRelay:
    """Chat chunks → Responses stream events: the message item (if any text), then one function_call item per call."""

    def __init__(self, shape: _Shape) -> None:
        self.shape = shape
        self.sequence = 0
        self.started = False
        self.output: list[dict[str, Any]] = []  # finished items, in output_index order
        self.open: dict[str, Any] | None = None  # the item being streamed: {"kind", "item", "text" | "arguments", "index"}
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> its open/finished state
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.delta_head = b""  # the open message's text delta frame up to its text (text_frame)

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse.frame(data, event=kind)

    def _start(self) -> list[bytes]:
        self.started = True
        pending = self.shape.response("in_progress", [])
        return [self._event("response.created", response=pending), self._event("response.in_progress", response=pending)]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None, "no open item"
        return {"item_id": self.open["item"]["id"], "output_index": self.open["index"]}

    def _open_message(self) -> list[bytes]:
        frames = self._close()
        item = self.shape.item(None, "in_progress")
        self.open = {"kind": "message", "item": item, "text": [], "index": len(self.output)}
        # A text delta's frame up to its text, as _event writes it, with a place for its sequence number (text_frame).
        self.delta_head = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":%d,'
                           b'"item_id":' + sse.dumps(item["id"]).replace(b"%", b"%%") + b',"output_index":%d,"content_index":0,"delta":"')
        return [*frames, self._event("response.output_item.added", output_index=self.open["index"], item=item),
                self._event("response.content_part.added", **self._where(), content_index=0, part=self.shape.part(""))]

    def _open_call(self, call_id: str, name: str) -> list[bytes]:
        frames = self._close()
        item = self.shape.call(call_id, name, "", "in_progress")
        self.open = {"kind": "call", "item": item, "arguments": [], "index": len(self.output)}
        return [*frames, self._event("response.output_item.added", output_index=self.open["index"], item=item)]

    def _close(self, status: str = "completed") -> list[bytes]:
        if self.open is None:
            return []
        where, state = self._where(), self.open
        self.open = None
        if state["kind"] == "message":
            text = "".join(state["text"])
            item = {**state["item"], "status": status, "content": [self.shape.part(text)]}
            frames = [self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                      self._event("response.content_part.done", **where, content_index=0, part=self.shape.part(text))]
        else:
            arguments = "".join(state["arguments"])
            item = {**state["item"], "status": "completed", "arguments": arguments}
            frames = [self._event("response.function_call_arguments.done", **where, name=item["name"], arguments=arguments)]
        self.output.append(item)
        return [*frames, self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def text_frame(self, text: bytes) -> bytes | None:
        """The text delta for a token's text as the engine escaped it (the inside of a JSON string, so the inside of
        this frame's too), made without decoding the chunk (relay.Passthrough), when the message item is open; the text
        is kept, decoded, for the item's `done` events. None: the chunk is parsed and goes through `chunk` (as one whose
        escapes do not decode, whose error the parse then reports)."""
        state = self.open
        if state is None or state["kind"] != "message":
            return None
        try:
            state["text"].append(json_text.decode(b'"' + text + b'"'))
        except json_text.DecodeError:
            return None
        frame = self.delta_head % (self.sequence, state["index"]) + text + b'","logprobs":[]}\n\n'
        self.sequence += 1
        return frame

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        frames = [] if self.started else self._start()
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice, delta, text in deltas(chunk):
            if text:
                if self.open is None or self.open["kind"] != "message":
                    frames += self._open_message()
                assert self.open is not None, "message just opened"
                self.open["text"].append(text)
                frames.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[]))
            for call in delta.get("tool_calls") or []:
                frames += self._tool_delta(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return frames

    def _tool_delta(self, call: dict[str, Any]) -> list[bytes]:
        """vLLM's DeltaToolCall (index, id and function.name first, then function.arguments fragments)."""
        frames: list[bytes] = []
        position = call.get("index", len(self.calls))
        function = call.get("function") or {}
        if position not in self.calls:
            frames += self._open_call(call.get("id") or f"call_{uuid.uuid4().hex[:24]}", function.get("name") or "")
            self.calls[position] = self.open or {}
        arguments = function.get("arguments")
        state = self.calls[position]
        if arguments and state is self.open:
            state["arguments"].append(arguments)
            frames.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return frames

    def end(self) -> list[bytes]:
        frames = [] if self.started else self._start()
        status = _status(self.finish_reason)
        if not self.output and self.open is None:
            frames += self._open_message()  # an empty answer is still one (empty) message, as before
        frames += self._close(status)
        return [*frames, self._event(f"response.{status}", response=self.shape.response(status, self.output, self.usage or {}))]

    def error(self, err: APIError) -> list[bytes]:
        error = {"code": "rate_limit_exceeded" if err.status == 429 else "server_error", "message": err.message}
        failed = self.shape.response("failed", self.output, self.usage, error)
        return [*([] if self.started else self._start()), self._event("response.failed", response=failed)]
