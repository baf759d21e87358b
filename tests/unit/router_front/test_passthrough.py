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
