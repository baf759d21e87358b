"""Per-key limits: rpm, tpm, concurrency and quota each give a 429 that says which, and when to retry."""

from __future__ import annotations

import asyncio

import pytest

from stack.common.errors import QuotaExhausted, RateLimited
from stack.router.auth import Caller
from stack.router.config import KeyLimits
from stack.router.limits import Limiter, MemoryCounters
from stack.router.usage import UsageStore
from tests.unit.router_front.conftest import MODEL, auth, chat_body, log_events

MESSAGES = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


async def _chat(router, **extra):
    return await router.post("/v1/chat/completions", json=chat_body(**extra), headers=auth())


async def test_rpm_limit_gives_rate_limit_exceeded_with_retry_after(make_router, logs) -> None:
    """The request over `rpm` gets 429 rate_limit_exceeded (code rpm_limit_exceeded) and a Retry-After within the minute."""
    router = await make_router(limits="rpm = 2")
    assert [(await _chat(router)).status for _ in range(2)] == [200, 200]
    response = await _chat(router)
    assert response.status == 429
    error = (await response.json())["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "rpm_limit_exceeded")
    assert 1 <= int(response.headers["Retry-After"]) <= 60
    assert any(e["event"] == "limit.rate_limited" and e["limit"] == "rpm" for e in log_events(logs))


async def test_rate_limit_on_messages_is_anthropic_shaped(make_router) -> None:
    """On /v1/messages the same 429 is {"type":"error","error":{"type":"rate_limit_error"}} with Retry-After."""
    router = await make_router(limits="rpm = 1")
    assert (await router.post("/v1/messages", json=MESSAGES, headers=auth())).status == 200
    response = await router.post("/v1/messages", json=MESSAGES, headers=auth())
    assert response.status == 429
    body = await response.json()
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert "Retry-After" in response.headers


async def test_tpm_limit_counts_tokens_used(make_router) -> None:
    """After a request uses more than `tpm` tokens, the next one gets 429 tpm_limit_exceeded with Retry-After."""
    router = await make_router(limits="tpm = 10")
    first = await _chat(router)
    assert first.status == 200 and (await first.json())["usage"]["total_tokens"] > 10
    response = await _chat(router)
    assert response.status == 429
    error = (await response.json())["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "tpm_limit_exceeded")
    assert 1 <= int(response.headers["Retry-After"]) <= 60


async def test_concurrency_limit_rejects_while_a_request_is_in_flight(make_router, engine) -> None:
    """With max_concurrent = 1, a second request during the first gets 429 concurrency_limit_exceeded; after it, requests pass."""
    router = await make_router(limits="max_concurrent = 1")
    held = asyncio.create_task(_chat(router, messages=[{"role": "user", "content": "HOLD"}]))
    for _ in range(200):  # wait until the held request reached the engine (bounded: 2 s)
        if engine.requests:
            break
        await asyncio.sleep(0.01)
    response = await _chat(router)
    assert response.status == 429
    error = (await response.json())["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "concurrency_limit_exceeded")
    assert response.headers["Retry-After"] == "1"
    engine.release.set()
    assert (await held).status == 200
    assert (await _chat(router)).status == 200


async def test_quota_exhausted_is_insufficient_quota_not_retryable(make_router, logs) -> None:
    """Past token_quota the 429 has type insufficient_quota and x-should-retry: false (waiting will not help)."""
    router = await make_router(limits="token_quota = 10")
    assert (await _chat(router)).status == 200
    response = await _chat(router)
    assert response.status == 429
    error = (await response.json())["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert "quota exhausted" in error["message"].lower()
    assert response.headers["x-should-retry"] == "false" and "Retry-After" not in response.headers
    assert any(e["event"] == "limit.quota_exhausted" for e in log_events(logs))
    anthropic = await router.post("/v1/messages", json=MESSAGES, headers=auth())
    body = await anthropic.json()
    assert anthropic.status == 429 and body["error"]["type"] == "rate_limit_error" and "quota" in body["error"]["message"]


async def test_rpm_window_slides_and_retry_after_counts_down(tmp_path) -> None:
    """The rpm window is a sliding minute: Retry-After is when the oldest request leaves it, and then one is admitted."""
    now = [1000.0]
    usage = UsageStore(tmp_path / "u.sqlite3")
    limiter = Limiter(usage, MemoryCounters(usage, clock=lambda: now[0]))
    caller = Caller("k", KeyLimits(rpm=2))
    await limiter.admit(caller)
    now[0] += 10
    await limiter.admit(caller)
    now[0] += 20  # 30 s after the first request
    with pytest.raises(RateLimited) as caught:
        await limiter.admit(caller)
    assert caught.value.headers["Retry-After"] == "30"
    now[0] += 30  # the first request leaves the window
    await limiter.admit(caller)


async def test_quota_counts_usage_from_the_store(tmp_path) -> None:
    """The quota is checked against the persistent totals, prompt plus completion tokens."""
    store = UsageStore(tmp_path / "u.sqlite3")
    store.add("k", 6, 3)
    limiter = Limiter(store)
    await limiter.admit(Caller("k", KeyLimits(token_quota=10)))
    with pytest.raises(QuotaExhausted):
        await limiter.admit(Caller("k", KeyLimits(token_quota=9)))
