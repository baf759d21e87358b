"""Front-end behaviour around the APIs: request ids, what reaches the engine, usage chunks, health, metrics, logs."""

from __future__ import annotations

import asyncio
import json

import openai
from aiohttp.test_utils import TestClient, TestServer

from stack.common import sse
from stack.common.logging import AccessLogger
from stack.router import config as router_config
from stack.router.app import create_app
from tests.unit.router_front.conftest import (
    BACKEND_MODEL, KEY, KEY_ENV, MODEL, auth, chat_body, log_events, wait_for_events, write_settings,
)


async def test_request_id_is_unique_and_the_clients_is_kept_and_echoed(router, engine, logs) -> None:
    """Every request gets its own id (engine legs, logs, X-Request-ID); a client's X-Request-ID is echoed in
    X-Client-Request-ID and logged as client_request_id on its lines, even when two requests send the same one."""
    ids = []
    for _ in range(2):
        response = await router.post("/v1/chat/completions", json=chat_body(), headers={**auth(), "X-Request-ID": "trace-42"})
        assert response.status == 200 and response.headers["X-Client-Request-ID"] == "trace-42"
        ids.append(response.headers["X-Request-ID"])
        assert engine.requests[-1]["request_id"] == ids[-1]
    stream = await router.post("/v1/messages", json=chat_body(stream=True), headers={**auth(), "X-Request-ID": "trace-43"})
    await stream.read()
    assert stream.headers["X-Client-Request-ID"] == "trace-43" and engine.requests[-1]["request_id"] == stream.headers["X-Request-ID"]
    ids.append(stream.headers["X-Request-ID"])
    assert len(set(ids)) == 3 and "trace-42" not in ids
    done = await wait_for_events(logs, "router.request_done", 3)
    assert [e["request_id"] for e in done] == ids
    assert [e["client_request_id"] for e in done] == ["trace-42", "trace-42", "trace-43"]  # on every line of the request


async def test_engine_gets_the_backend_model_and_only_supported_fields(router, engine) -> None:
    """The public model id is mapped to the engine's; ignored extras (tools, user) never reach the engine."""
    body = chat_body(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="auto", user="u1", temperature=0.5)
    response = await router.post("/v1/chat/completions", json=body, headers=auth())
    answer = await response.json()
    sent = engine.requests[-1]["body"]
    assert sent["model"] == BACKEND_MODEL and answer["model"] == MODEL
    assert sent["temperature"] == 0.5 and sent["max_tokens"] == 4
    assert not {"tools", "tool_choice", "user"} & set(sent)


async def test_vllm_ignore_eos_reaches_the_engine(router, engine) -> None:
    """`ignore_eos` (sent by `vllm bench serve` for random datasets) is accepted and forwarded; a non-bool is a 400."""
    response = await router.post("/v1/chat/completions", json=chat_body(ignore_eos=True), headers=auth())
    assert response.status == 200 and engine.requests[-1]["body"]["ignore_eos"] is True
    bad = await router.post("/v1/chat/completions", json=chat_body(ignore_eos="yes"), headers=auth())
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "ignore_eos"


