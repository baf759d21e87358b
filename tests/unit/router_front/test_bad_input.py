"""Bad input gets a precise 4xx in the API's own shape, and the router keeps serving afterwards."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.unit.doctor.helpers import diagnose
from tests.unit.router_front.conftest import KEY, MODEL, auth, chat_body, wait_for_events
from tests.unit.router_front.test_auth import APIS, error_of

ANTHROPIC_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large"}


async def _assert_error(router, api: str, payload: Any, status: int, code: str, words: str, param: str | None = None) -> None:
    path = APIS[api][0]
    kwargs = {"data": payload} if isinstance(payload, (str, bytes)) else {"json": payload}
    response = await router.post(path, headers={**auth(), "Content-Type": "application/json"}, **kwargs)
    assert response.status == status, await response.text()
    error = error_of(api, await response.json())
    assert words in error["message"]
    if api == "messages":
        assert error["type"] == ANTHROPIC_TYPES[status]
    else:
        assert error["code"] == code
        if param is not None:
            assert error["param"] == param
    # ...and the router still answers a good request.
    good = await router.post(path, json=APIS[api][1], headers=auth())
    assert good.status == 200


@pytest.mark.parametrize("api", APIS)
async def test_malformed_json_is_a_400_naming_the_position(router, api: str) -> None:
    """A body that is not JSON gets 400 invalid_json with the parser's line and column."""
    await _assert_error(router, api, '{"model": "x", ', 400, "invalid_json", "not valid JSON")


@pytest.mark.parametrize("api", APIS)
async def test_non_object_body_is_a_400(router, api: str) -> None:
    """A JSON array (or any non-object) body gets 400 saying an object is needed."""
    await _assert_error(router, api, "[1, 2]", 400, "invalid_json", "must be a JSON object, got a JSON array")


@pytest.mark.parametrize("api", APIS)
async def test_huge_body_is_a_413(router, api: str) -> None:
    """A body over max_body_bytes (64 KiB in the test settings) gets 413 naming the limit."""
    body = {**APIS[api][1], "padding": "x" * 70_000}
    await _assert_error(router, api, json.dumps(body), 413, "request_too_large", "65536")


@pytest.mark.parametrize("api", APIS)
async def test_unknown_model_is_a_404_naming_the_served_model(router, api: str) -> None:
    """An unknown model gets 404 model_not_found that says which model this router serves."""
    body = {**APIS[api][1], "model": "gpt-imaginary"}
    await _assert_error(router, api, body, 404, "model_not_found", f"'gpt-imaginary' does not exist on this router; it serves '{MODEL}'", "model")


WRONG_TYPES = [
    ("chat", {"max_tokens": "ten"}, "invalid_type", "max_tokens", "expected an integer, got a string"),
    ("chat", {"messages": "hello"}, "invalid_type", "messages", "expected an array"),
    ("chat", {"stream": "yes"}, "invalid_type", "stream", "expected true or false"),
    ("chat", {"temperature": 7}, "invalid_value", "temperature", "between 0 and 2"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "invalid_value", "messages[0].role", "expected one of"),
    ("chat", {"model": None}, "missing_required_parameter", "model", "Missing required parameter"),
    ("completions", {"prompt": 42}, "invalid_type", "prompt", "expected a string, an array of token ids"),
    ("completions", {"prompt": ["a", "b"]}, "unsupported_parameter", "prompt", "send one prompt per request"),
    ("completions", {"max_tokens": 0}, "invalid_value", "max_tokens", "must be >= 1"),
    ("responses", {"input": 5}, "invalid_type", "input", "expected a string or a non-empty array"),
    ("responses", {"max_output_tokens": 1.5}, "invalid_type", "max_output_tokens", "expected an integer"),
    ("responses", {"max_output_tokens": 0}, "invalid_value", "max_output_tokens", "Invalid value for 'max_output_tokens': must be >= 1"),
    ("messages", {"max_tokens": None}, "missing_required_parameter", "max_tokens", "Missing required parameter: 'max_tokens'"),
    ("messages", {"stop_sequences": [""]}, "invalid_value", "stop_sequences", "Invalid value for 'stop_sequences'"),
    ("messages", {"messages": [{"role": "tool", "content": "x"}]}, "invalid_value", "messages[0].role", "expected 'user', 'assistant' or 'system'"),
    ("messages", {"messages": [{"role": "system", "content": "x"}]}, "invalid_value", "messages", "at least one user or assistant message"),
]


