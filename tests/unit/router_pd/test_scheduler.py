"""Backend selection, slots, the wait queue and circuit breakers, on Backend objects (no network)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from stack.common.config import ConfigError, build
from stack.common.errors import Overloaded, RateLimited
from stack.router.backends import Backend, Breaker, PoolConfig, build_pool, check_topology
from stack.router.scheduler import NoBackendAvailable, Scheduler, SchedulerConfig
from tests.unit.router_pd.conftest import until


def pools(n_decode: int = 2, max_concurrent: int = 8, cooldown_s: float = 30.0,
          clock: Callable[[], float] = time.monotonic) -> dict[str, list[Backend]]:
    urls = tuple(f"http://10.0.0.{i + 1}:8000" for i in range(n_decode))
    return {"decode": build_pool(PoolConfig(endpoints=urls, max_concurrent=max_concurrent), "decode", 3, cooldown_s, clock)}


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_load_aware_picks_fewest_outstanding_tokens():
    """load_aware sends each request to the decode with the fewest outstanding tokens."""
    scheduler = Scheduler(SchedulerConfig(policy="load_aware"), pools())
    a = await scheduler.acquire("decode", 1000)
    b = await scheduler.acquire("decode", 10)
    assert a is not b
    assert await scheduler.acquire("decode", 10) is b  # b holds 10 tokens, a holds 1000
    assert await scheduler.acquire("decode", 10) is b  # 20 < 1000
    scheduler.release(a, 1000)
    assert await scheduler.acquire("decode", 10) is a  # a is empty now


async def test_round_robin_ignores_load():
    """round_robin alternates backends whatever their load."""
    scheduler = Scheduler(SchedulerConfig(policy="round_robin"), pools(3))
    picks = [await scheduler.acquire("decode", 1000 if i == 0 else 1) for i in range(6)]
    assert [p.url[-6] for p in picks] == ["1", "2", "3", "1", "2", "3"]


async def test_max_concurrent_makes_requests_wait_for_a_slot():
    """A backend never gets more than max_concurrent; the next request waits and takes the freed slot."""
    scheduler = Scheduler(SchedulerConfig(queue_timeout_ms=5000), pools(2, max_concurrent=1))
    a = await scheduler.acquire("decode", 1)
    b = await scheduler.acquire("decode", 1)
    waiter = asyncio.create_task(scheduler.acquire("decode", 1))
    await until(lambda: scheduler.queue_depth == 1, "queued")
    assert not waiter.done()
    assert (a.in_flight, b.in_flight) == (1, 1)
    scheduler.release(b, 1)
    assert await asyncio.wait_for(waiter, 1.0) is b
    assert scheduler.queue_depth == 0 and b.in_flight == 1


async def test_full_queue_answers_429_with_retry_after():
    """When every slot is busy and queue_size requests already wait, the next one gets 429 + Retry-After."""
    scheduler = Scheduler(SchedulerConfig(queue_size=1, queue_timeout_ms=5000), pools(1, max_concurrent=1))
    await scheduler.acquire("decode", 1)
    queued = asyncio.create_task(scheduler.acquire("decode", 1))
    await until(lambda: scheduler.queue_depth == 1, "queued")
    with pytest.raises(RateLimited) as caught:
        await scheduler.acquire("decode", 1)
    assert caught.value.code == "queue_full" and int(caught.value.headers["Retry-After"]) >= 1
    queued.cancel()


async def test_queue_timeout_answers_503_with_retry_after():
    """A queued request that gets no slot within queue_timeout_ms fails with 503 + Retry-After, not a hang."""
    scheduler = Scheduler(SchedulerConfig(queue_timeout_ms=100), pools(1, max_concurrent=1))
    await scheduler.acquire("decode", 1)
    started = time.monotonic()
    with pytest.raises(Overloaded) as caught:
        await scheduler.acquire("decode", 1)
    # Lower bound: it did wait for the queue timeout; upper bound (2 s) catches a hang.
    assert 0.09 <= time.monotonic() - started < 2.0
    assert caught.value.status == 503 and caught.value.code == "queue_timeout" and "Retry-After" in caught.value.headers
    assert scheduler.queue_depth == 0


async def test_cancelled_waiter_passes_its_wakeup_on():
    """A queued request that goes away after being woken hands the freed slot to the next waiter."""
    scheduler = Scheduler(SchedulerConfig(queue_timeout_ms=5000), pools(1, max_concurrent=1))
    holder = await scheduler.acquire("decode", 1)
    first = asyncio.create_task(scheduler.acquire("decode", 1))
    second = asyncio.create_task(scheduler.acquire("decode", 1))
    await until(lambda: scheduler.queue_depth == 2, "both queued")
    scheduler.release(holder, 1)  # wakes `first` …
    first.cancel()  # … which leaves before it runs
    assert await asyncio.wait_for(second, 1.0) is holder


async def test_no_backend_up_fails_fast_naming_the_role():
    """With every backend of a role down, requests get 503 naming the role at once (no queueing)."""
    backends = pools(2)
    for b in backends["decode"]:
        b.set_up(False, "test")
    scheduler = Scheduler(SchedulerConfig(), backends)
    with pytest.raises(NoBackendAvailable, match="no decode backend is available") as caught:
        await scheduler.acquire("decode", 1)
    assert caught.value.status == 503 and "Retry-After" in caught.value.headers


async def test_down_and_open_backends_are_skipped():
    """A down backend and one with an open circuit get no requests while another is usable."""
    backends = pools(3)
    down, broken, healthy = backends["decode"]
    down.set_up(False, "test")
    for _ in range(3):
        broken.breaker.on_failure()
    scheduler = Scheduler(SchedulerConfig(policy="round_robin"), backends)
    assert {(await scheduler.acquire("decode", 1)).url for _ in range(4)} == {healthy.url}


def test_breaker_opens_after_threshold_then_half_opens_and_closes():
    """The breaker opens after N consecutive failures, lets one trial through after the cool-down, closes on success."""
    clock = FakeClock()
    breaker = Breaker("http://b:1", threshold=2, cooldown_s=5.0, clock=clock)
    breaker.on_failure()
    assert breaker.allows()
    breaker.on_failure()
    assert breaker.state == "open" and not breaker.allows() and breaker.retry_after_s() == 5.0
    clock.now += 4.999
    assert not breaker.allows() and breaker.state == "open"  # not a moment before the cool-down ends
    clock.now += 0.001
    assert breaker.allows() and breaker.state == "half_open" and breaker.retry_after_s() == 0.0
    breaker.on_start()
    assert not breaker.allows()  # only one trial at a time
    breaker.on_failure()
    assert breaker.state == "open" and breaker.retry_after_s() == 5.0  # a failed trial re-opens at once, for a whole cool-down
    clock.now += 5.0
    assert breaker.allows()
    breaker.on_start()
    breaker.on_success()
    assert breaker.state == "closed" and breaker.allows()


def test_pool_config_merges_endpoints_and_validates():
    """endpoint and endpoints merge; bad URLs and mismatched address lists name the key."""
    pool = build(PoolConfig, {"endpoint": "http://10.0.0.11:8000", "endpoints": ["http://10.0.0.12:8000", "http://10.0.0.11:8000/"]}, "s.toml")
    assert pool.urls == ("http://10.0.0.11:8000", "http://10.0.0.12:8000") and pool.health_addr(0) == "10.0.0.11:50051"
    with pytest.raises(ConfigError, match=r"s.toml: decode.endpoint: must be an http\(s\) URL"):
        build(PoolConfig, {"endpoint": "10.0.0.11:8000"}, "s.toml", prefix="decode.")
    with pytest.raises(ConfigError, match=r"kv_addrs: needs one address per endpoint \(1\), got 2"):
        build(PoolConfig, {"endpoint": "http://a:1", "kv_addrs": ["a:9200", "b:9200"]}, "s.toml")
    assert build(PoolConfig, {"endpoint": "http://a:1", "kv_addrs": ["kv-a"]}, "s.toml").kv_addrs == ("kv-a",)  # a host alone
    for bad, problem in (("kv a", "must be host or host:port"), ("a:70000", "port must be 1..65535"), ("a:0", "port must be 1..65535")):
        with pytest.raises(ConfigError, match=rf"decode.kv_addrs\[0\]: {problem}"):
            build(PoolConfig, {"endpoint": "http://a:1", "kv_addrs": [bad]}, "s.toml", prefix="decode.")
    with pytest.raises(ConfigError, match="max_concurrent: must be > 0"):
        build(PoolConfig, {"endpoint": "http://a:1", "max_concurrent": 0}, "s.toml")
    with pytest.raises(ConfigError, match="identical \\(colocated\\) or disjoint"):
        check_topology(PoolConfig(endpoints=("http://a:1", "http://b:1")), PoolConfig(endpoint="http://a:1"))


def test_scheduler_config_rejects_bad_values():
    """Scheduler settings are validated at start-up with the key named."""
    with pytest.raises(ConfigError, match="scheduler.policy: must be one of 'load_aware', 'round_robin'"):
        build(SchedulerConfig, {"policy": "random"}, "s.toml", prefix="scheduler.")
    with pytest.raises(ConfigError, match="kv_transfer_timeout_ms: must be > 0"):
        build(SchedulerConfig, {"kv_transfer_timeout_ms": 0}, "s.toml")


async def test_abandoned_half_open_trial_does_not_block_the_backend():
    """A half-open trial that ends without a verdict (client went away) lets the next trial through."""
    clock = FakeClock()
    backends = pools(1, cooldown_s=10.0, clock=clock)
    (only,) = backends["decode"]
    for _ in range(3):
        only.breaker.on_failure()
    clock.now += 10.0
    scheduler = Scheduler(SchedulerConfig(queue_timeout_ms=100), backends)
    trial = await scheduler.acquire("decode", 1)
    assert only.breaker.state == "half_open" and not only.usable
    scheduler.release(trial, 1)  # no success or failure recorded
    assert await scheduler.acquire("decode", 1) is only


async def test_a_backend_joining_wakes_a_waiter_which_takes_it():
    """add_backend: a request queued because every slot was busy gets the new backend at once, not after a timeout."""
    scheduler = Scheduler(SchedulerConfig(queue_timeout_ms=5000), pools(1, max_concurrent=1))
    await scheduler.acquire("decode", 1)
    waiter = asyncio.create_task(scheduler.acquire("decode", 1))
    await until(lambda: scheduler.queue_depth == 1, "queued")
    (joined,) = build_pool(PoolConfig(endpoint="http://10.0.0.9:8000", max_concurrent=1), "decode", 3, 30.0)
    scheduler.add_backend(joined)
    assert await asyncio.wait_for(waiter, 1.0) is joined
    assert joined in scheduler.pool("decode") and scheduler.queue_depth == 0


async def test_the_last_backend_leaving_fails_its_waiters_fast():
    """remove_backend: waiters re-check at once and get 503 naming the role (nothing left to wait for)."""
    scheduler = Scheduler(SchedulerConfig(queue_timeout_ms=30_000), pools(1, max_concurrent=1))
    holder = await scheduler.acquire("decode", 1)
    waiter = asyncio.create_task(scheduler.acquire("decode", 1))
    await until(lambda: scheduler.queue_depth == 1, "queued")
    scheduler.remove_backend(holder.url)
    with pytest.raises(NoBackendAvailable, match="no decode backend is available \\(none configured or registered\\)"):
        await asyncio.wait_for(waiter, 1.0)  # far below queue_timeout_ms: woken, not timed out
    assert scheduler.pool("decode") == () and scheduler.queue_depth == 0


async def test_marking_backends_down_and_up_wakes_waiters():
    """mark: a waiter whose only backend goes down fails fast; one waiting while a backend comes up takes it."""
    scheduler = Scheduler(SchedulerConfig(queue_timeout_ms=30_000), pools(2, max_concurrent=1))
    busy, idle = await scheduler.acquire("decode", 1), await scheduler.acquire("decode", 1)
    scheduler.release(idle, 1)
    assert scheduler.mark(idle, False, "test") and not scheduler.mark(idle, False, "test")  # True only on a change
    waiter = asyncio.create_task(scheduler.acquire("decode", 1))
    await until(lambda: scheduler.queue_depth == 1, "queued")
    assert scheduler.mark(idle, True, "test")
    assert await asyncio.wait_for(waiter, 1.0) is idle
    scheduler.release(idle, 1)
    scheduler.mark(idle, False, "test")
    doomed = asyncio.create_task(scheduler.acquire("decode", 1))
    await until(lambda: scheduler.queue_depth == 1, "queued")
    scheduler.mark(busy, False, "test")
    with pytest.raises(NoBackendAvailable, match="down: "):
        await asyncio.wait_for(doomed, 1.0)
