"""Policy cache_aware: session and prompt-prefix affinity over both pools, its imbalance guard, and pool changes."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from stack.common import events
from stack.common.config import ConfigError, build
from stack.router.affinity import SESSION_HEADERS, Affinity, prompt_prefix, rank, request_affinity
from stack.router.backends import Backend, PoolConfig, build_pool
from stack.router.metrics import Metrics
from stack.router.scheduler import Scheduler, SchedulerConfig
from tests.unit.router_pd.conftest import batches, typed
from tests.unit.router_pd.test_pd_engines import chat


def pd_pools(n_prefill: int = 2, n_decode: int = 2, max_concurrent: int = 64) -> dict[str, list[Backend]]:
    def urls(base: int, n: int) -> tuple[str, ...]:
        return tuple(f"http://10.0.{base}.{i + 1}:8000" for i in range(n))
    return {"prefill": build_pool(PoolConfig(endpoints=urls(1, n_prefill), max_concurrent=max_concurrent), "prefill", 3, 30.0),
            "decode": build_pool(PoolConfig(endpoints=urls(2, n_decode), max_concurrent=max_concurrent), "decode", 3, 30.0)}


def key(session: str) -> Affinity:
    found = request_affinity({"x-session-id": session}, {}, 2048)
    assert found is not None
    return found


async def pair(scheduler: Scheduler, k: Affinity | None) -> tuple[Backend, Backend]:
    """One turn: a prefill and a decode taken for `k` (the slots stay taken, as while the turn runs)."""
    return await scheduler.acquire("prefill", 100, key=k), await scheduler.acquire("decode", 200, key=k)


async def test_a_sessions_turns_stick_to_one_pair_until_the_guard_trips():
    """Every turn of a session takes the same prefill AND decode; once its decode is too far ahead (guard: gap > 2 and
    ratio > 1.5 in flight) the turn goes load-aware, and the session returns when the gap closes."""
    metrics = Metrics()
    scheduler = Scheduler(SchedulerConfig(policy="cache_aware", balance_abs_threshold=2, balance_rel_threshold=1.5),
                          pd_pools(), metrics.affinity)
    k = key("sess-a")
    first = await pair(scheduler, k)
    turns = [first] + [await pair(scheduler, k) for _ in range(2)]  # 3 in flight on each chosen backend: gap 3 > 2
    assert all(t == first for t in turns)
    prefill, decode = first
    spilled = await pair(scheduler, k)
    assert spilled[0] is not prefill and spilled[1] is not decode  # load-aware: the idle ones
    assert metrics.affinity.value(role="decode", backend=spilled[1].url, decision="imbalanced") == 1
    assert metrics.affinity.value(role="decode", backend=decode.url, decision="session") == 3
    for _ in range(3):  # the turns finish; the gap closes
        scheduler.release(prefill, 100)
        scheduler.release(decode, 200)
    assert await pair(scheduler, k) == first
    body, _ = metrics.render()
    assert f'pd_router_affinity_decisions_total{{backend="{decode.url}",decision="session",role="decode"}} 4' in body


async def test_a_full_preferred_backend_sends_the_turn_load_aware():
    """A preferred backend without a free slot does not make the request wait while another has one."""
    metrics = Metrics()
    scheduler = Scheduler(SchedulerConfig(policy="cache_aware"), pd_pools(max_concurrent=1), metrics.affinity)
    k = key("sess-full")
    first = await pair(scheduler, k)
    second = await pair(scheduler, k)
    assert second[0] is not first[0] and second[1] is not first[1]
    assert metrics.affinity.value(role="prefill", backend=second[0].url, decision="unavailable") == 1


async def test_different_sessions_spread_over_the_pool():
    """200 sessions over 4 decodes: each gets a fair share (rendezvous hashing is uniform), none is empty."""
    scheduler = Scheduler(SchedulerConfig(policy="cache_aware"), pd_pools(1, 4, max_concurrent=1000))
    counts: dict[str, int] = {}
    for i in range(200):
        backend = await scheduler.acquire("decode", 1, key=key(f"session-{i}"))
        scheduler.release(backend, 1)  # no load builds up: the spread is the mapping's alone
        counts[backend.url] = counts.get(backend.url, 0) + 1
    assert len(counts) == 4 and min(counts.values()) >= 25 and max(counts.values()) <= 80, counts


def test_a_pool_change_moves_only_the_affected_sessions():
    """Removing a backend moves only the sessions it held; adding one takes sessions only onto itself (about 1/n)."""
    pool = pd_pools(1, 4)["decode"]
    keys = [key(f"s{i}") for i in range(400)]
    before = {k: rank(k, pool)[0].url for k in keys}
    gone = pool[1].url
    after_remove = {k: rank(k, [b for b in pool if b.url != gone])[0].url for k in keys}
    moved = [k for k in keys if before[k] != after_remove[k]]
    assert moved and all(before[k] == gone for k in moved) and len(moved) == sum(u == gone for u in before.values())
    grown = pool + pd_pools(1, 5)["decode"][4:]
    after_add = {k: rank(k, grown)[0].url for k in keys}
    joined = [k for k in keys if before[k] != after_add[k]]
    assert all(after_add[k] == grown[4].url for k in joined) and 40 <= len(joined) <= 130, len(joined)


async def test_requests_without_a_key_are_load_aware():
    """cache_aware without a session header or prompt is load-aware, counted as no_key."""
    metrics = Metrics()
    scheduler = Scheduler(SchedulerConfig(policy="cache_aware"), pd_pools(), metrics.affinity)
    a = await scheduler.acquire("decode", 1000)
    b = await scheduler.acquire("decode", 10)
    assert a is not b and metrics.affinity.value(role="decode", backend=b.url, decision="no_key") == 1


def test_session_headers_in_order_and_prefix_fallback():
    """Claude Code's header wins over Codex's and the generic one; a malformed id falls back to the prompt prefix,
    which stays the same as a conversation grows and differs between conversations."""
    body = chat("first question")
    claude = request_affinity({"x-claude-code-session-id": "A", "session_id": "B", "x-session-id": "C"}, body, 64)
    assert claude == request_affinity({"x-claude-code-session-id": "A"}, {}, 64) and claude.kind == "session"
    assert request_affinity({"session_id": "B"}, body, 64) == request_affinity({"session_id": "B", "x-session-id": "C"}, {}, 64)
    assert SESSION_HEADERS[0] == "x-claude-code-session-id"
    turn1 = request_affinity({"x-session-id": "bad\x00id"}, body, 64)
    grown = {**body, "messages": body["messages"] + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "next"}]}
    assert turn1 is not None and turn1.kind == "prefix" and turn1 == request_affinity({}, grown, 64)
    assert turn1 != request_affinity({}, chat("another conversation"), 64)
    assert request_affinity({}, {"model": "m"}, 64) is None
    assert prompt_prefix({"prompt": "abcdef"}, 3) == "abc"


@pytest.mark.parametrize(("settings", "key_name"), [({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
                                                     ({"balance_abs_threshold": -1}, "balance_abs_threshold"),
                                                     ({"affinity_prefix_chars": 0}, "affinity_prefix_chars"),
                                                     ({"policy": "sticky"}, "policy")])
def test_bad_affinity_settings_name_file_and_key(settings, key_name):
    with pytest.raises(ConfigError) as caught:
        build(SchedulerConfig, settings, "router/settings.toml", "scheduler.")
    assert "router/settings.toml" in str(caught.value) and key_name in str(caught.value)


async def test_session_sticks_to_one_pair_over_real_engines(engines, pd, logs):
    """2P2D real engines: three turns of one Claude Code session take one prefill and one decode; another session's
    turns are scheduled on a pair of their own choosing just as consistently."""
    engines_ = await engines("prefill", "prefill", "decode", "decode")
    client = await pd(engines_[:2], engines_[2:], policy="cache_aware")
    history = chat("Plan a refactor of the router.", max_tokens=4)["messages"]
    for session in ("sess-1", "sess-2"):
        for turn in range(3):
            body = chat(max_tokens=4) | {"messages": history + [{"role": "user", "content": f"turn {turn}"}]}
            [c async for batch in batches(client, f"{session}-{turn}", "chat", "/v1/chat/completions", *typed(body), CIMultiDict({"X-Claude-Code-Session-Id": session}))
             for c in batch]
    scheduled = logs.events(events.ROUTER_SCHEDULED)
    for session in ("sess-1", "sess-2"):
        pairs = {(e["prefill"], e["decode"]) for e in scheduled if e["request_id"].startswith(session)}
        assert len(pairs) == 1, pairs
    decisions = client.metrics.affinity.values
    assert sum(n for labels, n in decisions.items() if ("decision", "session") in labels) == 12  # 2 sessions × 3 turns × 2 legs
    assert set(decisions) == {labels for labels in decisions if ("decision", "session") in labels}
