"""Every router API over ONE real vLLM (colocated: prefill endpoint == decode endpoint), through the official SDKs.

vLLM runs with `--enable-auto-tool-choice --tool-call-parser hermes` (the checkpoint's template is Hermes/Qwen
tool style, stack/engine/tiny_llama.py) and `--enable-prompt-tokens-details`; the router declares its pools
`capabilities = "vllm"`, so tools, structured outputs and logprobs pass through to vLLM unchanged. The weights
are random: the text is gibberish, but forced tool calls and json_schema outputs are grammar-constrained by
vLLM, so they are valid whatever the weights.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import anthropic
import jsonschema
import openai
import pytest

from tests.vllm.conftest import KEY, MODEL, SERVED, RouterProcess, VllmServer, auth

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}}
# Bounded so that random weights close the object well within max_tokens.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                            "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "count"], "additionalProperties": False}
HELLO = [{"role": "user", "content": "Say hello to the key value cache"}]
# Random weights left to JSON's optional whitespace write newlines until max_tokens: grammars without it end fast.
COMPACT_JSON = ("--structured-outputs-config", json.dumps({"backend": "guidance", "disable_any_whitespace": True}))


@pytest.fixture(scope="module")
def stack(vllm_venv, checkpoint, tmp_path_factory, started) -> RouterProcess:
    workdir = tmp_path_factory.mktemp("colocated")
    server = VllmServer(vllm_venv, checkpoint, workdir / "vllm.log", "--enable-auto-tool-choice", "--tool-call-parser",
                        "hermes", "--enable-prompt-tokens-details", *COMPACT_JSON)
    started.append(server)
    server.wait_healthy()
    router = RouterProcess(workdir, server, server, pools='capabilities = "vllm"')
    started.append(router)
    router.vllm = server  # type: ignore[attr-defined]
    return router


@pytest.fixture
def oai(stack, sdk) -> openai.AsyncOpenAI:
    return sdk(openai.AsyncOpenAI, base_url=f"{stack.url}/v1", api_key=KEY, timeout=120)


@pytest.fixture
def claude(stack, sdk) -> anthropic.AsyncAnthropic:
    return sdk(anthropic.AsyncAnthropic, base_url=stack.url, auth_token=KEY, timeout=120)


async def vllm_count(stack: RouterProcess, body: dict[str, Any]) -> int:
    """vLLM's own token count (its POST /tokenize), asked directly: what the router's answers must match."""
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.vllm.url + "/tokenize", json={"model": SERVED, **body}) as response:  # type: ignore[attr-defined]
            assert response.status == 200, await response.text()
            return (await response.json())["count"]


async def test_models_names_the_client_model(oai) -> None:
    models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_chat_non_streamed(stack, oai) -> None:
    answer = await oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    assert answer.model == MODEL and answer.choices[0].finish_reason in ("length", "stop")
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage.prompt_tokens == await vllm_count(stack, {"messages": HELLO})
    assert 1 <= answer.usage.completion_tokens <= 8


async def test_chat_streamed_matches_non_streamed(oai) -> None:
    """Greedy: the streamed deltas add up to the non-streamed text, and the stream ends with usage."""
    whole = await oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    stream = await oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0, stream=True,
                                               stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


async def test_completions_streamed_and_not(oai) -> None:
    whole = await oai.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=6, temperature=0)
    stream = await oai.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=6, temperature=0, stream=True,
                                          stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 6


async def test_responses_streamed_and_not(oai) -> None:
    whole = await oai.responses.create(model=MODEL, input="Say hello", max_output_tokens=16, temperature=0)
    assert whole.status in ("completed", "incomplete") and whole.usage.output_tokens >= 1
    events = [event async for event in await oai.responses.create(model=MODEL, input="Say hello", max_output_tokens=16,
                                                                    temperature=0, stream=True)]
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    assert events[-1].response.output_text == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text


async def test_messages_streamed_and_not(claude) -> None:
    greedy = {"extra_body": {"temperature": 0}}  # this anthropic SDK has no temperature argument any more
    whole = await claude.messages.create(model="claude-sonnet-4", max_tokens=8, messages=HELLO, **greedy)
    assert whole.stop_reason in ("max_tokens", "end_turn") and whole.usage.output_tokens >= 1
    async with claude.messages.stream(model="claude-sonnet-4", max_tokens=8, messages=HELLO, **greedy) as stream:
        text = "".join([delta async for delta in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "".join(block.text for block in whole.content if block.type == "text")
    assert final.usage.output_tokens == whole.usage.output_tokens


async def test_count_tokens_is_vllms_count(stack, claude) -> None:
    counted = await claude.messages.count_tokens(model="claude-sonnet-4", messages=HELLO)
    assert counted.input_tokens == await vllm_count(stack, {"messages": HELLO})


async def test_tokenize_is_vllms(stack) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.url + "/tokenize", json={"model": MODEL, "prompt": "hello world"}, headers=auth()) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
    assert answer["count"] == await vllm_count(stack, {"prompt": "hello world"}) == len(answer["tokens"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_forced_tool_call(oai, choice) -> None:
    answer = await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                               tools=[WEATHER], tool_choice=choice, max_tokens=128, temperature=0)
    calls = answer.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


async def test_forced_tool_call_streamed(oai) -> None:
    stream = await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                               tools=[WEATHER], tool_choice="required", max_tokens=128, temperature=0, stream=True)
    names, args = [], ""
    async for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names += [call.function.name] if call.function and call.function.name else []
            args += call.function.arguments or "" if call.function else ""
    assert names == ["get_weather"]
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


async def test_tool_result_turn_round_trips(oai) -> None:
    """A tool call and its result go back through the template (Hermes <tool_call>/<tool_response>) without error."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    answer = await oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=4)
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")


async def test_structured_output_json_schema(oai) -> None:
    answer = await oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=128, temperature=0,
                                               response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)


async def test_logprobs_pass_through(oai) -> None:
    answer = await oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
        assert item.logprob == max(t.logprob for t in item.top_logprobs)  # greedy picks the most likely token
