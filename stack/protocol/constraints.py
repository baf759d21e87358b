"""What constrains a chat answer's form: tools and tool_choice, response_format, vLLM's structured_outputs.

Shapes follow vllm/entrypoints/openai/protocol.py (`ChatCompletionToolsParam`,
`ChatCompletionNamedToolChoiceParam`, `ResponseFormat`) and vllm/sampling_params.py
(`StructuredOutputsParams`: exactly one of json, regex, choice, grammar).
"""

from __future__ import annotations

from typing import Any

from stack.common.errors import InvalidRequest
from stack.protocol.fields import Fields
from stack.protocol.types import ResponseFormat, StructuredOutputs, Tool, ToolChoice

TOOL_CHOICES = ("none", "auto", "required")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


def parse_tools(fields: Fields) -> tuple[Tool, ...]:
    tools = []
    for t in fields.objects("tools"):
        if t.string("type", default="function") != "function":
            raise t.bad("type", f"only 'function' tools are supported, got {t.body['type']!r}.", code="unsupported_parameter")
        function = t.nested("function", required=True)
        assert function is not None, "required nested object"
        tools.append(Tool(function.string("name", required=True) or "", function.string("description"), function.obj("parameters"),
                          None if function.body.get("strict") is None else function.boolean("strict")))
    return tuple(tools)


def parse_tool_choice(fields: Fields, tools: tuple[Tool, ...]) -> ToolChoice | None:
    value = fields.body.get("tool_choice")
    if value is None:
        return None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise fields.bad("tool_choice", f"expected one of none, auto, required or a named function, got {value!r}.")
        return ToolChoice(value)  # type: ignore[arg-type]
    if not isinstance(value, dict):
        raise fields.wrong("tool_choice", "a string or an object", value)
    function = Fields(value, f"{fields.label('tool_choice')}.").nested("function", required=True)
    assert function is not None, "required nested object"
    name = function.string("name", required=True) or ""
    if tools and name not in {tool.name for tool in tools}:
        raise fields.bad("tool_choice", f"the function {name!r} is not among 'tools'.")
    return ToolChoice("function", name)


def parse_response_format(fields: Fields) -> ResponseFormat | None:
    f = fields.nested("response_format")
    if f is None:
        return None
    kind = f.string("type", required=True)
    if kind == "text" or kind == "json_object":
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise f.bad("type", f"expected one of text, json_object, json_schema, got {kind!r}.")
    schema = f.nested("json_schema", required=True)
    assert schema is not None, "required nested object"
    strict = schema.body.get("strict")
    return ResponseFormat("json_schema", schema.string("name", required=True), schema.obj("schema"),
                          None if strict is None else schema.boolean("strict"), schema.string("description"))


def parse_structured_outputs(fields: Fields) -> StructuredOutputs | None:
    f = fields.nested("structured_outputs")
    if f is None:
        return None
    for key in f.body:
        if key not in STRUCTURED_KINDS:
            raise InvalidRequest(f"Unsupported parameter: '{f.label(key)}': only {', '.join(STRUCTURED_KINDS)} are supported.",
                                 param=f.label(key), code="unsupported_parameter")
    given = [key for key in STRUCTURED_KINDS if f.body.get(key) is not None]
    if len(given) != 1:
        raise fields.bad("structured_outputs", f"give exactly one of {', '.join(STRUCTURED_KINDS)}, got {len(given)}.")
    json_value: Any = f.body.get("json")
    if json_value is not None and not isinstance(json_value, (dict, str)):
        raise f.wrong("json", "an object or a string", json_value)
    choice = f.array("choice")
    if choice is not None and (not choice or not all(isinstance(c, str) for c in choice)):
        raise f.bad("choice", "expected a non-empty array of strings.")
    return StructuredOutputs(json_value, f.string("regex"), None if choice is None else tuple(choice), f.string("grammar"))
