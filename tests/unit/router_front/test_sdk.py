"""The official openai and anthropic SDKs parse every answer the router gives over a real engine process.

Streamed, not streamed, and errors; the engine is `python -m stack.engine` (role both, dummy:tiny
random weights, so the text is gibberish but the tokens, streams and usage are real).
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from stack.common import sse
from tests.unit.router_front.conftest import KEY, MODEL, RealEngine

PROMPT = "Explain the KV cache in one sentence."
MAX_TOKENS = 10


@pytest.fixture
async def router(make_router, real_engine):
    return await make_router(backend=real_engine)


@pytest.fixture
def oai(router, sdk) -> openai.AsyncOpenAI:
    return sdk(openai.AsyncOpenAI, base_url=str(router.make_url("/v1")), api_key=KEY)


@pytest.fixture
def claude(router, sdk) -> anthropic.AsyncAnthropic:
    # Claude Code's setup: base URL without /v1, the unified key as the auth token (Bearer).
    return sdk(anthropic.AsyncAnthropic, base_url=str(router.make_url("")), auth_token=KEY)


def _messages() -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPT}]


async def test_openai_chat_streamed_equals_not_streamed(oai) -> None:
    """Chat: the streamed text (with the usage chunk asked for) equals the non-streamed text, and usage matches."""
    full = await oai.chat.completions.create(model=MODEL, messages=_messages(), max_tokens=MAX_TOKENS, temperature=0)
    assert full.model == MODEL and full.choices[0].message.content
    stream = await oai.chat.completions.create(model=MODEL, messages=_messages(), max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


async def test_openai_stream_without_include_usage_has_no_empty_choices(oai) -> None:
    """Without include_usage no chunk has empty choices, so `chunk.choices[0]` never raises IndexError."""
    stream = await oai.chat.completions.create(model=MODEL, messages=_messages(), max_tokens=MAX_TOKENS, stream=True)
    chunks = [chunk async for chunk in stream]
    assert chunks and all(len(c.choices) == 1 for c in chunks)


async def test_openai_completions_streamed_and_not(oai) -> None:
    """Legacy completions parse in both modes and produce the same text at temperature 0."""
    full = await oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    stream = await oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    text = "".join([c.choices[0].text async for c in stream])
    assert full.choices[0].text and text == full.choices[0].text


async def test_models_list_the_public_id_in_both_sdks(oai, claude) -> None:
    """/v1/models shows the public model id clients must send, parsed by the openai and the anthropic SDK."""
    assert [m.id async for m in oai.models.list()] == [MODEL]
    assert [m.id async for m in claude.models.list()] == [MODEL]


async def test_responses_create_and_stream(oai) -> None:
    """Responses: non-streamed output_text equals the streamed deltas; events are in order with rising sequence numbers."""
    full = await oai.responses.create(model=MODEL, input=PROMPT, instructions="Be brief.", max_output_tokens=MAX_TOKENS, temperature=0)
    assert full.output_text and full.usage.output_tokens == MAX_TOKENS
    stream = await oai.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}],
                                        instructions="Be brief.", max_output_tokens=MAX_TOKENS, temperature=0, stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full.output_text
    assert events[-1].response.output_text == full.output_text and events[-1].response.usage.total_tokens > 0


async def test_responses_stream_helper_accumulates(oai) -> None:
    """`client.responses.stream` accumulates our events; a max_output_tokens cut ends as response.incomplete, as OpenAI's does."""
    async with oai.responses.stream(model=MODEL, input=PROMPT, max_output_tokens=MAX_TOKENS, temperature=0) as stream:
        events = [event async for event in stream]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.output_text == deltas and final.response.usage.output_tokens == MAX_TOKENS


async def test_anthropic_messages_streamed_equals_not_streamed(claude) -> None:
    """Messages: the stream's text equals the non-streamed text; the final message carries both token counts."""
    full = await claude.messages.create(model=MODEL, max_tokens=MAX_TOKENS, system="Be brief.", messages=_messages(), extra_body={"temperature": 0})
    assert full.type == "message" and full.content[0].type == "text" and full.content[0].text
    assert full.stop_reason in ("end_turn", "max_tokens") and full.usage.input_tokens > 0
    async with claude.messages.stream(model=MODEL, max_tokens=MAX_TOKENS, system="Be brief.", messages=_messages(),
                                      extra_body={"temperature": 0}) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == full.content[0].text
    # The prompt, whether the engine's prefix cache held part of it (the second asking of it may find what the first left).
    prompt = [usage.input_tokens + (usage.cache_read_input_tokens or 0) for usage in (final.usage, full.usage)]
    assert prompt[0] == prompt[1] and final.usage.output_tokens == full.usage.output_tokens
    assert final.stop_reason == full.stop_reason


async def test_anthropic_count_tokens_is_the_engines_count(claude) -> None:
    """count_tokens gives exactly the input_tokens the same Messages request is then charged (the engine tokenizes)."""
    counted = await claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=_messages())
    answered = await claude.messages.create(model=MODEL, max_tokens=1, system="Be brief.", messages=_messages())
    # Anthropic's input is input_tokens + cache_read_input_tokens (the engine may hold the prompt's prefix already).
    assert counted.input_tokens == answered.usage.input_tokens + (answered.usage.cache_read_input_tokens or 0) > 0


