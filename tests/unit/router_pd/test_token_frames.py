"""Which decode frames the OpenAI relay may forward undecoded (relay.token_frame, relay.Passthrough): only ordinary
token chunks, told by their bytes; every doubt sends the frame to the parser."""

from __future__ import annotations

import json

import pytest

from stack.common.errors import UpstreamError
from stack.router.relay import Passthrough, token_frame
from tests.unit.router_pd.conftest import batches, typed
from tests.unit.router_pd.fake_engine import Faults, chunk_text, vllm_capture

BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "engine/m"}


def chunk(content: str = "hi", finish: str | None = None, **extra) -> dict:
    return {**BASE, "choices": [{"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": finish}], **extra}


def compact(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def data_of(frame: bytes) -> bytes:
    """A relayed frame's data: what Passthrough gives is the SSE frame the client is sent."""
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n"), frame
    return frame[len(b"data: "):-2]


@pytest.mark.parametrize("data", [
    compact(chunk()),
    json.dumps(chunk()).encode(),  # json.dumps' spacing
    compact(chunk('he wrote "usage", "error" and "finish_reason": "stop"')),  # quoted words in text are escaped
    compact({**BASE, "choices": [{"index": 1, "text": "é€", "finish_reason": None}]}),  # a text completion, n > 1
])
def test_ordinary_token_chunks_are_told_by_their_bytes(data: bytes) -> None:
    """An object whose every choice is unfinished, without usage or error, is a token frame."""
    assert token_frame(data)


@pytest.mark.parametrize("data", [
    compact(chunk(finish="stop")),  # the finishing chunk: the stream's end is decided on it
    compact({**BASE, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}),
    compact(chunk(usage=None)),  # a usage key, even null
    compact({"error": {"message": "decode step failed", "code": 500}}),
    compact(chunk("usage")),  # a text that is exactly a key's name: parsed (a doubt)
    compact(chunk("a", finish=None) | {"choices": [chunk()["choices"][0], {"index": 1, "finish_reason": "length"}]}),
    compact(BASE),  # no choices
    b'{"id":"chatcmpl-1","choices":[{"finish_reason":null',  # cut short
    b"[1, 2]",
    b"not json",
])
def test_anything_else_is_parsed(data: bytes) -> None:
    """Finish, usage, errors, doubts and what is not an object go to the parser."""
    assert not token_frame(data)


def test_a_captured_vllm_stream_passes_through_but_for_its_finish_and_usage() -> None:
    """vLLM's own decode stream (captured, fixtures/): every chunk before the finishing one goes on as bytes with the
    client's model id; the finishing chunk and the usage chunk are parsed."""
    wire = vllm_capture("vllm_nixl_prefill")["decode_stream"]
    frames = [block.removeprefix("data: ").encode() for block in wire.split("\n\n") if block.startswith("data: {")]
    take = Passthrough(json.loads(frames[0])["model"], "public-id").take
    relayed = [take(frame) for frame in frames]
    assert [data is not None for data in relayed] == [True] * (len(frames) - 2) + [False, False]
    assert [json.loads(data_of(data)) for data in relayed[:-2]] == [{**json.loads(frame), "model": "public-id"} for frame in frames[:-2]]


def test_passthrough_swaps_the_model_id_only_where_it_is_certain() -> None:
    """The engine's id (learnt from the first chunk) becomes the client's, in either spacing; a frame naming another
    id, or with "model" twice, is left to the parser."""
    take = Passthrough("engine/m", "public-id").take
    assert json.loads(data_of(take(compact(chunk())))) == {**chunk(), "model": "public-id"}
    assert json.loads(data_of(take(json.dumps(chunk()).encode()))) == {**chunk(), "model": "public-id"}
    assert take(compact({**chunk(), "model": "other"})) is None
    assert take(compact(chunk("model"))) is None
    assert take(compact(chunk(finish="length"))) is None
    assert Passthrough(None, "public-id").take(compact(chunk())) is None  # a first chunk without a model id


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def learnt(first: bytes = compact(chunk())) -> Passthrough:
    """A Passthrough that has taken one token chunk (and so learnt its shape)."""
    passthrough = Passthrough("engine/m", "public-id")
    assert passthrough.take(first) is not None
    return passthrough


@pytest.mark.parametrize("text", ["there", "line\nnext\ttab", "é€ 中文", "back\\slash inside", ""])
def test_a_read_shaped_as_the_last_token_chunk_is_taken_whole(text: str) -> None:
    """One network read holding one frame that differs from the learnt token chunk only in its text (escapes and
    UTF-8 included): that chunk with the client's model id, as `take` would have relayed it."""
    for encode in (compact, lambda value: json.dumps(value).encode()):
        passthrough = learnt(encode(chunk()))
        data = encode(chunk(text))
        assert passthrough.whole(sse(data)) == passthrough.take(data)
        assert json.loads(data_of(passthrough.whole(sse(data)))) == {**chunk(text), "model": "public-id"}


@pytest.mark.parametrize("block", [
    sse(compact(chunk('say "hi"'))),  # a quote in the text: where the text ends is the parser's to tell
    sse(compact(chunk("ends with a backslash \\"))),  # its escape would otherwise look like the tail's quote
    sse(compact(chunk("a"))) + sse(compact(chunk("b"))),  # two frames in one read
    sse(compact(chunk("a")))[:-1],  # a frame cut short
    b"data:" + compact(chunk("a")) + b"\n\n",  # other SSE spelling
    sse(compact(chunk("a"))).replace(b"\n\n", b"\r\n\r\n"),
    sse(compact(chunk("a", finish="stop"))),
    sse(compact({**chunk("a"), "model": "other"})),
    sse(compact(chunk("a")).replace(b'"a"', b'"\xff"')),  # not UTF-8: the reader fails the leg on it
    sse(compact(chunk("a")).replace(b'"a"', b'"a\nb"')),  # a raw line break: not one frame
    sse(compact(chunk("a", usage=None))),
])
def test_any_other_read_goes_to_the_reader(block: bytes) -> None:
    """Whatever is not exactly one frame of the learnt shape is split by the reader and decided frame by frame."""
    assert learnt().whole(block) is None


def test_nothing_is_taken_whole_before_a_token_chunk_was_taken() -> None:
    """The shape is learnt from a token chunk `take` relayed, whose text has no quote or backslash."""
    passthrough = Passthrough("engine/m", "public-id")
    assert passthrough.whole(sse(compact(chunk("a")))) is None
    assert passthrough.take(compact(chunk('with "quotes"'))) is not None
    assert passthrough.whole(sse(compact(chunk("a")))) is None
    assert passthrough.take(compact(chunk("plain"))) is not None
    assert passthrough.whole(sse(compact(chunk("a")))) is not None


def test_a_captured_vllm_stream_is_taken_whole_once_its_shape_is_learnt() -> None:
    """vLLM's own token chunks (captured) differ only in their text: after the first one taken, each later one, read
    alone, is taken whole, as `take` would have relayed it."""
    wire = vllm_capture("vllm_nixl_prefill")["decode_stream"]
    frames = [block.removeprefix("data: ").encode() for block in wire.split("\n\n") if block.startswith("data: {")]
    passthrough = Passthrough(json.loads(frames[0])["model"], "public-id")
    tokens = frames[1:-2]  # after the first (parsed), before the finishing and usage chunks
    assert passthrough.take(tokens[0]) is not None
    assert [passthrough.whole(sse(frame)) for frame in tokens[1:]] == [passthrough.take(frame) for frame in tokens[1:]]
    assert None not in [passthrough.whole(sse(frame)) for frame in tokens[1:]]


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}


