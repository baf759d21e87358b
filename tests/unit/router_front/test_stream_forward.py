"""A paced stream's token chunks go from the engine connection's read straight to the client (pd.DecodeStream.forward_to):
the relay loop does not wake for them, and what the client reads is the same stream, in order, in every API."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stack.common import sse
from stack.router.pd import DecodeStream
from tests.unit.router_front.conftest import WORDS, auth, chat_body, wait_for_events

SLOW = [{"role": "user", "content": "SLOW"}]  # the stand-in engine writes its chunks 50 ms apart: one network read each


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the relay woke (`DecodeStream.next`) and how many chunks were forwarded without waking it."""
    counts = {"next": 0, "forwarded": 0}
    next_, forward = DecodeStream.next, DecodeStream._forward

    async def counted_next(self: DecodeStream) -> Any:
        counts["next"] += 1
        return await next_(self)

    def counted_forward(self: DecodeStream, block: bytes) -> bool:
        taken = forward(self, block)
        counts["forwarded"] += taken
        return taken

    monkeypatch.setattr(DecodeStream, "next", counted_next)
    monkeypatch.setattr(DecodeStream, "_forward", counted_forward)
    return counts


async def read(router: Any, path: str, body: dict[str, Any]) -> list[tuple[str | None, str]]:
    response = await router.post(path, json=body, headers=auth())
    assert response.status == 200
    return [frame async for frame in sse.read_events(response.content)]


async def test_chat_token_chunks_are_forwarded_without_waking_the_relay(router, spy) -> None:
    """10 chunks 50 ms apart: the first two teach the shape, the finishing one and the usage chunk are parsed, the
    seven between are forwarded; the client gets every word in order, the public model id and the usage."""
    frames = await read(router, "/v1/chat/completions", chat_body(messages=SLOW, max_tokens=10, stream=True,
                                                                 stream_options={"include_usage": True}))
    assert frames[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in frames[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == "".join(WORDS)
    assert {c["model"] for c in chunks} == {"your-model-id"} and chunks[-1]["usage"]["completion_tokens"] == 10
    assert spy["forwarded"] == 7 and spy["next"] <= 5


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
async def test_translated_streams_forward_their_text_deltas(router, spy, path) -> None:
    """Anthropic's and Responses' text deltas are made from the engine's bytes and forwarded too; the deltas add up
    to the final text the stream reports."""
    body = {**chat_body(messages=SLOW, max_tokens=10, stream=True)}
    if path == "/v1/responses":
        body = {"model": body["model"], "input": "SLOW", "max_output_tokens": 10, "stream": True}
    frames = await read(router, path, body)
    events = [json.loads(data) for _, data in frames]
    deltas = [e["delta"]["text"] if path == "/v1/messages" else e["delta"] for e in events
              if e["type"] in ("content_block_delta", "response.output_text.delta")]
    assert "".join(deltas) == "".join(WORDS)
    if path == "/v1/responses":
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == "".join(WORDS)
    assert spy["forwarded"] == 7


async def test_a_client_behind_gets_its_chunks_through_the_relay_in_order(router, spy, monkeypatch) -> None:
    """Where aiohttp's writer would wait for the client (here: as soon as anything was written), a chunk is not
    forwarded but queued for the relay, which writes it after those before it."""
    monkeypatch.setattr(sse.WriteNow, "DRAIN_AFTER", 0)
    frames = await read(router, "/v1/chat/completions", chat_body(messages=SLOW, max_tokens=10, stream=True))
    chunks = [json.loads(data) for _, data in frames[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == "".join(WORDS)
    assert spy["forwarded"] == 0 and spy["next"] >= 10


async def test_a_client_that_leaves_while_chunks_are_forwarded_is_charged_what_it_was_sent(router, spy, logs) -> None:
    """Forwarded chunks count as sent: a client that leaves after some pays for them (and its prompt), as for relayed
    ones; the router notices on its next write."""
    response = await router.post("/v1/chat/completions", json=chat_body(messages=SLOW, max_tokens=10, stream=True),
                                 headers=auth())
    got = b""
    while got.count(b"data: ") < 5:  # two relayed, then forwarded ones
        got += await response.content.readany()
    response.close()
    done = (await wait_for_events(logs, "router.request_done", 1))[-1]
    assert done["error"] == "client_disconnected" and spy["forwarded"] >= 3
    assert 5 <= done["completion_tokens"] < 10 and done["prompt_tokens"] > 0
