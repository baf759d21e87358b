"""The unified key: each way of getting it wrong has its own 401 in each API's shape, and no key leaks."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from stack.common.config import ConfigError
from tests.unit.router_front.conftest import KEY, KEY_ENV, MODEL, auth, chat_body, log_events

WRONG_KEY = "wrong-but-plausible-key-0042"
APIS = {
    "chat": ("/v1/chat/completions", chat_body()),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    "responses": ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2}),
    "messages": ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
}
# header sent → (auth.rejected reason, error code, words the message must contain)
CASES: dict[str, tuple[dict[str, str], str, str, str]] = {
    "missing": ({}, "missing", "missing_api_key", "Missing API key"),
    "no_bearer": ({"Authorization": KEY}, "malformed", "invalid_authorization_header", "`Bearer ` prefix is missing"),
    "double_space": ({"Authorization": f"Bearer  {KEY}"}, "whitespace", "invalid_api_key_format", "spaces, tabs or line breaks"),
    "inner_tab": ({"x-api-key": f"{KEY[:6]}\t{KEY[6:]}"}, "whitespace", "invalid_api_key_format", "spaces, tabs or line breaks"),
    "basic_scheme": ({"Authorization": f"Basic {KEY}"}, "malformed", "invalid_authorization_header", "Unsupported Authorization scheme 'Basic'"),
    "key_with_space": ({"Authorization": f"{KEY[:8]} {KEY[8:]}"}, "malformed", "invalid_authorization_header", "`Bearer ` prefix is missing"),
    "bearer_in_x_api_key": ({"x-api-key": f"Bearer {KEY}"}, "malformed", "invalid_api_key_format", "without `Bearer `"),
    "quoted": ({"Authorization": f'Bearer "{KEY}"'}, "quoted", "invalid_api_key_format", "wrapped in quotes"),
    "unknown": ({"Authorization": f"Bearer {WRONG_KEY}"}, "unknown", "invalid_api_key", "matches no key configured"),
    "unknown_x_api_key": ({"x-api-key": WRONG_KEY}, "unknown", "invalid_api_key", "matches no key configured"),
    # An empty second header must not hide (or crash on) the first one's problem.
    "no_bearer_and_empty_x_api_key": ({"Authorization": KEY, "x-api-key": ""}, "malformed", "invalid_authorization_header",
                                      "`Bearer ` prefix is missing"),
}


def error_of(api: str, body: dict[str, Any]) -> dict[str, Any]:
    """The error object of a body in the API's own shape (and check that shape)."""
    if api == "messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def assert_no_key_material(text: str) -> None:
    for secret in (KEY, WRONG_KEY):
        assert secret not in text
        assert hashlib.sha256(secret.encode()).hexdigest() not in text


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("case", CASES)
async def test_each_auth_failure_has_its_own_401(router, logs, api: str, case: str) -> None:
    """Every kind of bad key gets a 401 with its precise message in the API's shape, logged with its reason."""
    headers, reason, code, words = CASES[case]
    path, body = APIS[api]
    response = await router.post(path, json=body, headers=headers)
    text = await response.text()
    assert response.status == 401
    error = error_of(api, await response.json())
    assert words in error["message"]
    if api == "messages":
        assert error["type"] == "authentication_error"
    else:
        assert error["code"] == code
    rejected = [e for e in log_events(logs) if e["event"] == "auth.rejected"]
    assert [e["reason"] for e in rejected] == [reason]
    assert_no_key_material(text)
    assert_no_key_material(logs.getvalue())


