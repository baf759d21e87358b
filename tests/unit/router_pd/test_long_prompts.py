"""Long prompts through PD: leg budgets that follow the prompt, decodes without room for its KV, abandoned legs.

The fake engine plays the engine's side of the contract: a prefill leg that answers 503 `decode_kv_capacity` when the
decode cannot hold the KV, a prefill that computes for a while, and a count of the requests whose caller (the router)
closed the connection before the answer.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from stack.common import events
from stack.common.errors import Overloaded, UpstreamError, UpstreamTimeout
from stack.router import config as router_config
from stack.router.app import create_app
from stack.router.deadlines import budgets, within, work_s, worst_case_s
from stack.router.scheduler import SchedulerConfig
from tests.unit.router_pd.conftest import batches, INTERNAL_KEY, backend, router_settings, typed, until
from tests.unit.router_pd.fake_engine import Faults

KEY = "pd-test-key-0123456789abcdefghij"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
# Leg budgets small enough to watch: 300 ms for a short prompt, plus 1 s per 1000 characters (no quadratic term).
TIGHT = {"prefill_timeout_ms": 300, "deadline_ms": 300, "prefill_tokens_per_s": 1000, "prefill_attention_tokens": 0}


def chat(chars: int) -> dict:
    return {**CHAT, "messages": [{"role": "user", "content": "x" * chars}]}


def test_budgets_grow_with_the_prompt_and_stop_at_the_window() -> None:
    """The prefill leg and the deadline get work_s(T) more for T characters (linear + attention's T²), capped at the window."""
    config = SchedulerConfig(prefill_tokens_per_s=250, prefill_attention_tokens=6144)
    short, long = budgets(config, 5, 65536), budgets(config, 60_000, 65536)
    assert short.prefill_s == pytest.approx(60 + 5 / 250 * (1 + 5 / 6144))
    assert long.prefill_s == pytest.approx(60 + 240 * (1 + 60_000 / 6144)) and long.deadline_s == pytest.approx(120 + 240 * (1 + 60_000 / 6144))
    assert long.first_chunk_s == 35 and long.first_chunk_alone_s == pytest.approx(35 + work_s(config, 60_000))  # decode computes it itself
    assert budgets(config, 10**6, 65536) == budgets(config, 65536, 65536)  # a prompt over the window: the window's budget
    # A 60k-token prompt on the default stack gets more than the ~30 min a loaded 2-core host needs for dummy:small.
    assert long.prefill_s > 30 * 60


def test_the_worst_case_is_the_window_s() -> None:
    """GET /health's worst case is a prompt that fills the window: its prefill and deadline include work_s(window)."""
    bounds = worst_case_s(SchedulerConfig(), 32768)
    assert bounds["window_tokens"] == 32768
    assert bounds["prefill_s"] == pytest.approx(60 + work_s(SchedulerConfig(), 32768), abs=0.1)
    assert bounds["first_byte_s"] == pytest.approx(120 + work_s(SchedulerConfig(), 32768), abs=0.1)
    assert bounds["stream_s"] == pytest.approx(bounds["first_byte_s"] + 600, abs=0.1)


async def test_within_ends_a_block_that_outlasts_its_time_with_timeout_error() -> None:
    """within(s) is asyncio.timeout(s): the block is cancelled when the time is up and that leaves it as TimeoutError;
    the task itself is not left cancelled."""
    with pytest.raises(TimeoutError):
        with within(0.05):
            await asyncio.Event().wait()  # never set
    assert asyncio.current_task().cancelling() == 0
    assert await asyncio.sleep(0, "still runs") == "still runs"  # a cancellation left pending would raise here


async def test_within_leaves_a_block_that_ends_in_time_alone() -> None:
    """A block that ends in time is not cancelled later, when its time would have been up."""
    with within(0.05):
        await asyncio.sleep(0)
    await asyncio.sleep(0.15)  # past the time: a timer left running would cancel this await
    assert asyncio.current_task().cancelling() == 0


async def test_within_keeps_a_cancellation_from_elsewhere_a_cancellation() -> None:
    """A client that leaves cancels the handler: inside within() that stays CancelledError, not a timeout."""
    entered = asyncio.Event()

    async def block() -> None:
        with within(30):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(block())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_inner_within_that_expires_leaves_the_outer_one_running() -> None:
    """The first chunk's budget inside the request's deadline: the inner one's TimeoutError is the inner block's."""
    with within(30):
        with pytest.raises(TimeoutError):
            with within(0.05):
                await asyncio.Event().wait()
        await asyncio.sleep(0)  # the outer block goes on
    assert asyncio.current_task().cancelling() == 0


async def test_within_outside_a_task_says_so() -> None:
    """In a loop's callback there is no task to cancel."""
    raised = asyncio.get_running_loop().create_future()

    def callback() -> None:
        try:
            with within(1):
                pass
        except RuntimeError as exc:
            raised.set_result(str(exc))

    asyncio.get_running_loop().call_soon(callback)
    assert "inside one" in await raised


async def test_health_and_the_start_line_report_the_worst_case_at_the_engines_window(fake, pd, logs):
    """The window the decodes report on /v1/models sizes the worst case in GET /health and in router.bounds."""
    client = await pd([await fake("prefill")], [await fake("decode", max_model_len=32768)])
    reported = client.health_snapshot()["worst_case_s"]
    assert reported == worst_case_s(client.settings, 32768) and reported["window_tokens"] == 32768
    assert logs.events(events.ROUTER_BOUNDS)[-1]["worst_case_s"] == reported


async def test_a_long_prefill_is_not_cut_by_a_short_prompts_budget(fake, pd):
    """A prefill of 0.8 s: a 1000-character prompt's budget (0.3 + 1 s) lets it finish; a short prompt's (0.3 s) does
    not, and its leg is closed."""
    prefill = await fake("prefill", faults=Faults(prefill_delay_s=0.8))
    client = await pd([prefill], [await fake("decode")], max_retries=0, **TIGHT)
    answer = await client.complete("long", "chat", "/v1/chat/completions", *typed(chat(1000)))
    assert answer["usage"]["completion_tokens"] == 4
    with pytest.raises(UpstreamTimeout):
        await client.complete("short", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    await until(lambda: prefill.disconnects == 1, "the timed-out prefill saw the router hang up")  # the engine stops it


async def test_a_decode_without_room_for_the_kv_is_retried_on_another_decode(fake, pd, logs):
    """The prefill leg answers 503 decode_kv_capacity for decode A: a new pair on decode B answers; A is not
    counted as failing (it is full, not broken), and one line says which decode and why."""
    prefill = await fake("prefill", faults=Faults(decode_kv_capacity=1))
    full, roomy = await fake("decode"), await fake("decode")
    client = await pd([prefill], [full, roomy], policy="round_robin", health_interval_ms=60_000)
    answer = await client.complete("cap1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert answer["usage"]["completion_tokens"] == 4
    assert [e["decode"] for e in logs.events(events.ROUTER_SCHEDULED)] == [full.url, roomy.url]
    assert full.seen == [] and len(roomy.seen) == 1
    assert backend(client, full.url).breaker.failures == 0 and backend(client, prefill.url).breaker.failures == 0
    [refused] = logs.events(events.ROUTER_PREFILL_FAILED)
    assert refused["code"] == "decode_kv_capacity" and refused["decode"] == full.url and refused["retried"] is True
    assert all(b.in_flight == 0 for b in client.fleet.scheduler.backends)


async def test_when_no_decode_has_room_the_client_gets_a_503_naming_it(fake, pd):
    """Every decode refuses the KV: the client gets 503 decode_kv_capacity with the engine's message and
    Retry-After (never a 502), streamed or not; every slot is given back."""
    prefill = await fake("prefill", faults=Faults(decode_kv_capacity=100))
    client = await pd([prefill], [await fake("decode"), await fake("decode")], health_interval_ms=60_000)
    with pytest.raises(Overloaded) as caught:
        await client.complete("cap2", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert caught.value.status == 503 and caught.value.code == "decode_kv_capacity"
    assert "needs 3 tokens" in caught.value.message and caught.value.headers["Retry-After"] == "1"
    with pytest.raises(Overloaded) as streamed:
        async for _ in batches(client, "cap3", "chat", "/v1/chat/completions", *typed(dict(CHAT, stream=True))):
            pass
    assert streamed.value.code == "decode_kv_capacity" and not isinstance(streamed.value, UpstreamError)
    assert all(b.in_flight == 0 for b in client.fleet.scheduler.backends)


async def test_a_prefill_past_the_deadline_is_closed_so_the_engine_stops(fake, pd, logs):
    """The request's deadline ends a prefill still computing: the engine sees its connection close (it cancels and
    frees the work), one router.deadline_exceeded line says so, and the slots are back."""
    prefill = await fake("prefill", faults=Faults(prefill_delay_s=30))
    client = await pd([prefill], [await fake("decode")], max_retries=0, **{**TIGHT, "prefill_timeout_ms": 20_000})
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout):
        await client.complete("gone", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    # Lower bound: the 0.3 s deadline really waited; upper bound: it did not wait for the 30 s prefill.
    assert 0.25 <= time.monotonic() - started < 5
    await until(lambda: prefill.disconnects == 1, "the prefill saw the router hang up")
    assert len(logs.events(events.ROUTER_DEADLINE_EXCEEDED)) == 1
    assert all(b.in_flight == 0 for b in client.fleet.scheduler.backends)


async def test_a_client_gone_during_prefill_closes_the_prefill_leg(fake, pd, logs):
    """The client goes away while the prefill computes: the prefill leg's connection is closed, the event names it,
    no decode leg is sent, and the slots are back."""
    prefill, decode = await fake("prefill", faults=Faults(prefill_delay_s=30)), await fake("decode")
    client = await pd([prefill], [decode])
    task = asyncio.create_task(client.complete("left", "chat", "/v1/chat/completions", *typed(dict(CHAT))))
    await until(lambda: len(prefill.seen) == 1, "the prefill leg sent")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: prefill.disconnects == 1, "the prefill saw the router hang up")
    [gone] = logs.events(events.ROUTER_CLIENT_DISCONNECTED)
    assert gone["decode"] == decode.url and gone["chunks_relayed"] == 0 and decode.seen == []
    assert all(b.in_flight == 0 for b in client.fleet.scheduler.backends)


async def test_a_decode_leg_given_up_for_another_is_closed(fake, pd):
    """A decode that sends nothing before the first-chunk timeout is given up for another decode: its connection is
    closed (the engine frees the KV it took), and the other answers."""
    stalled = await fake("decode", faults=Faults(stall_after_chunks=0))
    client = await pd([await fake("prefill")], [stalled, await fake("decode")], policy="round_robin", first_token_timeout_ms=300,
                      kv_transfer_timeout_ms=100, health_interval_ms=60_000)
    chunks = [c async for batch in batches(client, "slow", "chat", "/v1/chat/completions", *typed(dict(CHAT, stream=True))) for c in batch]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    await until(lambda: stalled.disconnects == 1, "the stalled decode saw the router hang up")


async def test_the_client_gets_the_503_in_its_apis_shape_through_the_router(fake, aiohttp_client, tmp_path):
    """Through the whole router (create_app): with no decode able to hold the KV, an OpenAI client (streamed or not)
    and an Anthropic client get HTTP 503 decode_kv_capacity with Retry-After, each in its API's error shape."""
    prefill, decode = await fake("prefill", faults=Faults(decode_kv_capacity=100)), await fake("decode")
    settings = router_settings(tmp_path, "cap", prefill, decode, "public-model")
    app = create_app(router_config.load(settings, env={}), env={"PD_TEST_KEY": KEY, "PD_INTERNAL_KEY": INTERNAL_KEY})
    http = await aiohttp_client(app)
    auth = {"Authorization": f"Bearer {KEY}"}
    for stream in (False, True):
        response = await http.post("/v1/chat/completions", headers=auth, json={**CHAT, "model": "public-model", "stream": stream})
        error = (await response.json())["error"]
        assert response.status == 503 and response.headers["Retry-After"] == "1"
        assert error["code"] == "decode_kv_capacity" and "cannot hold this prompt's KV" in error["message"]
    response = await http.post("/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                               json={"model": "public-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]})
    body = await response.json()
    assert response.status == 503 and response.headers["Retry-After"] == "1"
    assert body["type"] == "error" and "cannot hold this prompt's KV" in body["error"]["message"]


async def test_a_decode_computing_a_long_prompt_itself_may_stay_silent_that_long(fake, pd):
    """Colocated, the decode computes the prompt before its first chunk: a 1000-character prompt may keep it silent
    past idle_timeout_ms (0.3 s) for its work (1 s); a short prompt's leg is cut at the usual first-chunk bound."""
    both = await fake("both", faults=Faults(delay_s=0.8))
    client = await pd([both], [both], max_retries=0, idle_timeout_ms=300, first_token_timeout_ms=300, kv_transfer_timeout_ms=100,
                      **TIGHT)
    chunks = [c async for batch in batches(client, "long", "chat", "/v1/chat/completions", *typed(chat(1000) | {"stream": True})) for c in batch]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    with pytest.raises(UpstreamTimeout):
        async for _ in batches(client, "short", "chat", "/v1/chat/completions", *typed(dict(CHAT, stream=True))):
            pass
