"""The engine's OpenAI API: response and chunk shapes, errors in OpenAI's shape, cancellation, admission."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from stack.common.sse import DONE, read_events
from stack.engine.model import load_model
from stack.engine.scheduler import Scheduler

from .conftest import Logs, chat, wait_until, write_hf_checkpoint


def hold_decode_steps(scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make every step with a decode in it wait for the returned event (prefills still run)."""
    gate = threading.Event()
    execute = scheduler._execute

    def gated(work):
        if any(w.seq.output for w in work):
            gate.wait(10)  # 10 s: a hang guard only
        return execute(work)

    monkeypatch.setattr(scheduler, "_execute", gated)
    return gate


async def sse(response) -> list[Any]:
    return [data if data == DONE else json.loads(data) async for _, data in read_events(response.content)]


async def test_chat_completion_has_openai_shape_and_usage(engine_client) -> None:
    """A non-streamed chat completion carries id, object, model, one choice and usage."""
    engine = await engine_client()
    response = await engine.client.post("/v1/chat/completions", json=chat(max_tokens=5, temperature=0), headers={"X-Request-ID": "abc"})

    body = await response.json()
    assert response.status == 200 and response.headers["X-Request-ID"] == "abc"
    assert body["id"] == "chatcmpl-abc" and body["object"] == "chat.completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5


async def test_stream_chunks_role_first_usage_last_then_done(engine_client) -> None:
    """Streamed chat: role on the first chunk, finish_reason on the last, then a usage chunk with no choices, then [DONE]."""
    engine = await engine_client()
    body = chat(max_completion_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True})
    response = await engine.client.post("/v1/chat/completions", json=body)
    frames = await sse(response)

    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    assert frames[-1] == DONE
    chunks, usage = frames[:-2], frames[-2]
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1 for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    streamed = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    plain = await (await engine.client.post("/v1/chat/completions", json=chat(max_tokens=6, temperature=0))).json()
    assert streamed == plain["choices"][0]["message"]["content"]


async def test_completions_prompt_of_unknown_token_ids_is_a_400(engine_client) -> None:
    """/v1/completions with token ids outside the vocabulary answers 400 naming the id, and serves on."""
    engine = await engine_client()
    response = await engine.client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 99999], "max_tokens": 2})
    error = (await response.json())["error"]
    assert response.status == 400 and error["param"] == "prompt" and "99999" in error["message"]
    ok = await engine.client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
    assert ok.status == 200


async def test_completions_endpoint_streams_and_answers(engine_client) -> None:
    """/v1/completions takes a prompt string (or token ids) and answers text_completion objects."""
    engine = await engine_client()
    plain = await (await engine.client.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 4, "temperature": 0})).json()
    by_ids = await (await engine.client.post("/v1/completions", json={"model": "tiny", "prompt": list(b"abc"), "max_tokens": 4, "temperature": 0})).json()
    stream = await engine.client.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 4, "temperature": 0, "stream": True})
    frames = await sse(stream)

    assert plain["object"] == "text_completion" and plain["usage"]["completion_tokens"] == 4
    assert by_ids["usage"]["prompt_tokens"] == 3  # token ids are taken as they are (no bos added)
    assert frames[-1] == DONE and all(f["object"] == "text_completion" for f in frames[:-1])
    assert "".join(f["choices"][0]["text"] for f in frames[:-1]) == plain["choices"][0]["text"]


async def test_stop_string_ends_the_completion_before_it(engine_client) -> None:
    """A stop string ends generation with finish_reason stop and is not part of the text."""
    engine = await engine_client()
    full = await (await engine.client.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 24, "temperature": 0})).json()
    text = full["choices"][0]["text"].replace("\ufffd", "")
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert len(stop) == 2, f"greedy output too short to pick a stop string from: {text!r}"
    cut = await (await engine.client.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 24, "temperature": 0, "stop": [stop]})).json()

    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == full["choices"][0]["text"][: full["choices"][0]["text"].index(stop)]


