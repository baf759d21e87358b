"""What real agents send is served (issue 19): Claude Code's first request as recorded, system-role messages, the
fields and headers Anthropic-compatible gateways accept, and JSON surrogate escapes read as JSON reads them.

Claude Code's request is replayed from tests/agents/fixtures/claude_code_first_request.json (recorded from the
pinned CLI; its prose is filled back in at the recorded lengths), so this runs without the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.agents.claude_code import SECRET_HEADERS, VARYING_HEADERS, fill
from tests.unit.gateway.conftest import ALL_FLAGS, KEY, MODEL

FIXTURE = json.loads((Path(__file__).resolve().parents[2] / "agents" / "fixtures" / "claude_code_first_request.json").read_text())
# Python's json.dumps of {"status": "Shipped 🚀"}: the emoji as an escaped surrogate pair, inside a tool's output text.
DUMPED = json.dumps({"status": "Shipped \N{ROCKET}"})
SKIPPED = {"accept-encoding", "connection"}  # the test client's own


@pytest.fixture
async def gw(gateway):
    return await gateway(capabilities=ALL_FLAGS)


def _claude_code_headers() -> dict[str, str]:
    """The recorded headers, the key ours, the session id a fresh one."""
    headers = {name: value for name, value in FIXTURE["headers"].items()
               if name not in SECRET_HEADERS | VARYING_HEADERS | SKIPPED}
    return {**headers, "x-api-key": KEY, "x-claude-code-session-id": "5f0c7a4e-2d1b-4f5e-9a7c-3b8d6e1f0a2c"}


def _text(content: Any) -> str:
    return content if isinstance(content, str) else "".join(block["text"] for block in content)


async def test_claude_codes_first_request_is_served(gw) -> None:
    """The recorded first request (a system-role message inside `messages`, adaptive thinking, context_management,
    metadata.user_id, output_config.effort, the CLI's anthropic-beta values, ?beta=true) streams a whole answer, and
    the engine gets one system message: the top-level system, then the system-role message's text."""
    body = fill(FIXTURE["body"])
    response = await gw.router.post("/v1/messages?beta=true", data=json.dumps(body), headers=_claude_code_headers())
    text = await response.text()
    assert response.status == 200, text
    assert "event: message_stop" in text
    chat = gw.body["messages"]
    system = [m for m in body["messages"] if m["role"] == "system"]
    assert chat[0] == {"role": "system", "content": "\n\n".join([_text(body["system"]), *(_text(m["content"]) for m in system)])}
    assert [m["role"] for m in chat[1:]] == [m["role"] for m in body["messages"] if m["role"] != "system"]
    assert len(gw.body["tools"]) == FIXTURE["sizes"]["tools"] and gw.body["max_tokens"] == FIXTURE["max_output_tokens"]


async def test_system_messages_join_the_system_prompt_in_order(gw) -> None:
    """System-role messages anywhere in the conversation are appended to the system prompt in their order; the
    conversation keeps its other turns as they were."""
    await gw.claude.messages.create(model=MODEL, max_tokens=5, system="Top.", messages=[
        {"role": "user", "content": "one"},
        {"role": "system", "content": [{"type": "text", "text": "Second."}]},
        {"role": "assistant", "content": "two"},
        {"role": "system", "content": "Third."},
        {"role": "user", "content": "three"}])
    assert gw.body["messages"] == [{"role": "system", "content": "Top.\n\nSecond.\n\nThird."}, {"role": "user", "content": "one"},
                                   {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}]


async def test_what_anthropic_compatible_gateways_accept_is_accepted(gw) -> None:
    """thinking with budget_tokens >= max_tokens, context_management, metadata.user_id, an unknown anthropic-beta
    value and ?beta=true: a normal answer, none of them forwarded to the engine."""
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 32000},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "user-1234"}}
    response = await gw.router.post("/v1/messages?beta=true", json=body,
                                    headers={"x-api-key": KEY, "anthropic-beta": "some-future-beta-2099-01-01,claude-code-20250219"})
    assert response.status == 200, await response.text()
    assert (await response.json())["type"] == "message"
    assert not {"thinking", "context_management", "metadata"} & set(gw.body)


ESCAPED_EMOJI = [  # (body, the field that holds the text, what the engine must receive there)
    ("/v1/chat/completions", lambda text: {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": text}]},
     lambda seen: seen["messages"][0]["content"]),
    ("/v1/messages", lambda text: {"model": MODEL, "max_tokens": 5, "messages": [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "cat status.json"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": text}]}],
     "tools": [{"name": "Bash", "input_schema": {"type": "object"}}]},
     lambda seen: seen["messages"][2]["content"]),
    ("/v1/responses", lambda text: {"model": MODEL, "max_output_tokens": 5, "input": [
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": text}],
     "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]},
     lambda seen: seen["messages"][1]["content"]),
]


@pytest.mark.parametrize("path, build, field", ESCAPED_EMOJI, ids=["chat", "messages", "responses"])
@pytest.mark.parametrize("text", [DUMPED, "Shipped \N{ROCKET}"], ids=["json-dumps-output", "emoji"])
async def test_escaped_surrogate_pairs_are_served_on_every_api(gw, path, build, field, text) -> None:
    """An emoji written as JSON's surrogate-pair escape, and the text of such an escape (a tool that printed
    json.dumps output: backslash, 'ud83d'), reach the engine as sent; only a truly lone surrogate is a 400."""
    raw = json.dumps(build(text))  # ensure_ascii: the emoji as \\ud83d\\ude80, the escaped backslash as \\\\
    assert "\\ud83d" in raw
    response = await gw.router.post(path, data=raw, headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status == 200, await response.text()
    assert field(gw.body) == text


async def test_an_uppercase_escaped_pair_is_one_character(gw) -> None:
    """`\\uD83D\\uDE80` (the case JavaScript's escapes use) is the emoji, not two lone surrogates."""
    raw = '{"model": "%s", "max_tokens": 5, "messages": [{"role": "user", "content": "Shipped \\uD83D\\uDE80"}]}' % MODEL
    response = await gw.router.post("/v1/chat/completions", data=raw, headers={"Authorization": f"Bearer {KEY}",
                                                                                "Content-Type": "application/json"})
    assert response.status == 200, await response.text()
    assert gw.body["messages"][0]["content"] == "Shipped \N{ROCKET}"
