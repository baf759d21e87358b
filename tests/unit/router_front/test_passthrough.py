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


async def _messages_events(router, content: str, **extra) -> list[tuple[str | None, dict]]:
    body = {"model": MODEL, "max_tokens": 6, "stream": True, "messages": [{"role": "user", "content": content}], **extra}
    response = await router.post("/v1/messages", json=body, headers=auth())
    assert response.status == 200
    return [(event, json.loads(data)) async for event, data in sse.read_events(response.content)]


async def test_anthropic_text_deltas_made_from_the_engine_bytes_are_the_parsed_ones(router, engine, logs, monkeypatch) -> None:
    """A paced stream (each chunk its own read): after the chunk that opened the text block, each token's text delta
    is made from the engine's bytes (EventRelay.text_frame), and the events are those of the stream with every chunk
    parsed: the same texts, block, stop reason and usage, and the same charge."""
    from stack.router.api.anthropic_response import EventRelay

    made: list[bytes] = []
    text_frame = EventRelay.text_frame

    def counting(self: EventRelay, text: bytes) -> bytes | None:
        frame = text_frame(self, text)
        made.extend([frame] if frame is not None else [])
        return frame

    monkeypatch.setattr(EventRelay, "text_frame", counting)
    fast = await _messages_events(router, "SLOW hello")
    assert len(made) >= 3  # the first token chunk and the one that taught the shape are parsed, so is the finishing one
    monkeypatch.setattr(EventRelay, "text_frame", lambda self, text: None)  # every chunk parsed and translated
    parsed = await _messages_events(router, "SLOW hello")
    assert [event for event, _ in fast] == [event for event, _ in parsed]
    without_ids = [[{k: v for k, v in data.get("message", data).items() if k != "id"} for _, data in events] for events in (fast, parsed)]
    assert without_ids[0] == without_ids[1]
    deltas = [data["delta"]["text"] for event, data in fast if event == "content_block_delta"]
    assert "".join(deltas) == "Hello from the fake engine." and len(deltas) == 6
    assert fast[-2][1]["delta"]["stop_reason"] == "max_tokens" and fast[-1][0] == "message_stop"
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


@pytest.mark.parametrize("text", ["plain", "tab\tnew\nline", "é€ 中文", "\u001f", "back\\slash", "say \"hi\""])
def test_a_text_delta_made_from_bytes_reads_as_the_translated_one(text: str) -> None:
    """EventRelay.text_frame on the engine's escaped text (either encoder's escapes) is a frame whose event and data
    equal what the relay writes for the parsed chunk; before the text block opens it leaves the chunk to `chunk`."""
    from stack.router.api.anthropic_response import EventRelay

    relay = EventRelay("msg_1", MODEL, (), False)
    assert relay.text_frame(b"x") is None  # no block open yet: the parsed chunk opens it
    relay.chunk({"choices": [{"index": 0, "delta": {"content": "first"}, "finish_reason": None}]})
    expected = relay.chunk({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})
    for escaped in (json.dumps(text).encode()[1:-1], sse.dumps(text)[1:-1]):
        frame = relay.text_frame(escaped)
        assert frame is not None and frame.endswith(b"\n\n")
        (event, data), = [(e, json.loads(d)) for e, d in _frames(frame)]
        assert [(event, data)] == [(e, json.loads(d)) for e, d in _frames(b"".join(expected))]


def _frames(raw: bytes) -> list[tuple[str, str]]:
    frames = []
    for block in raw.decode().split("\n\n")[:-1]:
        event, data = block.split("\n")
        frames.append((event.removeprefix("event: "), data.removeprefix("data: ")))
    return frames
