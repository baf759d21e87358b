"""Issue 12 in the PD flow, against fake engines: every wait has a bound, a broken decode is re-picked at once,
and a recovered backend is re-admitted within one health interval."""

from __future__ import annotations

import asyncio
import time

import pytest

from stack.common import events
from stack.common.errors import UpstreamError, UpstreamTimeout
from stack.router.deadlines import worst_case_s
from stack.router.scheduler import SchedulerConfig
from tests.unit.router_pd.conftest import batches, backend, until, wait_for_state, typed
from tests.unit.router_pd.fake_engine import Faults

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def test_a_kv_push_that_fails_re_picks_the_pair_and_never_retries_prefill_on_that_decode(fake, pd, logs):
    """Prefill cannot push KV to decode A (502 kv_connect_failed): the next attempt is a new pair on decode B, no
    prefill leg goes to A again, A's breaker counts the failure; the client gets its answer."""
    prefill = await fake("prefill", faults=Faults(kv_push_failed=1))
    dead, alive = await fake("decode"), await fake("decode")
    client = await pd([prefill], [dead, alive], policy="round_robin", health_interval_ms=60_000)
    answer = await client.complete("kv1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert answer["usage"]["completion_tokens"] == 4
    pairs = [e["decode"] for e in logs.events(events.ROUTER_SCHEDULED)]
    assert pairs == [dead.url, alive.url] and len(prefill.seen) == 2  # one prefill leg per decode: A once, then B
    assert dead.seen == [] and len(alive.seen) == 1
    assert backend(client, dead.url).breaker.failures == 1  # not marked down: the router's own path to it may be fine
    [failed] = logs.events(events.ROUTER_PREFILL_FAILED)
    # One line for the hop: the decode it blames, and that the request went on (a new pair, not this prefill again).
    assert failed["decode"] == dead.url and failed["code"] == "kv_connect_failed" and failed["retried"] is True
    assert "decode_kv_addr" in failed["error"] and logs.events(events.ROUTER_DECODE_FAILED) == []
    assert backend(client, prefill.url).breaker.state == "closed"  # the prefill did its part


async def test_a_kv_push_that_fails_with_one_decode_is_an_explicit_502_fast(fake, pd):
    """Only one decode and the push to it fails: an explicit 502 naming the KV address, without retrying prefill."""
    prefill = await fake("prefill", faults=Faults(kv_push_failed=5))
    decode = await fake("decode")
    client = await pd([prefill], [decode], health_interval_ms=60_000)
    started = time.monotonic()
    with pytest.raises(UpstreamError, match="decode_kv_addr"):
        await client.complete("kv2", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert time.monotonic() - started < 5.0  # upper bound: catches a retry loop or a hang
    assert len(prefill.seen) == 1 and decode.seen == []
    assert all(b.in_flight == 0 for b in client.fleet.scheduler.backends)


async def test_the_request_deadline_bounds_everything_before_the_answer(fake, pd, logs):
    """A decode that takes longer than deadline_ms: 504 deadline_exceeded with Retry-After, all slots given back."""
    decode = await fake("decode", faults=Faults(delay_s=3.0))
    client = await pd([await fake("prefill")], [decode], deadline_ms=300, max_retries=0)
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout) as caught:
        await client.complete("dl", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    # Lower bound: the deadline really waited; upper bound (2.5 s) proves it cut the 3 s decode short.
    assert 0.25 <= time.monotonic() - started < 2.5
    assert caught.value.code == "deadline_exceeded" and caught.value.headers["Retry-After"] == "1"
    # deadline_ms plus the 5-character prompt's prefill work: 5 / 250 tokens/s × (1 + 5 / 6144) ≈ 20 ms.
    assert logs.events(events.ROUTER_DEADLINE_EXCEEDED)[0]["deadline_ms"] == 320
    await until(lambda: all(b.in_flight == 0 for b in client.fleet.scheduler.backends), "slots released")


async def test_a_streamed_request_gets_its_first_byte_within_the_deadline_or_an_error(fake, pd):
    """Streams too: nothing before the first chunk may outlast deadline_ms."""
    decode = await fake("decode", faults=Faults(delay_s=3.0))
    client = await pd([await fake("prefill")], [decode], deadline_ms=300, max_retries=0)
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout):
        async for _ in batches(client, "dls", "chat", "/v1/chat/completions", *typed(dict(CHAT, stream=True))):
            pass
    assert 0.25 <= time.monotonic() - started < 2.5


async def test_an_open_circuit_goes_half_open_as_soon_as_health_says_serving(fake, pd, logs):
    """The breaker's cool-down is long (60 s), but a SERVING probe lets the trial request through within one interval."""
    prefill = await fake("prefill")
    decode = await fake("decode", faults=Faults(http_500=2))
    client = await pd([prefill], [decode], breaker_failures=2, breaker_cooldown_ms=60_000, max_retries=0, health_interval_ms=100)
    for _ in range(2):
        with pytest.raises(UpstreamError):
            await client.complete("hb", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert backend(client, decode.url).breaker.state in ("open", "half_open")
    await until(lambda: backend(client, decode.url).breaker.state == "half_open", "half-open after a SERVING probe", 5.0)
    assert (await client.complete("hb", "chat", "/v1/chat/completions", *typed(dict(CHAT))))["usage"]["completion_tokens"] == 4
    assert backend(client, decode.url).breaker.state == "closed"


async def test_a_refused_connection_marks_the_backend_down_at_once_and_re_picks(fake, pd):
    """A decode whose port refuses connections is down after one request (not after breaker_failures); the request is
    answered by the other decode."""
    prefill = await fake("prefill")
    gone, alive = await fake("decode"), await fake("decode")
    client = await pd([prefill], [gone, alive], policy="round_robin", health_interval_ms=60_000)
    await gone.stop()
    for i in range(2):
        assert (await client.complete(f"rf{i}", "chat", "/v1/chat/completions", *typed(dict(CHAT))))["usage"]["completion_tokens"] == 4
    assert not backend(client, gone.url).up and len(alive.seen) == 2


def test_the_worst_case_is_computed_from_the_settings_and_shown_on_health() -> None:
    """Defaults, window not known yet: the deadline (120 s) bounds the first byte; a stream adds request_timeout_ms (600 s)."""
    bounds = worst_case_s(SchedulerConfig(), None)
    assert bounds["first_byte_s"] == 120 and bounds["non_streamed_s"] == 120 and bounds["stream_s"] == 720
    assert bounds["stream_silence_s"] == 30 and bounds["queue_wait_s"] == 10
    # Without the deadline's cap the legs' own sum is the bound: 1 attempt, 1 prefill try.
    small = SchedulerConfig(max_retries=0, queue_timeout_ms=1000, prefill_timeout_ms=2000, kv_transfer_timeout_ms=500,
                            first_token_timeout_ms=1000, deadline_ms=600_000)
    assert worst_case_s(small, None)["first_byte_s"] == 1 + (1 + 2) + 0.5 + 1


async def test_health_snapshot_reports_the_bounds(fake, pd):
    client = await pd([await fake("prefill")], [await fake("decode")])
    assert client.health_snapshot()["worst_case_s"]["first_byte_s"] == 120