BAD_REQUESTS = [
    (b"{not json", 400, "invalid_json", None),
    (b"[1, 2]", 400, "invalid_json", None),
    ({"model": "tiny"}, 400, "missing_required_parameter", "messages"),
    ({"model": "tiny", "messages": []}, 400, "invalid_value", "messages"),
    ({"model": "tiny", "messages": "hello"}, 400, "invalid_type", "messages"),
    ({"model": "tiny", "messages": [{"content": "hi"}]}, 400, "missing_required_parameter", "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "invalid_type", "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "missing_required_parameter", "model"),
    (chat(model="gpt-9"), 404, "model_not_found", "model"),
    (chat(max_tokens=0), 400, "invalid_value", "max_tokens"),
    (chat(max_tokens=-3), 400, "invalid_value", "max_tokens"),
    (chat(max_tokens="10"), 400, "invalid_type", "max_tokens"),
    (chat(max_tokens=10**6), 400, "context_length_exceeded", "max_tokens"),
    (chat(" ".join(f"w{i}" for i in range(600))), 400, "context_length_exceeded", "messages"),
    (chat(temperature=-1), 400, "invalid_value", "temperature"),
    (chat(top_p=0), 400, "invalid_value", "top_p"),
    (chat(n=2, kv_transfer_params={"do_remote_prefill": True, "transfer_id": "t"}), 400, "unsupported_parameter", "n"),
    (chat("a\ud800b"), 400, "invalid_value", "messages[0].content"),
    (chat(stop_token_ids=[10**6]), 400, "invalid_value", "stop_token_ids"),
    (chat(logit_bias={"99999": 5}), 400, "invalid_value", "logit_bias"),
    (chat(structured_outputs={"regex": "[0-9]+("}), 400, "invalid_grammar", "structured_outputs.regex"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}), 400, "invalid_grammar",
     "response_format.json_schema.schema"),
    (chat(tool_choice="required"), 400, "invalid_value", "tool_choice"),
    (chat(stop=[""]), 400, "invalid_value", "stop"),
    (chat(stream=True, stream_options="yes"), 400, "invalid_type", "stream_options"),
    (chat(stream_options={"include_usage": True}), 400, "invalid_value", "stream_options"),
    (chat(kv_transfer_params={"do_remote_decode": True, "transfer_id": "t"}), 400, "missing_required_parameter", "kv_transfer_params.decode_kv_addr"),
    (chat(kv_transfer_params={"do_remote_decode": True, "transfer_id": "t", "decode_kv_addr": "nohost"}), 400, "invalid_value", "kv_transfer_params.decode_kv_addr"),
]


@pytest.mark.parametrize(("body", "status", "code", "param"), BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
async def test_bad_request_is_a_4xx_in_openai_shape_and_the_engine_keeps_serving(engine_client, body, status, code, param) -> None:
    """Each malformed request gets its 4xx with {error: {message, type, param, code}}; the next request works."""
    engine = await engine_client()
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    response = await engine.client.post("/v1/chat/completions", **kwargs)

    error = (await response.json())["error"]
    assert response.status == status
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert (error["code"], error["param"]) == (code, param)
    ok = await engine.client.post("/v1/chat/completions", json=chat(max_tokens=2))
    assert ok.status == 200


async def test_tokenize_counts_what_a_completion_would_see(engine_client) -> None:
    """/tokenize (vLLM's shape) counts chat messages as the chat completion's prompt_tokens, and a plain prompt as
    /v1/completions does; a wrong model or a bad body is a 4xx in OpenAI's shape."""
    engine = await engine_client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    counted = await (await engine.client.post("/tokenize", json={"model": "tiny", "messages": messages})).json()
    answered = await (await engine.client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 1})).json()
    assert counted["count"] == answered["usage"]["prompt_tokens"] == len(counted["tokens"]) and counted["max_model_len"] == 512
    without_prompt = await (await engine.client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()
    assert without_prompt["count"] < counted["count"]  # the assistant header is not counted
    plain = await (await engine.client.post("/tokenize", json={"prompt": "Once upon a time"})).json()
    completion = await (await engine.client.post("/v1/completions", json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1})).json()
    assert plain["count"] == completion["usage"]["prompt_tokens"]
    wrong = await engine.client.post("/tokenize", json={"model": "other", "prompt": "x"})
    assert wrong.status == 404 and (await wrong.json())["error"]["code"] == "model_not_found"
    bad = await engine.client.post("/tokenize", json={"messages": "not a list"})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "messages"


async def test_models_and_health(engine_client) -> None:
    """/v1/models lists the configured id; /health is 503 until warm-up, then 200 with load numbers."""
    from stack.engine.server import warm_up

    engine = await engine_client()
    models = await (await engine.client.get("/v1/models")).json()
    cold = await engine.client.get("/health")
    await warm_up(engine.client.app)
    warm = await engine.client.get("/health")

    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 512
    assert cold.status == 503 and warm.status == 200
    assert (await warm.json())["kv_free_blocks"] == engine.engine.scheduler.pool.total_blocks


async def test_client_disconnect_mid_stream_cancels_and_frees_kv(engine_client, logs: Logs, monkeypatch) -> None:
    """Closing a stream after its first chunk cancels the request and returns all its KV blocks."""
    engine = await engine_client()
    scheduler, pool = engine.engine.scheduler, engine.engine.scheduler.pool
    gate = hold_decode_steps(scheduler, monkeypatch)  # no race with a fast finish
    response = await engine.client.post("/v1/chat/completions", json=chat(max_tokens=400, stream=True))
    await response.content.readline()  # the first chunk's data line
    assert pool.free_blocks < pool.total_blocks  # its KV is allocated while it streams
    response.close()
    await wait_until(lambda: scheduler.running[0].cancelled)  # the handler noticed the disconnect
    gate.set()

    await wait_until(lambda: pool.reclaimable_blocks == pool.total_blocks and not scheduler.running)
    cancelled = logs.one("engine.request_cancelled")
    assert cancelled["kv_blocks_freed"] > 0 and cancelled["completion_tokens"] <= 2
    assert not logs.events("engine.request_finished")


