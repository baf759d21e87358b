"""The OpenAI stream fast path (stack/router/relay.py): ordinary token chunks leave the router as the engine's bytes
with the model id swapped, and usage, the finish, in-band errors and the request's summary line are what they were
when every chunk was parsed."""

from __future__ import annotations

import json

import pytest

from stack.common import sse
from tests.unit.router_front.conftest import BACKEND_MODEL, MODEL, auth, chat_body, wait_for_events

ENGINE_MODEL = f'"model": "{BACKEND_MODEL}"'.encode()  # as json.dumps' spacing writes it (the "SPACED" stand-in)
CLIENT_MODEL = f'"model":"{MODEL}"'.encode()


def swapped(chunk: bytes) -> dict:
    return {**json.loads(chunk), "model": MODEL}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "SPACED"}])),
    ("/v1/completions", {"model": MODEL, "prompt": "SPACED", "max_tokens": 4}),
])
async def test_token_chunks_leave_as_the_engine_wrote_them_and_usage_is_charged(router, engine, logs, path, body) -> None:
    """The engine writes `"key": value` with spaces; the client's token frames between the first and the finishing one
    are those very bytes (only the model id swapped), not a compact re-encoding. The first, the finishing and the usage
    chunk are parsed as before, and the request is charged the engine's usage, in its line and in the key's totals."""
    body = {**body, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    response = await router.post(path, json=body, headers=auth())
    assert response.status == 200
    frames = [data.encode() async for _, data in sse.read_events(response.content)]
    sent = engine.frames[-1]  # 6 token chunks, the usage chunk
    assert frames[-1] == b"[DONE]" and len(frames) == len(sent) + 1
    assert frames[1:5] == [chunk.replace(ENGINE_MODEL, CLIENT_MODEL) for chunk in sent[1:5]]  # undecoded
    assert b": " not in frames[0] and b": " not in frames[5]  # parsed, re-encoded compact
    assert [json.loads(frame) for frame in frames[:-1]] == [swapped(chunk) for chunk in sent]
    usage = json.loads(sent[-1])["usage"]
    done = (await wait_for_events(logs, "router.request_done", 1))[0]
    assert (done["prompt_tokens"], done["completion_tokens"], done["error"]) == (usage["prompt_tokens"], 6, None)
    totals = await (await router.get("/v1/usage", headers=auth())).json()
    assert (totals["prompt_tokens"], totals["completion_tokens"]) == (usage["prompt_tokens"], 6)


async def test_usage_chunk_is_withheld_when_not_asked_while_tokens_pass_through(router, engine, logs) -> None:
    """Without include_usage the client gets every token frame and no usage chunk; the key is charged all the same."""
    body = chat_body(stream=True, max_tokens=6)
    frames = [data async for _, data in sse.read_events((await router.post("/v1/chat/completions", json=body, headers=auth())).content)]
    assert frames[-1] == "[DONE]" and len(frames) == 7 and all(json.loads(frame)["choices"] for frame in frames[:-1])
    assert "".join(json.loads(frame)["choices"][0]["delta"]["content"] for frame in frames[:-1]) == \
        "".join(json.loads(chunk)["choices"][0]["delta"]["content"] for chunk in engine.frames[-1][:-1])
    done = (await wait_for_events(logs, "router.request_done", 1))[0]
    assert done["completion_tokens"] == 6 and done["prompt_tokens"] == json.loads(engine.frames[-1][-1])["usage"]["prompt_tokens"]


async def test_an_in_band_error_after_passed_through_tokens_ends_in_the_openai_error_shape(router, engine, logs) -> None:
    """An engine's error frame after two token chunks (the second relayed undecoded): the client gets both, then the
    OpenAI error body and [DONE]; the engine's body is logged, and the request's line names the error and the two tokens."""
    body = chat_body(stream=True, max_tokens=6, messages=[{"role": "user", "content": "INBAND"}])
    response = await router.post("/v1/chat/completions", json=body, headers=auth())
    frames = [data async for _, data in sse.read_events(response.content)]
    assert [json.loads(frame)["choices"][0]["delta"]["content"] for frame in frames[:2]] == ["Hello", " from"]
    error = json.loads(frames[2])["error"]
    assert frames[3:] == ["[DONE]"] and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "upstream_error" and "decode step failed (stand-in)" in error["message"]
    done = (await wait_for_events(logs, "router.request_done", 1))[0]
    assert (done["status"], done["error"], done["completion_tokens"]) == (200, "upstream_error", 2)
    upstream = await wait_for_events(logs, "router.upstream_error", 1)
    assert "decode step failed (stand-in)" in upstream[0]["body"] and upstream[0]["status"] == 500


async def _stream_events(router, path: str, body: dict) -> list[tuple[str | None, dict]]:
    response = await router.post(path, json={**body, "stream": True}, headers=auth())
    assert response.status == 200
    return [(event, json.loads(data)) async for event, data in sse.read_events(response.content)]


async def _messages_events(router, content: str, **extra) -> list[tuple[str | None, dict]]:
    body = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": content}], **extra}
    return await _stream_events(router, "/v1/messages", body)


def _without_ids(value):
    """An event's data without what differs from one stream to the next (ids, creation time)."""
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("id", "item_id", "created_at")}
    return [_without_ids(v) for v in value] if isinstance(value, list) else value


def _relays():
    from stack.router.api.anthropic_response import EventRelay
    from stack.router.api.responses import _EventRelay

    return {"/v1/messages": EventRelay, "/v1/responses": _EventRelay}


