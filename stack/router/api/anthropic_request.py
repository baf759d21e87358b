"""An Anthropic Messages body as the one chat request it stands for (the engines speak only chat).

Request shapes follow the anthropic SDK's types (anthropic/types: `MessageCreateParams`, `ToolParam`,
`ToolUseBlockParam`, `ToolResultBlockParam`, `ToolChoice*Param`, `TextBlockParam`, `OutputConfigParam`,
`JSONOutputFormatParam`) and https://docs.anthropic.com/en/api/messages; the chat side is OpenAI's
(vLLM's `ChatCompletionRequest`):

    system: string | text blocks (cache_control ignored)     → the system message
    messages[i] role "system" (string | text blocks)          → appended to the system message, in order (Claude Code
                                                                sends its environment block so); a conversation of
                                                                only system messages is a 400 naming `messages`
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
    max_tokens                                                → max_tokens (the handler clamps it to the context)

Accepted and ignored, as Anthropic-compatible gateways do, since no engine here reasons, edits context or bills a
user: `thinking` (any budget, also one ≥ max_tokens), `context_management`, `output_config.effort`, `metadata`
(`user_id`), `service_tier`, a tool's `cache_control` / `defer_loading`, the `anthropic-beta` header and `?beta=true`.
"""

from __future__ import annotations

import json
from typing import Any

from stack.common.errors import InvalidRequest
from stack.protocol.capabilities import Capabilities, unsupported
from stack.protocol.fields import Fields
from stack.protocol.messages import text_content
from stack.protocol.parse import parse
from stack.protocol.tools import function_tools
from stack.protocol.types import Request

_DROPPED_BLOCKS = ("thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result")  # a tuple: a list `type` is compared, not hashed
_TEXT = frozenset({"text"})
_ROLES = ("user", "assistant", "system")
_SYSTEM_JOIN = "\n\n"  # between the top-level system prompt and each system message: separate prompts, kept apart
_LABELS = {"stop": "stop_sequences", "tools": "tools", "response_format": "output_config.format"}


def _unsupported_block(kind: Any, where: str, allowed: str) -> InvalidRequest:
    return InvalidRequest(f"Unsupported content block at '{where}' (type {kind!r}): only {allowed} blocks are supported.",
                          param=where, code="unsupported_content")


def _text_blocks(content: Any, where: str) -> str:
    """A string, or text blocks joined (system, tool_result content); other blocks are a 400."""
    return text_content(content, where, _TEXT, noun="block")


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
    """The chat messages: one system message (the top-level system, then each system-role message, in order), then
    the conversation."""
    system = f.body.get("system")
    prompts = [] if system is None else [_text_blocks(system, "system")]
    messages = f.array("messages", required=True) or []
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in _ROLES:  # a list role: no hash
            raise InvalidRequest(f"Invalid value for '{where}.role': expected 'user', 'assistant' or 'system'.", param=f"{where}.role",
                                 code="invalid_value")
        if "content" not in message:
            raise InvalidRequest(f"Missing required parameter: '{where}.content'.", param=f"{where}.content",
                                 code="missing_required_parameter")
        if role == "system":
            prompts.append(_text_blocks(message["content"], f"{where}.content"))
        else:
            turns += _user(message, where, caps) if role == "user" else _assistant(message, where, caps)
    if not any(isinstance(m, dict) and m.get("role") != "system" for m in messages):
        raise f.bad("messages", "must contain at least one user or assistant message.")
    return ([{"role": "system", "content": _SYSTEM_JOIN.join(prompts)}] if prompts else []) + turns


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
    tools = function_tools(f, kinds=(None, "custom"), refusal="only client tools (no type, or \"custom\") are supported, "
                           "this router runs no server tools", keys={"input_schema": "parameters", "description": "description"},
                           required=("input_schema",))
    fields = {"model": model, "messages": chat, "max_tokens": max_tokens, "stream": body.get("stream"),
              "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel,
              "response_format": _response_format(f), "top_k": top_k if caps.top_k else None,
              **{name: body.get(name) for name in ("temperature", "top_p", "ignore_eos")}, "stop": body.get("stop_sequences")}
    return {k: v for k, v in fields.items() if v is not None}


def parse_messages_request(body: dict[str, Any], max_tokens: int | None, caps: Capabilities) -> Request:
    """The request contract for a Messages body (`max_tokens` None: count_tokens, which has none)."""
    return parse("chat", _chat(body, max_tokens, caps), labels=_LABELS, checked=True)  # body: read_json's
