"""The router learns each decode's KV address from the decode's GET /health: before it sends it requests, again whenever it
comes back, and a port the router was given is checked against the report, never used instead of it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from stack.common import events
from stack.common.errors import Overloaded
from stack.router import config as router_config
from stack.router.discovery import KVHint, kv_hints
from tests.unit.router_pd.conftest import backend, wait_for_state, typed

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def test_the_kv_address_is_the_decode_host_and_the_port_it_reports(fake, pd, logs):
    """No KV address configured anywhere: prefill is told the decode's host and the port decode reported."""
    prefill, decode = await fake("prefill"), await fake("decode", kv_port=7123)
    client = await pd([prefill], [decode])
    assert backend(client, decode.url).kv_addr == "127.0.0.1:7123"
    await client.complete("r1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert prefill.seen[0]["kv_transfer_params"]["decode_kv_addr"] == "127.0.0.1:7123"
    [learned] = logs.events(events.BACKEND_KV_ADDR)
    assert learned["backend"] == decode.url and learned["kv_addr"] == "127.0.0.1:7123" and learned["reported_by"] == f"GET {decode.url}/health"
    assert logs.events(events.ROUTER_KV_PORT_MISMATCH) == []
    assert client.health_snapshot()["backends"][0]["kv_addr"] == "127.0.0.1:7123"


async def test_given_ports_that_disagree_are_errors_naming_both_and_the_reported_port_wins(fake, pd, logs):
    """kv_addrs names the KV network's host (kept) and a port (checked), KV_TRANSFER_PORT another port (checked): each
    disagreement is one ERROR naming both values and where each came from; prefill pushes to the reported port."""
    prefill, decode = await fake("prefill"), await fake("decode", kv_port=7123)
    client = await pd([prefill], [decode], kv_addrs=("decode-kv:9300",), kv_transfer_port=9400)
    assert backend(client, decode.url).kv_addr == "decode-kv:7123"
    await client.complete("r1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert prefill.seen[0]["kv_transfer_params"]["decode_kv_addr"] == "decode-kv:7123"
    mismatches = logs.events(events.ROUTER_KV_PORT_MISMATCH)
    assert [(m["configured_port"], m["configured_by"]) for m in mismatches] == [
        (9300, "decode.kv_addrs[0] in <defaults>"), (9400, "KV_TRANSFER_PORT")]
    for m in mismatches:
        assert m["level"] == "ERROR" and m["backend"] == decode.url and m["kv_addr"] == "decode-kv:7123"
        assert m["reported_port"] == 7123 and m["reported_by"] == f"GET {decode.url}/health"
        assert "reports 7123 on GET /health; using 7123" in m["msg"]


async def test_a_given_port_that_agrees_is_silent(fake, pd, logs):
    """KV_TRANSFER_PORT equal to the reported port: no error."""
    client = await pd([await fake("prefill")], [await fake("decode", kv_port=7123)], kv_transfer_port=7123)
    assert client.fleet.scheduler.pool("decode")[0].kv_addr == "127.0.0.1:7123"
    assert logs.events(events.ROUTER_KV_PORT_MISMATCH) == []


def test_hints_name_where_each_given_port_came_from(tmp_path: Path) -> None:
    """From settings.toml and the environment: the kv_addrs host, its port as `decode.kv_addrs[i] in <file>`, KV_TRANSFER_PORT."""
    path = tmp_path / "settings.toml"
    path.write_text('[prefill]\nendpoint = "http://p:8000"\n[decode]\nendpoints = ["http://d1:8000", "http://[fd00::2]:8000"]\n'
                    'kv_addrs = ["kv-d1:9300", "[fd00::12]"]\n')
    config = router_config.load(path, env={"KV_TRANSFER_PORT": "9400"})
    assert kv_hints(config.decode, config.kv_transfer_port, config.source) == {
        "http://d1:8000": KVHint("kv-d1", ((9300, f"decode.kv_addrs[0] in {path}"), (9400, "KV_TRANSFER_PORT"))),
        "http://[fd00::2]:8000": KVHint("[fd00::12]", ((9400, "KV_TRANSFER_PORT"),)),
    }
    path.write_text('[prefill]\nendpoint = "http://p:8000"\n[decode]\nendpoint = "http://[fd00::2]:8000"\n')
    bare = router_config.load(path, env={})
    assert kv_hints(bare.decode, bare.kv_transfer_port, bare.source) == {"http://[fd00::2]:8000": KVHint("[fd00::2]")}  # nothing given


async def test_a_decode_that_reports_no_kv_port_gets_nothing_until_it_does(fake, pd, logs):
    """A decode SERVING but naming no KV port is kept out (503; not even a prefill leg is sent), with the reason logged;
    once it reports one, the monitor lets it in."""
    prefill, decode = await fake("prefill"), await fake("decode", kv_port=None)
    client = await pd([prefill], [decode], health_interval_ms=50)
    assert not backend(client, decode.url).up
    with pytest.raises(Overloaded, match="no decode backend is available"):
        await client.complete("r1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert prefill.seen == [] and decode.seen == []
    [down] = logs.events(events.BACKEND_HEALTH)
    assert down["state"] == "down" and down["reason"] == (
        f"KV address unknown: GET {decode.url}/health reports no kv_port (is the decode engine running with kv_role kv_consumer?)")
    decode.kv_port = 7124
    await wait_for_state(client, decode.url, "up")
    await client.complete("r2", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert prefill.seen[0]["kv_transfer_params"]["decode_kv_addr"] == "127.0.0.1:7124"


async def test_a_decode_coming_back_is_asked_again(fake, pd, logs):
    """A decode that went down and came back on another KV port: prefill pushes to the new one."""
    prefill, decode = await fake("prefill"), await fake("decode", kv_port=7123)
    client = await pd([prefill], [decode], health_interval_ms=50)
    await decode.set_health(False)
    await wait_for_state(client, decode.url, "down")
    decode.kv_port = 7200  # a restarted engine, KV_TRANSFER_PORT changed
    await decode.set_health(True)
    await wait_for_state(client, decode.url, "up")
    await client.complete("r1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert prefill.seen[0]["kv_transfer_params"]["decode_kv_addr"] == "127.0.0.1:7200"
    assert [e["kv_addr"] for e in logs.events(events.BACKEND_KV_ADDR)] == ["127.0.0.1:7123", "127.0.0.1:7200"]


async def test_a_decode_replaced_between_two_probes_is_asked_again(fake, pd, logs):
    """A decode recreated between two health rounds is never seen down (same address, SERVING again), but it reports
    another KV address (a container's hostname changes with it): the next round learns it, without a down state."""
    prefill, decode = await fake("prefill"), await fake("decode", kv_port=7123)
    client = await pd([prefill], [decode], health_interval_ms=50)
    decode.kv_port = 7300
    deadline = asyncio.get_running_loop().time() + 5  # a hang guard: rounds run every 50 ms
    while backend(client, decode.url).kv_addr != "127.0.0.1:7300":
        assert asyncio.get_running_loop().time() < deadline, "the replaced decode's KV address was never learned"
        await asyncio.sleep(0.02)
    await client.complete("r1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert prefill.seen[0]["kv_transfer_params"]["decode_kv_addr"] == "127.0.0.1:7300"
    assert [e["kv_addr"] for e in logs.events(events.BACKEND_KV_ADDR)] == ["127.0.0.1:7123", "127.0.0.1:7300"]
    assert all(e["state"] == "up" for e in logs.events(events.BACKEND_HEALTH))


async def test_a_serving_decode_that_misses_one_kv_answer_keeps_serving(fake, pd, logs):
    """A decode already taking requests whose GET /health stops naming its port keeps the address it gave: only
    a health probe takes a serving backend out."""
    prefill, decode = await fake("prefill"), await fake("decode", kv_port=7123)
    client = await pd([prefill], [decode], health_interval_ms=50)
    decode.kv_port = None
    asked = len(decode.health_asks)
    deadline = asyncio.get_running_loop().time() + 5
    while len(decode.health_asks) < asked + 3:  # three rounds asked and got no port
        assert asyncio.get_running_loop().time() < deadline, "the monitor stopped asking"
        await asyncio.sleep(0.02)
    assert backend(client, decode.url).up and backend(client, decode.url).kv_addr == "127.0.0.1:7123"
    await client.complete("r1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert prefill.seen[0]["kv_transfer_params"]["decode_kv_addr"] == "127.0.0.1:7123"


async def test_without_health_checks_the_address_is_learned_once_at_start(fake, pd):
    """health_interval_ms = 0 (breakers only): the KV address is still asked for, once, before the first request."""
    prefill, decode = await fake("prefill"), await fake("decode", kv_port=7123)
    client = await pd([prefill], [decode], health_interval_ms=0)
    await client.complete("r1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert prefill.seen[0]["kv_transfer_params"]["decode_kv_addr"] == "127.0.0.1:7123"
