"""Chat completions pass through: tool_calls chunks (vLLM's format) reach the openai SDK unchanged, streamed and not."""

from __future__ import annotations

import json

import pytest

from tests.unit.gateway.backend import Answer
from tests.unit.gateway.conftest import ALL_FLAGS, MODEL
from tests.unit.gateway.test_capabilities import TOOLS, USER


@pytest.fixture
async def gw(gateway):
    return await gateway(capabilities=ALL_FLAGS)


async def test_tool_calls_streamed_and_not(gw) -> None:
    gw.backend.script.append(Answer(text="", tool_calls=[("get_weather", '{"city": "Paris"}')]))
    answer = await gw.oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=20)
    (call,) = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and answer.model == MODEL
    gw.backend.script.append(Answer(text="", tool_calls=[("get_weather", '{"city": "Rome"}')]))
    stream = await gw.oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=20,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == '{"city": "Rome"}'
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details.cached_tokens == 4