async def test_queued_request_waits_for_kv_and_a_disconnect_while_queued_frees_it(engine_client, logs: Logs, monkeypatch) -> None:
    """With room for one request, a second waits (engine.request_queued) and runs after; a queued one can be cancelled."""
    engine = await engine_client(kv_cache_bytes=300 * 512, block_size=16)  # 288 tokens of KV on dummy:tiny
    body = chat(max_tokens=200, temperature=0)
    first, second = await asyncio.gather(
        engine.client.post("/v1/chat/completions", json=body), engine.client.post("/v1/chat/completions", json=body)
    )
    assert first.status == second.status == 200
    assert (await first.json())["choices"] == (await second.json())["choices"]
    assert len(logs.events("engine.request_queued")) == 1

    scheduler, pool = engine.engine.scheduler, engine.engine.scheduler.pool
    gate = hold_decode_steps(scheduler, monkeypatch)  # the running request keeps its KV, the next one stays queued
    running = asyncio.ensure_future(engine.client.post("/v1/chat/completions", json=body))
    await wait_until(lambda: bool(scheduler.running))
    queued = asyncio.ensure_future(engine.client.post("/v1/chat/completions", json=body))
    await wait_until(lambda: len(scheduler.waiting) == 1)
    queued.cancel()  # the client gives up while waiting for KV
    await wait_until(lambda: scheduler.waiting[0].cancelled)  # the handler noticed
    gate.set()
    assert (await running).status == 200
    await wait_until(lambda: not scheduler.waiting and scheduler.load()["kv_free_blocks"] == pool.total_blocks)
    assert logs.events("engine.request_cancelled")[-1]["kv_blocks_freed"] == 0  # it never held KV


async def test_request_that_can_never_fit_the_pool_is_refused(engine_client, logs: Logs) -> None:
    """prompt + max_tokens beyond the KV pool budget: 400 naming the sizes, not an endless wait."""
    engine = await engine_client(kv_cache_bytes=64 * 512, block_size=16)
    response = await engine.client.post("/v1/chat/completions", json=chat(max_tokens=100))

    error = (await response.json())["error"]
    assert response.status == 400 and error["code"] == "kv_cache_too_small"
    assert "32768" in error["message"]  # the pool's size in bytes
    assert logs.one("engine.request_rejected")["max_tokens"] == 100


async def test_a_failing_engine_step_is_a_500_and_the_engine_keeps_serving(engine_client, logs: Logs, monkeypatch) -> None:
    """A bug inside a step answers 500 in OpenAI's shape (no trace), logs engine.step_failed, frees KV, and serves on."""
    engine = await engine_client()
    scheduler, pool = engine.engine.scheduler, engine.engine.scheduler.pool
    execute = scheduler._execute

    def broken(work):
        monkeypatch.setattr(scheduler, "_execute", execute)  # only this one step fails
        raise FloatingPointError("simulated numeric bug")

    monkeypatch.setattr(scheduler, "_execute", broken)
    failed = await engine.client.post("/v1/chat/completions", json=chat(max_tokens=3))
    error = (await failed.json())["error"]

    assert failed.status == 500 and error["type"] == "server_error" and "simulated" not in error["message"]
    assert logs.one("engine.step_failed")["sequences"] == 1
    assert pool.reclaimable_blocks == pool.total_blocks
    assert (await engine.client.post("/v1/chat/completions", json=chat(max_tokens=3))).status == 200


@pytest.mark.parametrize(("ignore_eos", "finish", "tokens"), [(False, "stop", 1), (True, "length", 5)])
async def test_eos_stops_generation_unless_ignore_eos(engine_client, monkeypatch, ignore_eos: bool, finish: str, tokens: int) -> None:
    """A sampled end-of-sequence token ends the completion (finish_reason stop); vLLM's ignore_eos runs on to max_tokens."""
    engine = await engine_client()
    eos = engine.engine.model.tokenizer.eos_id
    monkeypatch.setattr("stack.engine.sampling.sample", lambda *args, **kwargs: eos)  # the model "wants" to stop at once
    response = await engine.client.post("/v1/chat/completions", json=chat(max_tokens=5, ignore_eos=ignore_eos))

    body = await response.json()
    assert body["choices"][0]["finish_reason"] == finish and body["usage"]["completion_tokens"] == tokens
    assert body["choices"][0]["message"]["content"] == ""  # eos is never text


async def test_chat_template_refusal_is_a_400(engine_client, tmp_path: Path) -> None:
    """A checkpoint whose chat template raises on the messages answers 400 invalid_messages, not 500."""
    root = write_hf_checkpoint(tmp_path / "strict")
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}x"
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    engine = await engine_client("both", model=load_model(str(root)))
    response = await engine.client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "assistant", "content": "hi"}]})

    error = (await response.json())["error"]
    assert response.status == 400 and error["code"] == "invalid_messages" and "first message must be user" in error["message"]