async def test_model_aliases_accept_claude_code_model_names(make_router, engine) -> None:
    """With model_aliases = ["claude-*"], Claude Code's own model names reach the one served model; others stay 404."""
    router = await make_router(taotoken='model_aliases = ["claude-*"]')
    body = {"model": "claude-3-5-haiku-20241022", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    response = await router.post("/v1/messages", json=body, headers=auth())
    assert response.status == 200 and engine.requests[-1]["body"]["model"] == BACKEND_MODEL
    other = await router.post("/v1/messages", json={**body, "model": "gpt-4o"}, headers=auth())
    assert other.status == 404 and (await other.json())["error"]["type"] == "not_found_error"


async def test_usage_chunk_only_when_asked(router, logs) -> None:
    """A raw stream carries the empty-choices usage chunk only with include_usage, and always ends with [DONE]."""
    async def frames(**extra):
        response = await router.post("/v1/chat/completions", json=chat_body(stream=True, **extra), headers=auth())
        return [data async for _, data in sse.read_events(response.content)]

    plain = await frames()
    assert plain[-1] == "[DONE]" and all(json.loads(d)["choices"] for d in plain[:-1])
    with_usage = await frames(stream_options={"include_usage": True})
    assert with_usage[-1] == "[DONE]"
    last = json.loads(with_usage[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    sent = [e for e in log_events(logs) if e["event"] == "router.usage_chunk"]
    assert len(sent) == 1 and sent[0]["client_asked"] is True and sent[0]["completion_tokens"] == 4


async def test_anthropic_stream_has_the_event_sequence_and_no_done(router) -> None:
    """/v1/messages streams message_start … message_stop with matching `event:` names and no [DONE]."""
    response = await router.post("/v1/messages", json=chat_body(stream=True), headers=auth())
    events = [(event, json.loads(data)) async for event, data in sse.read_events(response.content)]
    names = [event for event, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(event == data["type"] for event, data in events)
    assert events[-2][1]["usage"]["output_tokens"] == 4 and events[-2][1]["delta"]["stop_reason"] == "max_tokens"


async def test_client_disconnect_frees_the_slot_and_is_logged(make_router, logs) -> None:
    """A client that leaves mid-stream frees its concurrency slot and is logged as router.client_disconnected; it is
    charged its prompt and the chunks it was sent (leaving before the usage chunk is no way around a quota)."""
    router = await make_router(limits="max_concurrent = 1")
    body = chat_body(stream=True, max_tokens=10, messages=[{"role": "user", "content": "SLOW"}])
    response = await router.post("/v1/chat/completions", json=body, headers=auth())
    await response.content.readline()
    response.close()
    for _ in range(100):  # the router notices on its next write, ~50 ms later (bounded: 2 s)
        if any(e["event"] == "router.client_disconnected" for e in log_events(logs)):
            break
        await asyncio.sleep(0.02)
    done = [e for e in log_events(logs) if e["event"] == "router.request_done"]
    assert done and done[-1]["error"] == "client_disconnected"
    assert done[-1]["prompt_tokens"] > 0 and 1 <= done[-1]["completion_tokens"] < 10
    usage = await (await router.get("/v1/usage", headers=auth())).json()
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (done[-1]["prompt_tokens"], done[-1]["completion_tokens"])
    assert (await router.post("/v1/chat/completions", json=chat_body(), headers=auth())).status == 200


async def test_health_and_metrics(router) -> None:
    """/health reports the router and its backends; /metrics counts requests by API and status."""
    await router.post("/v1/chat/completions", json=chat_body(), headers=auth())
    await router.post("/v1/messages", json={**chat_body(), "model": "nope"}, headers=auth())
    health = await (await router.get("/health")).json()
    assert health["status"] == "ok" and health["mode"] == "colocated" and health["backends"]
    text = await (await router.get("/metrics")).text()
    assert 'pd_router_requests_total{api="chat",status="200"} 1' in text
    assert 'pd_router_requests_total{api="messages",status="404"} 1' in text


async def test_in_band_errors_close_each_stream_in_its_own_shape(router) -> None:
    """After a mid-stream engine failure: OpenAI gets an error frame then [DONE]; Anthropic an `event: error` and nothing after."""
    broken = chat_body(stream=True, max_tokens=8, messages=[{"role": "user", "content": "BREAK"}])
    chat = await router.post("/v1/chat/completions", json=broken, headers=auth())
    frames = [data async for _, data in sse.read_events(chat.content)]
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["error"]["type"] == "upstream_error"
    messages = await router.post("/v1/messages", json=broken, headers=auth())
    events = [(event, json.loads(data)) async for event, data in sse.read_events(messages.content)]
    assert events[-1][0] == "error" and events[-1][1]["type"] == "error"
    assert "message_stop" not in [event for event, _ in events]


async def test_responses_stream_helper_reaches_completed_when_the_engine_stops(router, sdk) -> None:
    """When the engine stops on its own (finish_reason stop), `client.responses.stream` gets response.completed."""
    client = sdk(openai.AsyncOpenAI, base_url=str(router.make_url("/v1")), api_key=KEY)
    async with client.responses.stream(model=MODEL, input="hi", max_output_tokens=10) as stream:  # the stand-in stops at 10
        deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas) and final.usage.output_tokens == 10


async def test_rejected_requests_are_counted_in_metrics(make_router) -> None:
    """401s and 429s show up in pd_router_requests_total, so operators see rejections, not only successes."""
    router = await make_router(limits="rpm = 1")
    await router.post("/v1/chat/completions", json=chat_body())
    await router.post("/v1/chat/completions", json=chat_body(), headers=auth())
    await router.post("/v1/chat/completions", json=chat_body(), headers=auth())
    text = await (await router.get("/metrics")).text()
    for status in (401, 200, 429):
        assert f'pd_router_requests_total{{api="chat",status="{status}"}} 1' in text


async def test_a_generation_request_logs_one_summary_line_not_an_access_line_too(engine, logs, tmp_path) -> None:
    """router.request_done carries the status and duration, so a generation request has no http.access repeat of it;
    other routes (no summary line of their own) keep their access line."""
    app = create_app(router_config.load(write_settings(tmp_path, engine.url), env={}), env={KEY_ENV: KEY})
    server = TestServer(app, host="127.0.0.1")
    await server.start_server(access_log_class=AccessLogger)  # as stack.common.server runs the router
    async with TestClient(server) as router:
        done = await router.post("/v1/chat/completions", json=chat_body(), headers=auth())
        models = await router.get("/v1/models", headers=auth())
        assert done.status == 200 and models.status == 200
        [summary] = await wait_for_events(logs, "router.request_done", 1)
        [access] = await wait_for_events(logs, "http.access", 1)
    assert summary["request_id"] == done.headers["X-Request-ID"] and summary["status"] == 200 and summary["e2e_ms"] > 0
    assert access["path"] == "/v1/models" and access["request_id"] == models.headers["X-Request-ID"]
    assert not [e for e in log_events(logs) if e["event"] == "http.access" and e["request_id"] == summary["request_id"]]


async def test_a_parsed_request_has_one_router_line_before_its_legs_naming_api_model_and_stream(router, logs) -> None:
    """router.scheduled is the request's line before its legs (there is no separate 'received' line): it names the
    client's API, the model it asked for, whether it streams, and how long it waited for its pair (queue_ms)."""
    asked = [("chat", "/v1/chat/completions", chat_body()),
             ("completions", "/v1/completions", {"model": MODEL, "prompt": "Say hello", "max_tokens": 4, "stream": True}),
             ("messages", "/v1/messages", chat_body(stream=True)),
             ("responses", "/v1/responses", {"model": MODEL, "input": "Say hello", "max_output_tokens": 4})]
    ids = []
    for _api, path, body in asked:
        response = await router.post(path, json=body, headers=auth())
        assert response.status == 200, await response.text()
        await response.read()
        ids.append(response.headers["X-Request-ID"])
    await wait_for_events(logs, "router.request_done", len(asked))
    lines = log_events(logs)
    for (api, _path, body), rid in zip(asked, ids):
        mine = [e["event"] for e in lines if e["request_id"] == rid and e["event"].startswith("router.")]
        assert mine[0] == "router.scheduled" and mine.count("router.scheduled") == 1 and mine[-1] == "router.request_done", mine
        assert "router.request_received" not in mine
        [scheduled] = [e for e in lines if e["request_id"] == rid and e["event"] == "router.scheduled"]
        assert (scheduled["api"], scheduled["model"], scheduled["stream"]) == (api, MODEL, bool(body.get("stream")))
        assert 0 <= scheduled["queue_ms"] < 5000 and scheduled["attempt"] == 1
