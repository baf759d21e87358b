"""The hermes tool-call parser: content before the first <tool_call>, one call per block, streaming = whole."""

from __future__ import annotations

import json

from stack.engine.tool_parser import ToolCallParser

TEXT = ('Let me check. <tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": {"n": 2}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "flag", "arguments": {}}\n</tool_call>')


def parse_whole(text: str) -> ToolCallParser:
    p = ToolCallParser()
    p.feed(text)
    p.finish()
    return p


def test_content_and_calls_as_vllm_hermes_reads_them() -> None:
    """The text before the first call is content; each block is one call with its arguments as JSON text."""
    p = parse_whole(TEXT)
    assert p.content == "Let me check. "
    assert [(c["name"], json.loads(c["arguments"])) for c in p.calls] == [("weather", {"city": "Paris", "days": {"n": 2}}), ("flag", {})]


def test_streaming_one_character_at_a_time_gives_the_same_calls() -> None:
    """Fed char by char: name first, then argument fragments that join to the whole-text arguments."""
    whole, p = parse_whole(TEXT), ToolCallParser()
    events = [e for ch in TEXT for e in p.feed(ch)] + p.finish()
    assert "".join(e[1] for e in events if e[0] == "content") == whole.content
    for i, call in enumerate(whole.calls):
        mine = [e for e in events if e[0] != "content" and e[1] == i]
        assert mine[0][0] == "call" and mine[0][3] == call["name"]
        assert "".join(e[2] for e in mine[1:]) == call["arguments"]


def test_text_that_is_not_a_call_stays_content() -> None:
    """Broken JSON in a block, or a plain '<' in text, is content (vLLM keeps the text when parsing fails)."""
    assert parse_whole("a < b <tool_call>not json</tool_call>").content == "a < b <tool_call>not json</tool_call>"
    assert parse_whole("a < b <tool_call>not json</tool_call>").calls == []
    assert parse_whole("truncated <tool_call>\n{\"name").content == "truncated <tool_call>\n{\"name"
