"""A `Request` back to the normalised OpenAI JSON body the router sends upstream.

Normalised: one spelling per field (`max_tokens`, `stop` as a list, text content as a string,
chat logprobs as `logprobs: true` + `top_logprobs`), unset fields left out, so
`parse(kind, to_body(r)) == r` for every request `r` (tests/unit/protocol checks it).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from stack.protocol.types import Message, Request, ResponseFormat, Sampling, StructuredOutputs, Tool, ToolChoice


def to_body(request: Request) -> dict[str, Any]:
    body: dict[str, Any] = {"model": request.model}
    if request.kind == "chat":
        body["messages"] = [message_body(m) for m in request.messages]
    else:
        body["prompt"] = request.prompt if isinstance(request.prompt, str) else list(request.prompt)
    body["stream"] = request.stream
    if request.include_usage:
        body["stream_options"] = {"include_usage": True}
    body |= _sampling(request.kind, request.sampling)
    if request.tools:
        body["tools"] = [_tool(t) for t in request.tools]
    if request.tool_choice is not None:
        body["tool_choice"] = _tool_choice(request.tool_choice)
    if request.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.response_format is not None:
        body["response_format"] = _response_format(request.response_format)
    if request.structured_outputs is not None:
        body["structured_outputs"] = _structured_outputs(request.structured_outputs)
    if request.kv_transfer_params is not None:
        body["kv_transfer_params"] = request.kv_transfer_params
    return body


def message_body(message: Message) -> dict[str, Any]:
    """One chat message as OpenAI JSON (also what the engine hands its chat template)."""
    body: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name is not None:
        body["name"] = message.name
    if message.tool_calls:
        body["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                              for c in message.tool_calls]
    if message.tool_call_id is not None:
        body["tool_call_id"] = message.tool_call_id
    return body


_SAMPLING_FIELDS = tuple(f.name for f in fields(Sampling))


def _sampling(kind: str, sampling: Sampling) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for name in _SAMPLING_FIELDS:
        value = getattr(sampling, name)
        if value is None or value == () or value is False:
            continue
        if name == "logprobs" and kind == "chat":
            body |= {"logprobs": True, "top_logprobs": value}
        elif name == "logit_bias":
            body["logit_bias"] = {str(token): bias for token, bias in value}
        else:
            body[name] = list(value) if isinstance(value, tuple) else value
    return body


def _tool(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    for key in ("description", "parameters", "strict"):
        if getattr(tool, key) is not None:
            function[key] = getattr(tool, key)
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    return choice.mode if choice.mode != "function" else {"type": "function", "function": {"name": choice.name}}


def _response_format(fmt: ResponseFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {key: getattr(fmt, key) for key in ("name", "schema", "strict", "description") if getattr(fmt, key) is not None}
    return {"type": "json_schema", "json_schema": schema}


def _structured_outputs(so: StructuredOutputs) -> dict[str, Any]:
    return {key: list(value) if isinstance(value, tuple) else value
            for key in ("json", "regex", "choice", "grammar") if (value := getattr(so, key)) is not None}