@pytest.mark.parametrize("path, body, delta", [
    ("/v1/messages", {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": "SLOW hello"}]},
     lambda data: data["delta"]["text"]),
    ("/v1/responses", {"model": MODEL, "max_output_tokens": 6, "input": "SLOW hello"}, lambda data: data["delta"]),
])
async def test_text_deltas_made_from_the_engine_bytes_are_the_parsed_ones(router, engine, logs, monkeypatch, path, body,
                                                                          delta) -> None:
    """A paced stream (each chunk its own read), translated (Anthropic Messages, Responses): after the chunk that opened
    the text, each token's text delta is made from the engine's bytes (the relay's text_frame), and the events are
    those of the stream with every chunk parsed: the same texts, sequence, stop reason, final text and usage, and the
    same charge."""
    relay = _relays()[path]
    made: list[bytes] = []
    text_frame = relay.text_frame

    def counting(self, text: bytes) -> bytes | None:
        frame = text_frame(self, text)
        made.extend([frame] if frame is not None else [])
        return frame

    monkeypatch.setattr(relay, "text_frame", counting)
    fast = await _stream_events(router, path, body)
    assert len(made) >= 3  # the first token chunk and the one that taught the shape are parsed, so is the finishing one
    monkeypatch.setattr(relay, "text_frame", lambda self, text: None)  # every chunk parsed and translated
    parsed = await _stream_events(router, path, body)
    assert [event for event, _ in fast] == [event for event, _ in parsed]
    assert [_without_ids(data) for _, data in fast] == [_without_ids(data) for _, data in parsed]
    deltas = [delta(data) for event, data in fast if event in ("content_block_delta", "response.output_text.delta")]
    assert "".join(deltas) == "Hello from the fake engine." and len(deltas) == 6
    done = await wait_for_events(logs, "router.request_done", 2)
    assert [(line["status"], line["completion_tokens"], line["error"]) for line in done] == [(200, 6, None)] * 2


async def test_anthropic_text_is_held_back_for_stop_sequences_without_the_byte_path(router, engine, monkeypatch) -> None:
    """With stop_sequences the relay holds back what may be the stop string, so every chunk is parsed: no delta is
    made from bytes, and the text is whole."""
    from stack.router.api.anthropic_response import EventRelay

    asked: list[bytes | None] = []
    text_frame = EventRelay.text_frame

    def recording(self: EventRelay, text: bytes) -> bytes | None:
        asked.append(text_frame(self, text))
        return asked[-1]

    monkeypatch.setattr(EventRelay, "text_frame", recording)
    events = await _messages_events(router, "SLOW hello", stop_sequences=["zzz"])
    assert "".join(data["delta"]["text"] for event, data in events if event == "content_block_delta") == "Hello from the fake engine."
    assert asked and asked == [None] * len(asked)  # reads of the token shape came, and each was left to the parser


def _make_relays():
    """Each translating relay's factory; one Responses shape for all, so that their ids are the same."""
    from stack.protocol.parse import parse
    from stack.router.api.anthropic_response import EventRelay
    from stack.router.api.responses import _EventRelay, _Shape

    shape = _Shape(parse("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}), {})
    return {"messages": lambda: EventRelay("msg_1", MODEL, (), False), "responses": lambda: _EventRelay(shape)}


def _parsed(frames: list[bytes]) -> list[tuple[str, dict]]:
    return [(event, json.loads(data)) for event, data in _frames(b"".join(frames))]


@pytest.mark.parametrize("api", ["messages", "responses"])
@pytest.mark.parametrize("text", ["plain", "tab\tnew\nline", "é€ 中文", "\u001f", "back\\slash", "say \"hi\""])
def test_a_text_delta_made_from_bytes_reads_as_the_translated_one(api: str, text: str) -> None:
    """A relay's text_frame on the engine's escaped text (either encoder's escapes) is a frame whose event and data
    equal what the relay writes for the parsed chunk, and the stream ends alike (Responses' final text included);
    before the text opens it leaves the chunk to `chunk`."""
    make = _make_relays()[api]
    assert make().text_frame(b"x") is None  # nothing open yet: the parsed chunk opens the text
    first = {"choices": [{"index": 0, "delta": {"content": "first"}, "finish_reason": None}]}
    for escaped in (json.dumps(text).encode()[1:-1], sse.dumps(text)[1:-1]):
        parsed, fast = make(), make()
        parsed.chunk(first), fast.chunk(first)
        expected = parsed.chunk({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})
        frame = fast.text_frame(escaped)
        assert frame is not None and _parsed([frame]) == _parsed(expected)
        assert _parsed(fast.end()) == _parsed(parsed.end())


def test_a_responses_text_whose_escapes_do_not_decode_is_left_to_the_parser() -> None:
    """Responses keeps each delta's text for its `done` events: text that is no JSON string's inside gives no frame
    (the parser then reports the engine's bad chunk)."""
    relay = _make_relays()["responses"]()
    relay.chunk({"choices": [{"index": 0, "delta": {"content": "first"}, "finish_reason": None}]})
    assert relay.text_frame(b"bad \\q escape") is None and relay.text_frame(b"good") is not None


def _frames(raw: bytes) -> list[tuple[str, str]]:
    frames = []
    for block in raw.decode().split("\n\n")[:-1]:
        event, data = block.split("\n")
        frames.append((event.removeprefix("event: "), data.removeprefix("data: ")))
    return frames
