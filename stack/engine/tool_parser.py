"""Tool calls parsed out of the generated text, the way vLLM's `hermes` parser reads them.

Hermes / Qwen2.5 models answer `text <tool_call>\n{"name": "f", "arguments": {…}}\n</tool_call>…`
(vllm-project/vllm:vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py: the text before the
first `<tool_call>` is the content, each block's JSON is one call, `arguments` re-serialised as
JSON text). One incremental parser serves both paths, so a streamed answer's deltas add up to
exactly the non-streamed message: `feed(text)` returns the new events (content text, a call's id +
name, then fragments of its arguments), `finish()` flushes what was held back. Text that could
still turn into `<tool_call>` is held back, like a stop string.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

START, END = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')  # {"name": "f", "arguments":


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"  # vLLM's `random_tool_call_id` shape


@dataclass
class ToolCallParser:
    """Feed text deltas; get `("content", text)`, `("call", index, id, name)` and `("args", index, text)` events."""

    calls: list[dict[str, Any]] = field(default_factory=list)  # finished and open calls: {id, name, arguments}
    content: str = ""  # all content text emitted
    _buf: str = ""
    _in_call: bool = False
    _named: bool = False  # the open call's id + name went out
    _args_at: int = 0  # where the open call's arguments start in _buf
    _sent: int = 0  # argument characters of the open call already emitted

    def feed(self, text: str) -> list[tuple[Any, ...]]:
        self._buf += text
        events: list[tuple[Any, ...]] = []
        while True:
            if not self._in_call:
                at = self._buf.find(START)
                if at < 0:
                    keep = _partial_suffix(self._buf, START)
                    self._content(events, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return events
                self._content(events, self._buf[:at])
                self._buf, self._in_call, self._named, self._sent = self._buf[at + len(START) :], True, False, 0
                continue
            end = self._buf.find(END)
            if end < 0:
                self._stream_args(events, self._buf[: len(self._buf) - _partial_suffix(self._buf, END)])
                return events
            self._close(events, self._buf[:end], END)
            self._buf, self._in_call = self._buf[end + len(END) :], False

    def finish(self) -> list[tuple[Any, ...]]:
        """The end of the output: flush held-back text; an unterminated call is closed if its JSON is whole."""
        events: list[tuple[Any, ...]] = []
        if self._in_call:
            self._close(events, self._buf, "")
        else:
            self._content(events, self._buf)
        self._buf, self._in_call = "", False
        return events

    def _content(self, events: list[tuple[Any, ...]], text: str) -> None:
        if not text or (self.calls and not text.strip()):  # whitespace between calls is not content
            return
        self.content += text
        events.append(("content", text))

    def _stream_args(self, events: list[tuple[Any, ...]], body: str) -> None:
        if not self._named:
            head = _HEAD.match(body)
            if head is None:
                return
            self._open(events, json.loads(head.group(1)))
            self._args_at = head.end()
        raw = body[self._args_at :]
        # Everything up to the last "}" may still be the arguments; from it on may be the call's own "}".
        brace = raw.rfind("}")
        self._emit_args(events, raw[:brace].rstrip() if brace >= 0 else raw)

    def _close(self, events: list[tuple[Any, ...]], body: str, end: str) -> None:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            call = None
        if not self._named:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                self._content(events, START + body + end)  # not a tool call after all: vLLM keeps the text
                return
            self._open(events, call["name"])
            args = call.get("arguments", {})
            self._emit_args(events, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
            return
        raw = body[self._args_at :].rstrip()
        self._emit_args(events, raw[:-1].rstrip() if raw.endswith("}") else raw)

    def _open(self, events: list[tuple[Any, ...]], name: str) -> None:
        self.calls.append({"id": tool_call_id(), "name": name, "arguments": ""})
        self._named = True
        events.append(("call", len(self.calls) - 1, self.calls[-1]["id"], name))

    def _emit_args(self, events: list[tuple[Any, ...]], args: str) -> None:
        if len(args) <= self._sent:
            return
        new = args[self._sent :]
        self._sent = len(args)
        self.calls[-1]["arguments"] += new
        events.append(("args", len(self.calls) - 1, new))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def message_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI `message.tool_calls` for parsed calls."""
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


def delta_tool_calls(event: tuple[Any, ...]) -> list[dict[str, Any]]:
    """OpenAI `delta.tool_calls` for one parser event: id + name first, then argument fragments."""
    if event[0] == "call":
        _, index, call_id, name = event
        return [{"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]
    _, index, text = event
    return [{"index": index, "function": {"arguments": text}}]
