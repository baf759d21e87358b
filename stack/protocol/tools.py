"""A translated API's tool list as chat function tools (Anthropic `tools`, Responses `tools`).

Both APIs define a client tool as a flat object (name, a description, a JSON schema) where chat nests it under
`function`; each also has tools that run on the provider's side (Anthropic's server tools, Responses' hosted
tools), which no engine here can run: those are a 400 naming `tools[i].type`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stack.protocol.capabilities import unsupported
from stack.protocol.fields import Fields


def function_tools(f: Fields, kinds: tuple[str | None, ...], refusal: str, keys: Mapping[str, str],
                   required: tuple[str, ...] = ()) -> list[dict[str, Any]] | None:
    """`tools` as chat tools, or None when absent. Each tool's `type` must be one of `kinds` (None: it may be left
    out), else the 400 says `refusal`; `keys` maps the client's keys to the chat function's (copied when present),
    `required` lists those that must be objects present in every tool (Anthropic's input_schema)."""
    if f.body.get("tools") is None:
        return None
    tools = []
    for i, t in enumerate(f.objects("tools")):
        kind = t.string("type", required=None not in kinds)
        if kind not in kinds:
            raise unsupported(f"tools[{i}].type", f"{kind!r}: {refusal}")
        function: dict[str, Any] = {"name": t.string("name", required=True)}
        for key, chat_key in keys.items():
            value = t.obj(key, required=True) if key in required else t.body.get(key)
            if value is not None:
                function[chat_key] = value
        tools.append({"type": "function", "function": function})
    return tools
