"""Usage per key lives in SQLite: it is reported at /v1/usage and survives a router restart, quota included."""

from __future__ import annotations

from tests.unit.router_front.conftest import auth, chat_body


async def test_usage_counts_requests_and_tokens_per_key(router) -> None:
    """GET /v1/usage returns the caller's requests and the prompt/completion tokens the engine reported."""
    first = await (await router.post("/v1/chat/completions", json=chat_body(), headers=auth())).json()
    await (await router.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth())).read()
    usage = await (await router.get("/v1/usage", headers=auth())).json()
    assert usage["key_name"] == "default" and usage["requests"] == 2
    assert usage["prompt_tokens"] == 2 * first["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == 2 * first["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_stream_without_include_usage_is_still_charged(router) -> None:
    """A stream whose client did not ask for usage is charged anyway (the router asks the engine for it)."""
    await (await router.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth())).read()
    usage = await (await router.get("/v1/usage", headers=auth())).json()
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] > 0


async def test_usage_and_quota_survive_a_restart(make_router) -> None:
    """A new router on the same SQLite file keeps each key's totals, so an exhausted quota stays exhausted."""
    first = await make_router(limits="token_quota = 20")
    assert (await first.post("/v1/chat/completions", json=chat_body(), headers=auth())).status == 200
    before = await (await first.get("/v1/usage", headers=auth())).json()
    await first.close()

    second = await make_router(limits="token_quota = 20")
    after = await (await second.get("/v1/usage", headers=auth())).json()
    assert {k: after[k] for k in ("requests", "prompt_tokens", "completion_tokens")} == \
        {k: before[k] for k in ("requests", "prompt_tokens", "completion_tokens")}
    assert (await second.post("/v1/chat/completions", json=chat_body(), headers=auth())).status == 200
    assert (await second.post("/v1/chat/completions", json=chat_body(), headers=auth())).status == 429
    await second.close()

    third = await make_router(limits="token_quota = 20")
    response = await third.post("/v1/chat/completions", json=chat_body(), headers=auth())
    assert response.status == 429 and (await response.json())["error"]["type"] == "insufficient_quota"
    assert (await (await third.get("/v1/usage", headers=auth())).json())["quota_remaining"] == 0