async def test_anthropic_count_tokens_estimates_when_no_engine_can_count(make_router, sdk) -> None:
    """Over an engine without /tokenize (the stand-in) count_tokens still answers: an estimate that grows with the prompt."""
    router = await make_router()
    claude = sdk(anthropic.AsyncAnthropic, base_url=str(router.make_url("")), auth_token=KEY)
    short = await claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    long = await claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi " * 100}])
    assert 0 < short.input_tokens < long.input_tokens


async def test_sdk_errors_map_to_their_exception_classes(router, sdk) -> None:
    """A wrong key and an unknown model become each SDK's AuthenticationError and NotFoundError with our message."""
    bad_oai = sdk(openai.AsyncOpenAI, base_url=str(router.make_url("/v1")), api_key="not-the-key-123")
    with pytest.raises(openai.AuthenticationError, match="matches no key"):
        await bad_oai.chat.completions.create(model=MODEL, messages=_messages())
    good_oai = sdk(openai.AsyncOpenAI, base_url=str(router.make_url("/v1")), api_key=KEY)
    with pytest.raises(openai.NotFoundError, match="does not exist on this router"):
        await good_oai.chat.completions.create(model="nope", messages=_messages())
    bad_claude = sdk(anthropic.AsyncAnthropic, base_url=str(router.make_url("")), api_key="not-the-key-123")
    with pytest.raises(anthropic.AuthenticationError, match="matches no key"):
        await bad_claude.messages.create(model=MODEL, max_tokens=4, messages=_messages())


LONG = 400  # greedy tokens (no early EOS for PROMPT on dummy:tiny): the stream outlives the kill


async def _router_over_doomed_engine(make_router, tmp_path, name: str):
    """A router over an engine of its own, which the test kills."""
    workdir = tmp_path / name
    workdir.mkdir()
    engine = RealEngine(workdir)
    return engine, await make_router(backend=engine)


async def test_engine_killed_mid_stream_surfaces_in_openai_chat(make_router, tmp_path, sdk) -> None:
    """Engine killed after the first chunk: the openai SDK raises APIError from the in-band error, after the text sent."""
    engine, router = await _router_over_doomed_engine(make_router, tmp_path, "chat")
    client = sdk(openai.AsyncOpenAI, base_url=str(router.make_url("/v1")), api_key=KEY)
    try:
        stream = await client.chat.completions.create(model=MODEL, messages=_messages(), max_tokens=LONG, temperature=0,
                                                      stream=True)
        got = []
        with pytest.raises(openai.APIError, match="engine"):
            async for chunk in stream:
                got.append(chunk)
                if len(got) == 1:
                    engine.process.kill()
        assert 1 <= len(got) < LONG
    finally:
        engine.stop()


async def test_engine_killed_mid_stream_surfaces_in_anthropic(make_router, tmp_path, sdk) -> None:
    """Engine killed mid-stream: the anthropic SDK raises on the `event: error` frame instead of hanging."""
    engine, router = await _router_over_doomed_engine(make_router, tmp_path, "messages")
    client = sdk(anthropic.AsyncAnthropic, base_url=str(router.make_url("")), auth_token=KEY)
    try:
        pieces = []
        with pytest.raises(anthropic.APIStatusError, match="engine"):
            async with client.messages.stream(model=MODEL, max_tokens=LONG, messages=_messages(),
                                              extra_body={"temperature": 0}) as stream:
                async for piece in stream.text_stream:
                    pieces.append(piece)
                    if len(pieces) == 1:
                        engine.process.kill()
        assert pieces
    finally:
        engine.stop()


async def test_engine_killed_mid_stream_ends_responses_with_failed(make_router, tmp_path, sdk) -> None:
    """Engine killed mid-stream: a Responses stream ends with response.failed carrying the reason."""
    engine, router = await _router_over_doomed_engine(make_router, tmp_path, "responses")
    client = sdk(openai.AsyncOpenAI, base_url=str(router.make_url("/v1")), api_key=KEY)
    try:
        events = []
        async for event in await client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=LONG, temperature=0,
                                                         stream=True):
            events.append(event)
            if event.type == "response.output_text.delta" and engine.process.poll() is None:
                engine.process.kill()
        assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
        assert "engine" in events[-1].response.error.message
    finally:
        engine.stop()


async def test_every_event_validates_against_the_sdk_types(router) -> None:
    """Strict pydantic validation (the SDKs themselves only construct): no event misses a required field."""
    from anthropic.types import Message, RawMessageStreamEvent
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    headers = {"Authorization": f"Bearer {KEY}"}
    chat = {"model": MODEL, "messages": _messages(), "max_tokens": 4}
    cases = [
        ("/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}}, TypeAdapter(ChatCompletionChunk)),
        ("/v1/messages", {**chat, "stream": True}, TypeAdapter(RawMessageStreamEvent)),
        ("/v1/responses", {"model": MODEL, "input": PROMPT, "max_output_tokens": 4, "stream": True}, TypeAdapter(ResponseStreamEvent)),
    ]
    for path, body, adapter in cases:
        response = await router.post(path, json=body, headers=headers)
        # `ping` is an Anthropic keep-alive the SDK skips; it has no type in the event union.
        frames = [data async for event, data in sse.read_events(response.content) if data != sse.DONE and event != "ping"]
        assert frames, path
        for data in frames:
            adapter.validate_json(data, strict=False)
    for path, body, model in [("/v1/chat/completions", chat, ChatCompletion), ("/v1/messages", chat, Message),
                              ("/v1/responses", {"model": MODEL, "input": PROMPT, "max_output_tokens": 4}, Response)]:
        response = await router.post(path, json=body, headers=headers)
        model.model_validate_json(await response.read())
