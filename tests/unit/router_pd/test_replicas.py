"""Discover pools (stack/router/replicas.py): the router's pools are whatever a DNS name resolves to, as replicas come
and go; joiners are health-gated, leavers drain, a decode's KV address is what it reports.

Real engine processes on loopback, each replica of a pool on its own address (127.0.0.2, 127.0.0.3: Linux routes
all of 127/8 to lo) with the pool's one port, as replicas of a service are on a real network. The DNS answer that
changes during a test comes from `Answers`, an aiohttp resolver (the seam the router resolves through) whose
records the test sets; the real resolver (getaddrinfo) is exercised with `localhost` and an unknown name.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.abc import AbstractResolver, ResolveResult

from stack.common import events
from stack.common.config import ConfigError
from stack.router import config as router_config
from stack.router.backends import PoolConfig
from stack.router.config import RouterConfig
from stack.router.metrics import Metrics
from stack.router.fleet import Fleet
from stack.router.pd import PDClient
from stack.router.scheduler import NoBackendAvailable, SchedulerConfig
from tests.unit.router_pd.conftest import batches, EngineProcess, backend, free_port, wait_for_state, typed

CHAT = {"model": "your-model-id", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


class Answers(AbstractResolver):
    """A DNS answer the test sets per name (addresses, or an error), in aiohttp's ResolveResult shape."""

    def __init__(self) -> None:
        self.records: dict[str, list[str] | OSError] = {}

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        answer = self.records.get(host, socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
        if isinstance(answer, OSError):
            raise answer
        return [ResolveResult(hostname=host, host=a, port=port, family=socket.AF_INET, proto=6, flags=socket.AI_NUMERICHOST)
                for a in answer]

    async def close(self) -> None:
        pass


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[Callable[..., EngineProcess]]:
    """replicas(role, address, (port, health_port)): a real engine there, not started yet (stopped after the test)."""
    made: list[EngineProcess] = []

    def make(role: str, address: str, ports: tuple[int, int]) -> EngineProcess:
        engine = EngineProcess(role, tmp_path, host=address, ports=ports)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.stop()


def discover_pool(name: str, ports: tuple[int, int]) -> PoolConfig:
    # The loop never fires by itself here (60 s): each test applies a changed answer with watcher.refresh().
    return PoolConfig(discover=f"dns://{name}:{ports[0]}", discover_health_port=ports[1], discover_interval_ms=60_000)


async def start_client(session: aiohttp.ClientSession, prefill: PoolConfig, decode: PoolConfig,
                       resolver: AbstractResolver | None, health_interval_ms: int = 200) -> PDClient:
    config = RouterConfig(prefill=prefill, decode=decode, scheduler=SchedulerConfig(health_interval_ms=health_interval_ms))
    metrics = Metrics()
    client = PDClient(Fleet(config, session, metrics, resolver=resolver), metrics)
    await client.fleet.start()
    return client


async def serving(*engines: EngineProcess) -> None:
    for engine in engines:
        engine.start()
    for engine in engines:
        await engine.ready()


async def discovered(session: aiohttp.ClientSession, p_ports: tuple[int, int], d_ports: tuple[int, int],
                     health_interval_ms: int = 200) -> tuple[Answers, PDClient]:
    """A client whose discover pools prefill.test and decode.test both resolve to 127.0.0.2 (a test changes the answers)."""
    answers = Answers()
    answers.records = {"prefill.test": ["127.0.0.2"], "decode.test": ["127.0.0.2"]}
    pools = discover_pool("prefill.test", p_ports), discover_pool("decode.test", d_ports)
    return answers, await start_client(session, *pools, answers, health_interval_ms)


def watcher(client: PDClient, role: str) -> Any:
    return next(w for w in client.fleet.watchers if w.role == role)


async def complete(client: PDClient, request_id: str) -> dict[str, Any]:
    return await client.complete(request_id, "chat", "/v1/chat/completions", *typed(dict(CHAT)))


async def test_replicas_join_once_healthy_and_leave_while_their_requests_finish(session, replicas, logs, monkeypatch):
    """A prefill appearing in DNS before its engine serves joins down and gets no request until it is SERVING; a decode
    vanishing from DNS mid-stream gets no new request while that stream runs to its end; the decode that replaces
    it is used once its KV address (the kv_host it reports, with its kv_port) is known."""
    monkeypatch.setenv("KV_ADVERTISE_HOST", "127.0.0.1")  # how prefill reaches each decode's KV listener here
    p_ports, d_ports = (free_port(), free_port()), (free_port(), free_port())
    p1, p2 = replicas("prefill", "127.0.0.2", p_ports), replicas("prefill", "127.0.0.3", p_ports)
    d1, d2 = replicas("decode", "127.0.0.2", d_ports), replicas("decode", "127.0.0.3", d_ports)
    await serving(p1, d1, d2)
    answers, client = await discovered(session, p_ports, d_ports)
    try:
        assert [b.url for b in client.fleet.scheduler.pool("prefill")] == [p1.url]
        assert backend(client, d1.url).kv_addr == f"127.0.0.1:{d1.kv_port}"
        pools = client.health_snapshot()["pools"]
        assert {role: (p["source"], p["backends"], p["up"]) for role, p in pools.items()} == {
            "prefill": (f"dns://prefill.test:{p_ports[0]}", 1, 1), "decode": (f"dns://decode.test:{d_ports[0]}", 1, 1)}
        assert pools["prefill"]["models"] == pools["decode"]["models"] == {client.monitor.fingerprints[d1.url]: 1}
        await complete(client, "before")

        answers.records["prefill.test"] = ["127.0.0.2", "127.0.0.3"]  # p2's address is there, its engine is not
        await watcher(client, "prefill").refresh()
        await wait_for_state(client, p2.url, "down")
        for i in range(3):
            await complete(client, f"while-p2-starts-{i}")
        assert logs.events(events.ROUTER_PREFILL_FAILED) == [], "a request was sent to the replica that was not up"
        p2.start()
        await p2.ready()
        await wait_for_state(client, p2.url, "up", timeout_s=30)
        [joined] = [e for e in logs.events(events.DISCOVERY_JOINED) if e["backend"] == p2.url]
        assert (joined["role"], joined["replicas"], joined["discover"]) == ("prefill", 2, f"dns://prefill.test:{p_ports[0]}")

        body = {**CHAT, "max_tokens": 64, "ignore_eos": True, "stream": True}
        async with aclosing(batches(client, "draining", "chat", "/v1/chat/completions", *typed(body))) as relayed:
            chunks = list(await anext(relayed))
            answers.records["decode.test"] = ["127.0.0.3"]  # d1 is scaled away while its stream runs
            await watcher(client, "decode").refresh()
            assert [b.url for b in client.fleet.scheduler.pool("decode")] == [d2.url]
            [left] = logs.events(events.DISCOVERY_LEFT)
            assert (left["backend"], left["in_flight_requests"], left["level"]) == (d1.url, 1, "INFO")
            async for batch in relayed:
                chunks.extend(batch)
        assert any(c["choices"] and c["choices"][0].get("finish_reason") == "length" for c in chunks), "the draining stream was cut"
        assert next(c["usage"] for c in reversed(chunks) if c.get("usage"))["completion_tokens"] == 64

        await wait_for_state(client, d2.url, "up", timeout_s=30)
        assert backend(client, d2.url).kv_addr == f"127.0.0.1:{d2.kv_port}"
        before = len(d2.events(events.ENGINE_REQUEST_RECEIVED))
        await complete(client, "after")
        assert len(d2.events(events.ENGINE_REQUEST_RECEIVED)) == before + 1
    finally:
        await client.fleet.close()


async def test_a_replacement_in_the_same_answer_is_up_before_its_predecessor_leaves(session, replicas, monkeypatch):
    """A rolling update (Swarm's start-first): the new decode enters DNS in the same answer the old one leaves. The
    replacement is probed at once, so the pool has a usable decode the moment the old one goes, with the monitor's
    own next round a minute away."""
    monkeypatch.setenv("KV_ADVERTISE_HOST", "127.0.0.1")
    p_ports, d_ports = (free_port(), free_port()), (free_port(), free_port())
    p1, d1, d2 = replicas("prefill", "127.0.0.2", p_ports), replicas("decode", "127.0.0.2", d_ports), replicas("decode", "127.0.0.3", d_ports)
    await serving(p1, d1, d2)
    answers, client = await discovered(session, p_ports, d_ports, health_interval_ms=60_000)
    try:
        await complete(client, "before")
        answers.records["decode.test"] = ["127.0.0.3"]  # d1's task replaced by d2's, in one answer
        await watcher(client, "decode").refresh()
        assert [(b.url, b.up) for b in client.fleet.scheduler.pool("decode")] == [(d2.url, True)]
        assert backend(client, d2.url).kv_addr == f"127.0.0.1:{d2.kv_port}"
        await complete(client, "right after")
        assert len(d2.events(events.ENGINE_REQUEST_RECEIVED)) == 1
    finally:
        await client.fleet.close()


async def test_the_real_resolver_finds_replicas_and_an_unknown_name_is_an_empty_pool(session, replicas, monkeypatch):
    """getaddrinfo through aiohttp's default resolver: `localhost` is this host's engines; a name with no address
    (NXDOMAIN: scaled to zero) is an empty pool, and requests get 503 no_decode_backend with Retry-After."""
    monkeypatch.setenv("KV_ADVERTISE_HOST", "127.0.0.1")
    p_ports, d_ports = (free_port(), free_port()), (free_port(), free_port())
    prefill, decode = replicas("prefill", "127.0.0.1", p_ports), replicas("decode", "127.0.0.1", d_ports)
    for engine in (prefill, decode):
        engine.start()
    for engine in (prefill, decode):
        await engine.ready()
    client = await start_client(session, discover_pool("localhost", p_ports), discover_pool("localhost", d_ports), None)
    try:
        assert [b.url for b in client.fleet.scheduler.backends] == [decode.url, prefill.url]
        answer = await complete(client, "real-dns")
        assert answer["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        await client.fleet.close()
    client = await start_client(session, discover_pool("localhost", p_ports), discover_pool("no-such-replica.invalid", d_ports), None)
    try:
        assert client.fleet.scheduler.pool("decode") == ()
        body, _ = client.metrics.render()  # the pool's series stays when its replicas are gone (PDPoolEmpty reads it)
        assert 'pd_router_pool_up{role="decode"} 0' in body and 'pd_router_pool_backends{role="decode"} 0' in body
        with pytest.raises(NoBackendAvailable) as raised:
            await complete(client, "nobody")
        assert raised.value.code == "no_decode_backend" and raised.value.headers["Retry-After"]
    finally:
        await client.fleet.close()


async def test_a_failed_lookup_keeps_the_pool_and_warns_once(fake, session, logs):
    """A DNS timeout or SERVFAIL is not "no replicas": the pool stays as it was; one WARNING per failure streak."""
    prefill, decode = await fake("prefill"), await fake("decode")
    answers = Answers()
    answers.records = {"decode.test": ["127.0.0.1"]}
    port = int(decode.url.rsplit(":", 1)[1])
    pool = PoolConfig(discover=f"dns://decode.test:{port}", discover_health_port=int(decode.health_addr.rsplit(":", 1)[1]),
                      discover_interval_ms=60_000)
    client = await start_client(session, PoolConfig(endpoint=prefill.url, health_addrs=(prefill.health_addr,)), pool, answers)
    try:
        await wait_for_state(client, decode.url, "up")
        answers.records["decode.test"] = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        for _ in range(2):
            await watcher(client, "decode").refresh()
        assert [b.url for b in client.fleet.scheduler.pool("decode")] == [decode.url]
        [failed] = logs.events(events.DISCOVERY_FAILED)
        assert failed["role"] == "decode" and "Temporary failure" in failed["error"] and failed["level"] == "WARNING"
        await complete(client, "still-served")
    finally:
        await client.fleet.close()


@pytest.mark.parametrize(("text", "key", "problem"), [
    ('[prefill]\ndiscover = "prefill:8000"\n[decode]\ndiscover = "dns://decode:8000"\n', "prefill.discover",
     "must be dns://NAME:PORT like dns://prefill:8000, got 'prefill:8000'"),
    ('[prefill]\ndiscover = "dns://prefill"\n[decode]\ndiscover = "dns://decode:8000"\n', "prefill.discover",
     "must be dns://NAME:PORT"),
    ('[prefill]\nendpoint = "http://p:8000"\ndiscover = "dns://prefill:8000"\n[decode]\nendpoint = "http://d:8000"\n',
     "prefill.discover", "set either endpoint/endpoints or discover, not both"),
    ('[prefill]\ndiscover = "dns://prefill:8000"\n[decode]\ndiscover = "dns://decode:8000"\nkv_addrs = ["decode-kv"]\n',
     "decode.kv_addrs", "is per endpoint"),
    ('[prefill]\ndiscover = "dns://prefill:8000"\n[decode]\ndiscover = "dns://decode:8000"\ndiscover_interval_ms = 5\n',
     "decode.discover_interval_ms", "must be at least 100, got 5"),
    ('[prefill]\ndiscover = "dns://prefill:8000"\n[decode]\ndiscover = "dns://decode:8000"\n[scheduler]\nhealth_interval_ms = 0\n',
     "scheduler.health_interval_ms", "needs health probes"),
])
def test_discover_settings_are_checked_at_start(tmp_path: Path, text: str, key: str, problem: str) -> None:
    """A wrong discover setting stops the router with one line naming the file, the key and the problem."""
    path = tmp_path / "settings.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        router_config.load(path, env={})
    assert (raised.value.file, raised.value.key) == (str(path), key)
    assert problem in raised.value.problem


def test_the_environment_picks_fixed_endpoints_or_a_discover_name(tmp_path: Path) -> None:
    """PREFILL_DISCOVER replaces the file's endpoint (and PREFILL_ENDPOINT a discover name); both at once is an error."""
    path = tmp_path / "settings.toml"
    path.write_text('[prefill]\nendpoint = "http://p:8000"\n[decode]\ndiscover = "dns://decode:8000"\n')
    config = router_config.load(path, env={"PREFILL_DISCOVER": "dns://tasks.prefill:8000"})
    assert (config.prefill.urls, config.prefill.discover) == ((), "dns://tasks.prefill:8000")
    config = router_config.load(path, env={"DECODE_ENDPOINT": "http://10.0.0.12:8000"})
    assert (config.decode.urls, config.decode.discover) == (("http://10.0.0.12:8000",), "")
    with pytest.raises(ConfigError) as raised:
        router_config.load(path, env={"PREFILL_ENDPOINT": "http://p:8000", "PREFILL_DISCOVER": "dns://prefill:8000"})
    assert (raised.value.file, raised.value.key) == ("environment", "PREFILL_DISCOVER")


async def test_a_discovered_decode_is_checked_against_kv_transfer_port(fake, session, logs):
    """KV_TRANSFER_PORT given to the router and a discovered decode reporting another port: the reported one is used
    and the disagreement is one ERROR naming both, as for a configured decode (discovery.py)."""
    prefill, decode = await fake("prefill"), await fake("decode", kv_port=7123)
    answers = Answers()
    answers.records = {"decode.test": ["127.0.0.1"]}
    pool = PoolConfig(discover=f"dns://decode.test:{decode.url.rsplit(':', 1)[1]}",
                      discover_health_port=int(decode.health_addr.rsplit(":", 1)[1]), discover_interval_ms=60_000)
    config = RouterConfig(prefill=PoolConfig(endpoint=prefill.url, health_addrs=(prefill.health_addr,)), decode=pool,
                          scheduler=SchedulerConfig(health_interval_ms=200), kv_transfer_port=9400)
    metrics = Metrics()
    client = PDClient(Fleet(config, session, metrics, resolver=answers), metrics)
    await client.fleet.start()
    try:
        await wait_for_state(client, decode.url, "up")
        assert backend(client, decode.url).kv_addr == "127.0.0.1:7123"  # the fake reports no kv_host: its address
        [mismatch] = logs.events(events.ROUTER_KV_PORT_MISMATCH)
        assert (mismatch["configured_port"], mismatch["configured_by"], mismatch["reported_port"]) == (9400, "KV_TRANSFER_PORT", 7123)
    finally:
        await client.fleet.close()