@pytest.mark.parametrize(("api", "change", "code", "param", "words"), WRONG_TYPES)
async def test_wrong_types_and_values_are_a_400_naming_the_field(router, api, change, code, param, words) -> None:
    """A field of the wrong type or out of range gets 400 that names the field and what was expected."""
    body = {k: v for k, v in {**APIS[api][1], **change}.items() if v is not None}
    await _assert_error(router, api, body, 400, code, words, param)


UNSUPPORTED = [
    ("chat", {"n": 2}, "n", "must be 1"),
    ("chat", {"logprobs": True}, "logprobs", "not supported"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "never calls tools"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "(type 'image_url'): only input_text, text parts"),
    ("chat", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages[0].role", "no tool calling"),
    ("chat", {"top_k": 5}, "top_k", "not supported"),
    ("completions", {"echo": True}, "echo", "not supported"),
    ("completions", {"logprobs": 1}, "logprobs", "not supported"),
    ("responses", {"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ("responses", {"tool_choice": {"type": "function", "name": "f"}}, "tool_choice", "never calls tools"),
    ("responses", {"tool_choice": {"type": "web_search"}}, "tool_choice", "runs no hosted tools"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "(type 'input_image'): only input_text, output_text, text parts"),
    ("responses", {"input": [{"role": []}]}, "input[0]", "only message, function_call"),  # found by the fuzz tier (a 500)
    ("responses", {"input": [{"role": "user", "content": [{"type": []}]}]}, "input[0].content[0]", "only input_text"),  # fuzz: a 500
    ("messages", {"messages": [{"role": "user", "content": [{"type": []}]}]}, "messages[0].content[0]", "only text and tool_result"),
    ("messages", {"tool_choice": {"type": "any"}}, "tool_choice", "never calls tools"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]", "only text and tool_result"),
]


@pytest.mark.parametrize(("api", "change", "param", "words"), UNSUPPORTED)
async def test_unsupported_parameters_are_a_400_not_silently_ignored(router, api, change, param, words) -> None:
    """A parameter this deployment cannot honour gets 400 unsupported_* naming it."""
    response = await router.post(APIS[api][0], json={**APIS[api][1], **change}, headers=auth())
    assert response.status == 400
    error = error_of(api, await response.json())
    assert words in error["message"]
    if api != "messages":
        assert error["param"] == param and error["code"].startswith("unsupported")


async def test_unknown_chat_parameter_is_named(router) -> None:
    """OpenAI rejects unknown arguments; so does the router, naming the argument."""
    response = await router.post("/v1/chat/completions", json=chat_body(frobnicate=1), headers=auth())
    error = (await response.json())["error"]
    assert response.status == 400 and error["code"] == "unknown_parameter" and error["param"] == "frobnicate"


async def test_claude_code_extras_are_accepted(router) -> None:
    """Fields Claude Code always sends (tools, metadata, thinking, system blocks) do not break /v1/messages."""
    body = {"model": MODEL, "max_tokens": 4, "system": [{"type": "text", "text": "be brief"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "ok"}, {"type": "thinking", "thinking": "hm",
                                                                                                   "signature": "s"}]},
                         {"role": "user", "content": [{"type": "text", "text": "go", "cache_control": {"type": "ephemeral"}}]}],
            "tools": [{"name": "Bash", "input_schema": {"type": "object"}}], "metadata": {"user_id": "u"},
            "thinking": {"type": "disabled"}, "tool_choice": {"type": "auto"}}
    response = await router.post("/v1/messages", json=body, headers={"x-api-key": KEY,
                                                                     "anthropic-version": "2023-06-01",
                                                                     "anthropic-beta": "prompt-caching-2024-07-31"})
    assert response.status == 200, await response.text()


async def test_tool_history_is_refused_by_a_backend_without_tools(router) -> None:
    """A tool_result for a backend that declares no tool calling is a 400 naming the block (never silently dropped)."""
    body = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "done"}]}]}
    response = await router.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    error = (await response.json())["error"]
    assert response.status == 400 and "messages[1].content[0]" in error["message"] and "no tool calling" in error["message"]


