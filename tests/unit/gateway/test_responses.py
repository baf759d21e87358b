"""Responses ↔ chat through the openai SDK, streamed and not (shapes: openai/types/responses, see api/responses.py)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.unit.gateway.backend import Answer
from tests.unit.gateway.conftest import ALL_FLAGS, MODEL

TOOL = {"type": "function", "name": "shell", "description": "Run a command", "strict": False,
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


@pytest.fixture
async def gw(gateway):
    return await gateway(capabilities=ALL_FLAGS)


async def test_items_translate_to_chat(gw) -> None:
    """instructions, function tools, message / function_call / function_call_output items, reasoning dropped, text.format."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    await gw.oai.responses.create(
        model=MODEL, instructions="You are Codex.", tools=[TOOL], tool_choice={"type": "function", "name": "shell"},
        parallel_tool_calls=False, max_output_tokens=30, store=False, include=["reasoning.encrypted_content"],
        text={"format": {"type": "json_schema", "name": "Verdict", "schema": schema, "strict": True}},
        input=[{"role": "user", "content": [{"type": "input_text", "text": "list files"}]},
               {"type": "reasoning", "id": "rs_1", "summary": []},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Running ls."}]},
               {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command": "ls"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "README.md"}])
    body = gw.body
    assert body["messages"] == [
        {"role": "system", "content": "You are Codex."},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "Running ls.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "content": "README.md", "tool_call_id": "call_1"}]
    assert body["tools"] == [{"type": "function", "function": {"name": "shell", "description": "Run a command",
                                                               "parameters": TOOL["parameters"], "strict": False}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "shell"}} and body["parallel_tool_calls"] is False
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "Verdict", "schema": schema, "strict": True}}
    assert body["max_tokens"] == 30
    await gw.oai.responses.create(model=MODEL, input="x", text={"format": {"type": "json_object"}})
    assert gw.body["response_format"] == {"type": "json_object"}


async def test_function_call_answer(gw) -> None:
    gw.backend.script.append(Answer(text="", tool_calls=[("shell", '{"command": "ls"}')]))
    response = await gw.oai.responses.create(model=MODEL, input="list files", tools=[TOOL])
    (item,) = response.output
    assert item.type == "function_call" and item.name == "shell" and item.arguments == '{"command": "ls"}' and item.call_id
    assert response.status == "completed" and response.usage.input_tokens_details.cached_tokens == 4


async def test_streamed_events_are_in_the_documented_order(gw) -> None:
    """text item, then each function call: output_item.added, arguments delta…, arguments done, output_item.done; completed."""
    gw.backend.script.append(Answer(text="Listing now.", tool_calls=[("shell", '{"command": "ls"}'), ("shell", '{"command": "pwd"}')]))
    async with gw.oai.responses.stream(model=MODEL, input="list files", tools=[TOOL]) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    call_events = [k for k in kinds if "function_call" in k or k.startswith("response.output_item")]
    assert call_events == ["response.output_item.added", "response.output_item.done",  # the message
                           "response.output_item.added", "response.function_call_arguments.delta",
                           "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
                           "response.output_item.added", "response.function_call_arguments.delta",
                           "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done"]
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.done")
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert final.output[0].content[0].text == "Listing now."
    assert [json.loads(o.arguments) for o in final.output[1:]] == [{"command": "ls"}, {"command": "pwd"}]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [d.output_index for d in done] == [1, 2] and done[0].arguments == '{"command": "ls"}'


async def test_hosted_tools_are_refused_by_name(gw) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await gw.oai.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert refused.value.body["param"] == "tools[0].type"
