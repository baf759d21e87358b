"""RedisCounters against a real redis-server: check-and-take is atomic across clients, leases renew while held,
and a charge Redis missed is sent when it is back."""

from __future__ import annotations

import asyncio

import pytest
import redis

from stack.common.config import ConfigError
from stack.router import config as router_config
from stack.router.config import KeyLimits, LimitsStoreConfig
from stack.router.limits_redis import RedisCounters
from tests.unit.router_fleet.conftest import RedisServer


@pytest.fixture
def store(tmp_path) -> RedisServer:
    server = RedisServer(tmp_path)
    yield server
    server.stop()


async def test_take_is_atomic_across_two_routers_clients(store: RedisServer) -> None:
    """Two routers' clients racing 40 takes for max_concurrent = 5 get exactly 5 slots between them."""
    config = LimitsStoreConfig(redis_url=store.url, lease_ms=30_000)
    first, second = RedisCounters(config), RedisCounters(config)
    limits = KeyLimits(max_concurrent=5)
    results = await asyncio.gather(*(counters.take("k", limits, f"slot{i}-{n}") for i in range(20) for n, counters in enumerate((first, second))))
    assert sum(result is None for result in results) == 5
    assert {(r.limit, r.maximum) for r in results if r is not None} == {("concurrency", 5)}
    assert await first.in_flight("k") == 5
    await first.close()
    await second.close()


async def test_renewed_lease_outlives_its_length_and_an_unrenewed_one_does_not(store: RedisServer) -> None:
    """A slot its router renews stays held past lease_ms; one nobody renews is gone after it."""
    config = LimitsStoreConfig(redis_url=store.url, lease_ms=3000)
    alive, dead = RedisCounters(config), RedisCounters(config)
    limits = KeyLimits(max_concurrent=2)
    assert await alive.take("k", limits, "kept") is None
    assert await dead.take("k", limits, "lost") is None
    for _ in range(4):  # 4.4 s in all, renewing the kept slot every 1.1 s (the renewer's lease/3 pace)
        await asyncio.sleep(1.1)
        await alive.renew()
    assert await alive.in_flight("k") == 1
    await alive.close()
    await dead.close()


async def test_a_charge_redis_missed_is_sent_when_it_is_back(store: RedisServer) -> None:
    """give_back while Redis is down keeps the charge; the next renewal after Redis returns adds it to the totals."""
    counters = RedisCounters(LimitsStoreConfig(redis_url=store.url, timeout_ms=300))
    assert await counters.take("k", KeyLimits(), "s1") is None
    store.stop()
    await counters.give_back("k", "s1", 7, 3)  # logs limit_store.unavailable, does not raise
    store.start()
    await counters.renew()
    totals = await counters.totals("k")
    assert (totals.requests, totals.prompt_tokens, totals.completion_tokens) == (1, 7, 3)
    await counters.close()


@pytest.mark.parametrize(("line", "problem"), [
    ('redis_url = "redis://:hunter2@redis:6379/0"', "must not carry a password"),
    ('redis_url = "http://redis:6379"', "must be a redis://"),
    ("lease_ms = 500", "at least 3000"),
])
def test_bad_limits_store_settings_name_file_key_and_problem(tmp_path, line: str, problem: str) -> None:
    """A wrong [limits_store] value stops start-up with one line naming settings.toml, the key and what is wrong."""
    path = tmp_path / "settings.toml"
    path.write_text(f'[prefill]\nendpoint = "http://p:8000"\n[decode]\nendpoint = "http://d:8000"\n[limits_store]\n{line}\n')
    with pytest.raises(ConfigError, match=problem) as caught:
        router_config.load(path, env={})
    assert caught.value.file == str(path) and caught.value.key.startswith("limits_store.")
    assert "hunter2" not in str(caught.value)  # the password is not repeated


async def test_an_admit_and_a_release_are_one_script_call_each_and_a_turn_shares_one_pipeline(store: RedisServer) -> None:
    """Redis gets exactly one EVALSHA per take and one per give_back (no script loading, no extra read); 10 takes made in one loop turn are
    answered together, each by its own atomic script (max_concurrent still counts every one)."""
    counters = RedisCounters(LimitsStoreConfig(redis_url=store.url))
    assert await counters.take("k", KeyLimits(), "warm") is None  # loads the scripts once
    await counters.give_back("k", "warm", 0, 0)
    admin = redis.Redis(port=store.port)
    admin.config_resetstat()
    assert await counters.take("k", KeyLimits(), "s1") is None
    await counters.give_back("k", "s1", 5, 2)
    stats = {name: value["calls"] for name, value in admin.info("commandstats").items()}
    # (the other counts are the commands the two scripts ran inside Redis)
    assert stats["cmdstat_evalsha"] == 2 and not {"cmdstat_script", "cmdstat_eval", "cmdstat_hgetall"} & set(stats), stats
    results = await asyncio.gather(*(counters.take("k", KeyLimits(max_concurrent=4), f"t{i}") for i in range(10)))
    assert sum(r is None for r in results) == 4 and await counters.in_flight("k") == 4
    admin.close()
    await counters.close()
