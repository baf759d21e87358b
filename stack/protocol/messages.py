"""Chat messages: roles, text content, assistant tool calls and tool results.

Content is text: a string or an array of text parts (joined). Other parts (images, audio, files)
are a 400 `unsupported_content` naming the part; the Responses and Anthropic translators reuse
`text_content` with their own part types (and Anthropic's word for them, "block").
"""

from __future__ import annotations

from typing import Any

from stack.common.errors import InvalidRequest
from stack.protocol.fields import Fields
from stack.protocol.types import Message, ToolCall

# OpenAI chat and Responses roles, as the engines' chat templates know them.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
CHAT_PARTS = frozenset({"text", "input_text"})


def text_content(content: Any, where: str, part_types: frozenset[str], noun: str = "part") -> str:
    """A message's content as text: a string, or an array of text parts of `part_types` (others are a 400).
    `noun`: what the client's API calls an item of content (OpenAI a "part", Anthropic a "block")."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"Invalid type for '{where}': expected a string or an array of content {noun}s.", param=where,
                             code="invalid_type")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if not isinstance(kind, str) or kind not in part_types or not isinstance(part.get("text"), str):  # a list type: no hash
            raise InvalidRequest(f"Unsupported content {noun} at '{where}[{i}]' (type {kind!r}): only {', '.join(sorted(part_types))} "
                                 f"{noun}s are supported.", param=f"{where}[{i}]", code="unsupported_content")
        texts.append(part["text"])
    return "".join(texts)


def parse_messages(fields: Fields) -> tuple[Message, ...]:
    """`messages`: a non-empty array of chat messages."""
    messages = fields.objects("messages", required=True)
    if not messages:
        raise fields.bad("messages", "must contain at least one message.")
    return tuple(_message(f) for f in messages)


def _message(f: Fields) -> Message:
    where = f.prefix.rstrip(".")
    role = f.string("role", required=True)
    if role == "function":
        raise InvalidRequest(f"Unsupported message role 'function' at '{where}.role': the deprecated function role is not "
                             "supported; send a 'tool' message.", param=f"{where}.role", code="unsupported_parameter")
    if role not in CHAT_ROLES:
        raise f.bad("role", f"expected one of system, developer, user, assistant, tool, got {role!r}.")
    tool_calls = _tool_calls(f) if role == "assistant" else ()
    content = f.body.get("content")
    if content is None and not tool_calls:
        raise InvalidRequest(f"Missing required parameter: '{where}.content'.", param=f"{where}.content",
                             code="missing_required_parameter")
    text = None if content is None else text_content(content, f"{where}.content", CHAT_PARTS)
    tool_call_id = f.string("tool_call_id", required=True) if role == "tool" else None
    return Message(CHAT_ROLES[role], text, f.string("name"), tool_calls, tool_call_id)  # type: ignore[arg-type]


def _tool_calls(f: Fields) -> tuple[ToolCall, ...]:
    calls = []
    for c in f.objects("tool_calls"):
        if c.string("type", default="function") != "function":
            raise c.bad("type", f"expected 'function', got {c.body['type']!r}.")
        function = c.nested("function", required=True)
        assert function is not None, "required nested object"
        calls.append(ToolCall(c.string("id", required=True) or "", function.string("name", required=True) or "",
                              function.string("arguments", required=True) or ""))
    return tuple(calls)
