"""Anthropic Messages ↔ chat through the anthropic SDK, streamed and not (shapes: anthropic/types, see api/anthropic.py)."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.unit.gateway.backend import MAX_MODEL_LEN, Answer
from tests.unit.gateway.conftest import ALL_FLAGS, MODEL

TOOL = {"name": "get_weather", "description": "Weather for a city", "cache_control": {"type": "ephemeral"},
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SYSTEM = [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
          {"type": "text", "text": " Be brief."}]


@pytest.fixture
async def gw(gateway):
    return await gateway(capabilities=ALL_FLAGS)


async def test_history_with_tools_translates_to_chat(gw) -> None:
    """system blocks, tools, tool_use/tool_result (string, blocks, is_error), thinking dropped, tool_choice any."""
    history = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "two calls", "signature": "sig"},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                                          {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                      "content": [{"type": "text", "text": "service down"}]},
                                     {"type": "text", "text": "And now?", "cache_control": {"type": "ephemeral"}}]},
    ]
    await gw.claude.messages.create(model=MODEL, max_tokens=20, system=SYSTEM, messages=history, tools=[TOOL],
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"top_k": 5}, stop_sequences=["END"],
                                    metadata={"user_id": "u1"}, thinking={"type": "enabled", "budget_tokens": 1024})
    body = gw.body
    assert body["messages"] == [
        {"role": "system", "content": "You are a coding agent. Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome"})}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: service down", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "And now?"}]
    assert body["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                               "parameters": TOOL["input_schema"]}}]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["top_k"] == 5 and body["stop"] == ["END"] and body["max_tokens"] == 20


@pytest.mark.parametrize("choice, expected", [({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
                                              ({"type": "tool", "name": "get_weather"},
                                               {"type": "function", "function": {"name": "get_weather"}})])
async def test_tool_choice_kinds(gw, choice, expected) -> None:
    await gw.claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}], tools=[TOOL],
                                    tool_choice=choice)
    assert gw.body["tool_choice"] == expected


async def test_tool_call_answer_is_a_tool_use_block(gw) -> None:
    gw.backend.script.append(Answer(text="", tool_calls=[("get_weather", '{"city": "Paris"}')]))
    message = await gw.claude.messages.create(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "Paris?"}],
                                              tools=[TOOL], tool_choice={"type": "any"})
    assert message.stop_reason == "tool_use" and len(message.content) == 1
    block = message.content[0]
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"} and block.id
    assert message.usage.input_tokens == 36 and message.usage.cache_read_input_tokens == 4


async def test_streamed_tool_use_has_input_json_deltas(gw) -> None:
    """content_block_start tool_use, input_json_delta fragments, content_block_stop, stop_reason tool_use."""
    gw.backend.script.append(Answer(text="Let me check.", tool_calls=[("get_weather", '{"city": "Paris"}'),
                                                                       ("get_weather", '{"city": "Rome"}')]))
    async with gw.claude.messages.stream(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "Paris, Rome?"}],
                                         tools=[TOOL], tool_choice={"type": "any"}) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    kinds = [e.type for e in events]
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["text", "tool_use", "tool_use"] and [s.index for s in starts] == [0, 1, 2]
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert "".join(deltas) == '{"city": "Paris"}{"city": "Rome"}'
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason == "tool_use" and final.content[0].text == "Let me check."
    assert final.usage.cache_read_input_tokens == 4  # the engine's cached_tokens, as in the non-streamed body
    assert [(b.name, b.input) for b in final.content[1:]] == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.input_tokens == 36  # the engine's count (/tokenize), not an estimate
    assert gw.backend.tokenized[-1]["messages"][-1] == {"role": "user", "content": "Paris, Rome?"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reports", [True, False])
@pytest.mark.parametrize("stop", ["END", "THE END"])  # "THE END" arrives split over two chunks
async def test_stop_sequence_is_named(gw, stream, reports, stop) -> None:
    """The stop that matched → stop_reason "stop_sequence" + the string: from vLLM's choice `stop_reason`, or (an engine
    that does not say) the stop string it includes at the end on `include_stop_str_in_output`, cut before the client."""
    gw.backend.script.append(Answer(text="one two", stop_reason=stop, report_stop_reason=reports))
    kwargs = dict(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "count"}], stop_sequences=["STOP", stop])
    if stream:
        async with gw.claude.messages.stream(**kwargs) as s:
            message = await s.get_final_message()
    else:
        message = await gw.claude.messages.create(**kwargs)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == "one two" and gw.body["include_stop_str_in_output"] is True
    gw.backend.script.append(Answer(text="eos"))  # finished on EOS: end_turn, no sequence
    plain = await gw.claude.messages.create(**kwargs)
    assert plain.stop_reason == "end_turn" and plain.stop_sequence is None


@pytest.mark.parametrize("stream", [False, True])
async def test_max_tokens_is_clamped_to_the_context(gw, stream) -> None:
    """Claude Code's max_tokens 32000 over a 4096-token model: clamped to the window minus the engine's prompt count;
    a stop at that length is "model_context_window_exceeded"."""
    gw.backend.script.append(Answer(text="long", finish_reason="length"))
    kwargs = dict(model="claude-any-alias", max_tokens=32000, messages=[{"role": "user", "content": "write a lot"}])
    if stream:
        async with gw.claude.messages.stream(**kwargs) as s:
            message = await s.get_final_message()
    else:  # (an explicit timeout: the SDK refuses a non-streamed 32000-token request without one)
        message = await gw.claude.messages.create(**kwargs, timeout=30)
    assert gw.body["max_tokens"] == MAX_MODEL_LEN - 36
    assert message.stop_reason == "model_context_window_exceeded"
    gw.backend.script.append(Answer(text="short", finish_reason="length"))
    small = await gw.claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert small.stop_reason == "max_tokens" and gw.body["max_tokens"] == 10


async def test_output_config_format_is_structured_output(gw) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    gw.backend.script.append(Answer(text='{"a": 1}'))
    message = await gw.claude.messages.create(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "a?"}],
                                              output_config={"format": {"type": "json_schema", "schema": schema}})
    assert gw.body["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert json.loads(message.content[0].text) == {"a": 1}


async def test_server_tools_and_images_are_refused_by_name(gw) -> None:
    with pytest.raises(anthropic.BadRequestError) as server_tool:
        await gw.claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                                        tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert "tools[0].type" in server_tool.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as image:
        await gw.claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert "messages[0].content[0]" in image.value.body["error"]["message"]


async def test_count_tokens_is_the_engines(gw) -> None:
    counted = await gw.claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[TOOL])
    assert counted.input_tokens == 36 and gw.backend.tokenized[-1]["tools"][0]["function"]["name"] == "get_weather"