def as_dicts(chunks: list) -> list[dict]:
    return [json.loads(data_of(c)) if isinstance(c, bytes) else c for c in chunks]


async def test_a_pd_stream_yields_token_chunks_as_bytes_and_parses_the_rest(fake, pd):
    """Over prefill + decode, open(raw_model=…) hands on the token chunks between the first and the finishing one as
    bytes carrying the client's model id; the first, finishing and usage chunks come parsed; together, the answer."""
    client = await pd([await fake("prefill")], [await fake("decode", tokens=6, faults=Faults(burst=True))])
    chunks = [c async for batch in batches(client, "raw", "chat", "/v1/chat/completions", *typed(dict(CHAT)), raw_model="public")
              for c in batch]
    assert [type(c).__name__ for c in chunks] == ["dict"] + ["bytes"] * 4 + ["dict", "dict"]
    parsed = as_dicts(chunks)
    assert chunk_text(parsed) == "t0 t1 t2 t3 t4 t5 " and parsed[-1]["usage"]["completion_tokens"] == 6
    assert {c["model"] for c in parsed[1:5]} == {"public"}


async def test_a_paced_stream_takes_its_token_chunks_whole(fake, pd, monkeypatch):
    """An engine that writes each chunk on its own (as real engines do, token by token): after the first token
    chunk, the relay takes the others whole, without a frame split, and the answer is the same."""
    taken: list[bytes] = []
    whole = Passthrough.whole

    def counting(self: Passthrough, block: bytes) -> bytes | None:
        data = whole(self, block)
        if data is not None:
            taken.append(data)
        return data

    monkeypatch.setattr(Passthrough, "whole", counting)
    client = await pd([await fake("prefill")], [await fake("decode", tokens=8)])
    chunks = [c async for batch in batches(client, "paced", "chat", "/v1/chat/completions", *typed({**CHAT, "max_tokens": 8}),
                                            raw_model="public") for c in batch]
    parsed = as_dicts(chunks)
    assert chunk_text(parsed) == "t0 t1 t2 t3 t4 t5 t6 t7 " and parsed[-1]["usage"]["completion_tokens"] == 8
    assert len(taken) >= 3 and all(json.loads(data_of(data))["model"] == "public" for data in taken)