@pytest.mark.parametrize("api", APIS)
async def test_router_without_key_rejects_everything_naming_the_env_var(make_router, logs, api: str) -> None:
    """With the key env var unset, every request gets a 401 naming the variable, and start-up logs auth.key_missing."""
    router = await make_router(env={})
    path, body = APIS[api]
    response = await router.post(path, json=body, headers=auth())
    assert response.status == 401
    error = error_of(api, await response.json())
    assert "no API key configured" in error["message"] and KEY_ENV in error["message"]
    found = log_events(logs)
    assert any(e["event"] == "auth.key_missing" and e["env_var"] == KEY_ENV for e in found)
    assert [e["reason"] for e in found if e["event"] == "auth.rejected"] == ["no_keys_configured"]
    assert_no_key_material(logs.getvalue())


@pytest.mark.parametrize("header", [{"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {"Authorization": f"bearer {KEY}"}])
@pytest.mark.parametrize("api", APIS)
async def test_valid_key_is_accepted_from_either_header(router, logs, api: str, header: dict[str, str]) -> None:
    """The unified key works as `Authorization: Bearer` or `x-api-key` on every API, and the key is never logged."""
    path, body = APIS[api]
    response = await router.post(path, json=body, headers=header)
    assert response.status == 200, await response.text()
    accepted = [e for e in log_events(logs) if e["event"] == "auth.accepted"]
    assert [e["key_name"] for e in accepted] == ["default"]
    assert_no_key_material(logs.getvalue())


async def test_a_bad_header_does_not_hide_a_good_one(router) -> None:
    """Claude Code's key helper sends both headers: one valid key among them is enough."""
    response = await router.post("/v1/messages", json=APIS["messages"][1],
                                 headers={"Authorization": f"Bearer {WRONG_KEY}", "x-api-key": KEY})
    assert response.status == 200


async def test_models_and_usage_need_the_key_but_health_does_not(router) -> None:
    """/v1/models and /v1/usage are authenticated; /health and /metrics are open for probes and scrapers."""
    assert (await router.get("/v1/models")).status == 401
    assert (await router.get("/v1/usage")).status == 401
    assert (await router.get("/v1/models", headers=auth())).status == 200
    assert (await router.get("/health")).status == 200
    assert (await router.get("/metrics")).status == 200


async def test_claude_codes_connection_probe_is_answered_without_a_key_or_a_warning(router, logs) -> None:
    """Claude Code sends HEAD /api/hello when it starts and before subagents: 200 as Anthropic's API answers it, never a
    404 warning (which the doctor would count as a failed request)."""
    assert (await router.head("/api/hello")).status == 200
    response = await router.get("/api/hello")
    assert response.status == 200 and await response.json() == {"status": "ok"}
    assert not [e for e in log_events(logs) if e["level"] in ("WARNING", "ERROR")]


async def test_keys_file_adds_named_keys_from_their_env_vars(make_router, tmp_path) -> None:
    """A keys-file entry names an env var; its key authenticates under the entry's name and limits."""
    (tmp_path / "keys.toml").write_text('[[keys]]\nname = "alice"\nenv = "ALICE_KEY"\nrpm = 7\n')
    router = await make_router(extra='[auth]\nkeys_file = "keys.toml"', env={KEY_ENV: KEY, "ALICE_KEY": "alice-secret-value-99"})
    usage = await (await router.get("/v1/usage", headers=auth("alice-secret-value-99"))).json()
    assert usage["key_name"] == "alice" and usage["limits"]["rpm"] == 7
    default = await (await router.get("/v1/usage", headers=auth())).json()
    assert default["key_name"] == "default" and default["limits"]["rpm"] == 0


async def test_same_key_under_two_names_stops_start_up(make_router, tmp_path) -> None:
    """Two env vars holding one key would make usage ambiguous: start-up fails naming the variable, not the key."""
    (tmp_path / "keys.toml").write_text('[[keys]]\nname = "alice"\nenv = "ALICE_KEY"\n')
    with pytest.raises(ConfigError, match="ALICE_KEY: holds the same key as the one for 'default'") as caught:
        await make_router(extra='[auth]\nkeys_file = "keys.toml"', env={KEY_ENV: KEY, "ALICE_KEY": KEY})
    assert KEY not in str(caught.value)