async def test_unknown_route_and_wrong_method_answer_in_shape(router) -> None:
    """An unknown path is a 404 and a wrong method a 405, both JSON errors (never a plain-text page)."""
    missing = await router.get("/v1/nothing-here", headers=auth())
    assert missing.status == 404 and "error" in await missing.json()
    wrong = await router.get("/v1/messages", headers=auth())
    body = await wrong.json()
    assert wrong.status == 405 and body["type"] == "error"



async def _diagnose_after(logs, client, tmp_path, sent: dict[str, str], *engine_logs) -> dict[str, Any]:
    """Send each body (X-Request-ID client-<name>; each refused 400), then one good request, and diagnose the router's
    lines with the engine's: the findings that are not ok, by id."""
    for name, body in sent.items():
        response = await client.post("/v1/chat/completions", data=body, headers={
            **auth(), "Content-Type": "application/json", "X-Request-ID": f"client-{name}"})
        assert response.status == 400, await response.text()
    assert (await client.post("/v1/chat/completions", json=chat_body(), headers=auth())).status == 200
    await wait_for_events(logs, "router.request_done", 1)
    path = tmp_path / "router.log"
    path.write_text(logs.getvalue())
    findings, _ = diagnose(path, *engine_logs)
    return {f.id: f for f in findings if f.severity != "ok"}


async def test_the_doctor_names_what_the_client_sent_wrong(logs, make_router, real_engine, tmp_path) -> None:
    """Bad bodies through the router to our engine are diagnosed as the client's request, by code and field, as a
    warning (a request went through: the stack works), and nothing else is reported."""
    router = await make_router(backend=real_engine)
    found = await _diagnose_after(logs, router, tmp_path, {
        "nan": '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}' % MODEL,
        "type": json.dumps(chat_body(max_tokens="ten")),
        "unknown": json.dumps(chat_body(frobnicate=1))}, real_engine.log_path)
    assert set(found) == {"client_request.refused"}, found
    refused = found["client_request.refused"]
    assert refused.severity == "warning"
    for kind in ("invalid_json ×1", "invalid_type (max_tokens) ×1", "unknown_parameter (frobnicate) ×1"):
        assert kind in refused.title, refused.title
    assert {"client-nan", "client-type", "client-unknown"} <= set(refused.request_ids)
    assert "NaN" in refused.fix and "max_tokens, frobnicate" in refused.fix


async def test_an_engines_refusal_is_told_apart_with_its_words(logs, router, tmp_path) -> None:
    """A 400 only the engine made (the router's checks let the body through) is its own finding, with the engine's
    body from router.upstream_error; not an unexplained failure, not the router's refusal."""
    found = await _diagnose_after(logs, router, tmp_path, {
        "engine": json.dumps(chat_body(messages=[{"role": "user", "content": "REFUSE"}]))})
    engine = found["client_request.engine_refused"]
    assert "client-engine" in engine.request_ids and "(seed) ×1" in engine.title
    assert any("router.upstream_error" in e.line and "stand-in" in e.line for e in engine.evidence)
    assert not {"client_request.refused", "request.unexplained"} & set(found)