async def test_an_error_frame_after_bytes_chunks_fails_the_stream_after_them(fake, pd, logs):
    """An in-band error frame behind token chunks relayed as bytes: the caller gets those chunks, then the error."""
    decode = await fake("decode", tokens=6, faults=Faults(burst=True, error_after_chunks=3))
    client = await pd([await fake("prefill")], [decode])
    got: list = []
    with pytest.raises(UpstreamError, match="decode step failed"):
        async for batch in batches(client, "rawe", "chat", "/v1/chat/completions", *typed(dict(CHAT)), raw_model="public"):
            got += batch
    assert [type(c).__name__ for c in got] == ["dict", "bytes", "bytes"] and chunk_text(as_dicts(got)) == "t0 t1 t2 "
    assert logs.events("router.decode_failed")[-1]["mid_stream"] is True


def test_a_translated_stream_learns_from_take_and_makes_its_frames_from_the_text() -> None:
    """Given text_frame (Anthropic's deltas), `take` relays nothing (its frames are parsed and translated) but learns
    the shape; a read of that shape is then the frame text_frame makes of the text as the engine escaped it."""
    passthrough = Passthrough("engine/m", "", text_frame=lambda text: b"<" + text + b">")
    assert passthrough.take(compact(chunk("plain"))) is None
    assert passthrough.whole(sse(compact(chunk("tab\tand é")))) == b"<" + compact("tab\tand é")[1:-1] + b">"
    assert passthrough.whole(sse(compact(chunk('a "quote"')))) is None


def test_a_translated_stream_does_not_learn_from_a_chunk_that_also_calls_a_tool() -> None:
    """Its frame would say the text only: a token chunk with a tool call teaches no shape, and reads stay parsed."""
    passthrough = Passthrough("engine/m", "", text_frame=lambda text: text)
    calling = chunk("x")
    calling["choices"][0]["delta"]["tool_calls"] = [{"index": 0, "function": {"arguments": "{}"}}]
    assert passthrough.take(compact(calling)) is None
    assert passthrough.whole(sse(compact(calling))) is None and passthrough.shape is None
