"""vLLM P2pNccl engines register with the router over ZMQ, and requests are routed through whoever registered.

The instances are fake engines (HTTP) plus a pinger doing what vLLM's `P2pNcclEngine.ping` does
(wire format cited in stack/router/p2pnccl.py); the router is the whole app, started as users run it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from doctor.findings import Finding
from stack.common import events
from stack.common.config import ConfigError
from stack.router import config as router_config
from stack.router.app import create_app
from stack.router.p2pnccl import leg_request_id, parse_registration
from tests.unit.doctor.helpers import diagnose
from tests.unit.router_pd.conftest import free_port
from tests.unit.router_pd.fake_engine import chunk_text

KEY = "pd-test-key-0123456789abcdefghij"
MODEL = "public-model"
# How vLLM's P2pNcclConnector reads the request id (parse_request_id): the producer finds the decode's
# address, the consumer the prefill's.
VLLM_PRODUCER_RE = r"___decode_addr_(.*):(\d+)"
VLLM_CONSUMER_RE = r"___prefill_addr_(.*):(\d+)___"


class VllmPinger:
    """One vLLM instance's registration: a DEALER socket whose identity is its zmq_address, sending
    msgpack {"type", "http_address", "zmq_address"} to the proxy port at an interval (vLLM: 3 s)."""

    def __init__(self, registry_port: int, kind: str, http_address: str, zmq_address: str, interval_s: float = 0.05,
                 payload: bytes | None = None) -> None:
        """`payload` replaces the registration (a sender that speaks something else)."""
        self.payload = payload or msgpack.packb({"type": kind, "http_address": http_address, "zmq_address": zmq_address})
        self.sent = 0
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt_string(zmq.IDENTITY, zmq_address)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://127.0.0.1:{registry_port}")
        self.interval_s = interval_s
        self.task: asyncio.Task[None] | None = None

    async def _ping(self) -> None:
        while True:
            await self.socket.send(self.payload)
            self.sent += 1
            await asyncio.sleep(self.interval_s)

    def start(self) -> VllmPinger:
        self.task = asyncio.create_task(self._ping())
        return self

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None

    async def close(self) -> None:
        await self.stop()
        self.socket.close()
        self.context.term()


def write_settings(tmp_path: Path, registry_port: int, ttl_ms: int = 600) -> Path:
    """Settings with no engine endpoints at all: the pools are whoever registers."""
    path = tmp_path / "p2pnccl.toml"
    path.write_text(f"""
[server]
host = "127.0.0.1"
[taotoken]
api_key_env = "PD_TEST_KEY"
model_id = "{MODEL}"
[scheduler]
kv_connector = "p2pnccl"
health_interval_ms = 100
max_retries = 0
[usage]
db_path = "{tmp_path / 'usage.sqlite3'}"
[p2pnccl]
registry_port = {registry_port}
instance_ttl_ms = {ttl_ms}
""")
    return path


@pytest.fixture
async def pingers():
    made: list[VllmPinger] = []

    def make(*args: Any) -> VllmPinger:
        made.append(VllmPinger(*args).start())
        return made[-1]

    yield make
    for pinger in made:
        await pinger.close()


async def health(router: Any) -> dict[str, Any]:
    return await (await router.get("/health")).json()


async def wait_for_instances(router: Any, count: int, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while len((body := await health(router))["p2pnccl_instances"]) != count:
        assert time.monotonic() < deadline, f"expected {count} registered instances, /health says {body}"
        await asyncio.sleep(0.02)
    return body


def chat(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": stream}


AUTH = {"Authorization": f"Bearer {KEY}"}


def doctor(tmp_path: Path, lines: list[dict[str, Any]]) -> dict[str, Finding]:
    """What `python -m doctor diagnose --logs router.log` finds in these router log lines."""
    path = tmp_path / "router.log"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    findings, _ = diagnose(str(path))
    return {f.id: f for f in findings}


async def wait_for_event(logs: Any, name: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not logs.events(name):
        assert time.monotonic() < deadline, f"{name} was never logged"
        await asyncio.sleep(0.02)


def test_registration_is_read_as_vllm_sends_it() -> None:
    """vLLM's ping (msgpack map) gives role, URL and KV address; anything else is a precise error."""
    ping = msgpack.packb({"type": "D", "http_address": "10.0.1.3:8000", "zmq_address": "10.0.1.3:22001"})
    assert parse_registration(ping) == ("decode", "http://10.0.1.3:8000", "10.0.1.3:22001")
    bad = {
        b"\xc1": "not msgpack",
        msgpack.packb([1, 2]): "expected a map",
        msgpack.packb({"type": "X", "http_address": "a:1", "zmq_address": "a:2"}): "type must be 'P' or 'D'",
        msgpack.packb({"type": "P", "http_address": "no-port", "zmq_address": "a:2"}): "http_address must be host:port",
        msgpack.packb({"type": "P", "http_address": "a:1"}): "zmq_address must be host:port",
    }
    for payload, words in bad.items():
        with pytest.raises(ValueError, match=words):
            parse_registration(payload)


def test_leg_request_id_carries_both_kv_addresses_as_vllm_parses_them() -> None:
    """The producer finds the decode's zmq address in the id and the consumer the prefill's; ids never repeat."""
    rid = leg_request_id("10.0.1.2:21001", "10.0.1.3:22001")
    assert re.search(VLLM_PRODUCER_RE, rid).groups() == ("10.0.1.3", "22001")  # type: ignore[union-attr]
    assert re.search(VLLM_CONSUMER_RE, rid).groups() == ("10.0.1.2", "21001")  # type: ignore[union-attr]
    assert rid != leg_request_id("10.0.1.2:21001", "10.0.1.3:22001")


async def test_registered_instances_serve_and_leave(fake, pingers, aiohttp_client, tmp_path, logs) -> None:
    """No instance: 503. P and D register: a streamed chat goes P (max_tokens 1, no kv_transfer_params) then D (the
    client's request), both legs under one id naming both KV addresses. D stops pinging: it is dropped, 503 again."""
    port = free_port()
    router = await aiohttp_client(create_app(router_config.load(write_settings(tmp_path, port), env={}), env={"PD_TEST_KEY": KEY}))
    empty = await router.post("/v1/chat/completions", json=chat(False), headers=AUTH)
    assert empty.status == 503 and "no decode backend" in (await empty.json())["error"]["message"]

    prefill, decode = await fake("prefill"), await fake("decode")
    pingers(port, "P", prefill.url.removeprefix("http://"), "127.0.0.1:21001")
    d_pinger = pingers(port, "D", decode.url.removeprefix("http://"), "127.0.0.1:22001")
    body = await wait_for_instances(router, 2)
    assert {(b["role"], b["url"]) for b in body["backends"]} == {("prefill", prefill.url), ("decode", decode.url)}

    response = await router.post("/v1/chat/completions", json=chat(True), headers=AUTH)
    text = await response.text()
    assert response.status == 200 and text.endswith("data: [DONE]\n\n")
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert chunk_text(chunks) == "t0 t1 t2 t3 "
    [p_leg], [d_leg] = prefill.seen, decode.seen
    assert p_leg["max_tokens"] == 1 and p_leg["stream"] is False and "kv_transfer_params" not in p_leg
    assert d_leg["stream"] is True and d_leg["max_tokens"] == 4 and "kv_transfer_params" not in d_leg
    rid = p_leg["headers"]["X-Request-ID"]
    assert d_leg["headers"]["X-Request-ID"] == rid
    assert re.search(VLLM_PRODUCER_RE, rid).groups() == ("127.0.0.1", "22001")  # type: ignore[union-attr]
    assert re.search(VLLM_CONSUMER_RE, rid).groups() == ("127.0.0.1", "21001")  # type: ignore[union-attr]
    assert logs.events(events.ROUTER_PREFILL_DONE)[-1]["transfer_id"] == rid

    await d_pinger.stop()
    await wait_for_instances(router, 1)
    assert [e["backend"] for e in logs.events(events.P2PNCCL_LEFT)] == [decode.url]
    gone = await router.post("/v1/chat/completions", json=chat(False), headers=AUTH)
    assert gone.status == 503 and len(decode.seen) == 1
    # The doctor, from the router's log alone: the decode was dropped (not "never registered").
    found = doctor(tmp_path, logs.lines)
    assert found["p2pnccl.left"].severity == "warning" and "docker compose logs decode" in found["p2pnccl.left"].fix
    assert "p2pnccl.no_decode" not in found


async def test_the_doctor_names_the_engine_that_never_registered(fake, pingers, aiohttp_client, tmp_path, logs) -> None:
    """Only a prefill registers: requests get 503, and the doctor says no decode registered, with the proxy fix;
    a stranger's pings on the port are a separate warning."""
    port = free_port()
    router = await aiohttp_client(create_app(router_config.load(write_settings(tmp_path, port), env={}), env={"PD_TEST_KEY": KEY}))
    prefill = await fake("prefill")
    pingers(port, "P", prefill.url.removeprefix("http://"), "127.0.0.1:21001")
    pingers(port, "X", "not-an-engine:1", "not-an-engine:2")
    await wait_for_instances(router, 1)
    for _ in range(2):
        assert (await router.post("/v1/chat/completions", json=chat(False), headers=AUTH)).status == 503
    await wait_for_event(logs, events.P2PNCCL_BAD_PING)
    found = doctor(tmp_path, logs.lines)
    missing = found["p2pnccl.no_decode"]
    assert missing.severity == "error" and "2 request(s)" in missing.title and len(missing.request_ids) == 2
    assert "proxy_ip" in missing.fix and "kv_consumer" in missing.cause
    assert "(registry)" in " ".join(e.line for e in missing.evidence)
    assert "type must be 'P' or 'D'" in found["p2pnccl.bad_ping"].cause
    assert "p2pnccl.no_prefill" not in found and len(prefill.seen) == 0


async def test_a_ping_not_in_vllm_format_is_logged_once_and_ignored(fake, pingers, aiohttp_client, tmp_path, logs) -> None:
    """A stranger on the registry port (or another protocol) registers nothing; its first bad ping is logged, not every one."""
    port = free_port()
    router = await aiohttp_client(create_app(router_config.load(write_settings(tmp_path, port), env={}), env={"PD_TEST_KEY": KEY}))
    stranger = pingers(port, "P", "", "stranger:1", 0.01, json.dumps({"type": "P"}).encode())
    await wait_for_event(logs, events.P2PNCCL_BAD_PING)
    sent = stranger.sent
    deadline = time.monotonic() + 10
    while stranger.sent < sent + 5:  # several more bad pings from the same sender
        assert time.monotonic() < deadline, "the stranger stopped pinging"
        await asyncio.sleep(0.01)
    await stranger.stop()
    # The same socket then speaks vLLM's format: once that registers, every bad ping before it was read (one
    # connection is FIFO), so the count below is final.
    prefill = await fake("prefill")
    stranger.payload = msgpack.packb({"type": "P", "http_address": prefill.url.removeprefix("http://"), "zmq_address": "stranger:1"})
    stranger.start()
    body = await wait_for_instances(router, 1)
    [bad] = logs.events(events.P2PNCCL_BAD_PING)
    assert bad["sender"] == "stranger:1" and bad["level"] == "WARNING"
    assert [i["url"] for i in body["p2pnccl_instances"]] == [prefill.url]  # only the good ping registered anything


def test_a_taken_registry_port_is_a_config_error(tmp_path) -> None:
    """The registry port already in use stops start-up with one line naming the key, not a traceback."""
    context = zmq.Context()
    holder = context.socket(zmq.ROUTER)
    port = holder.bind_to_random_port("tcp://0.0.0.0")
    try:
        with pytest.raises(ConfigError, match="p2pnccl.registry_port: cannot listen on port"):
            create_app(router_config.load(write_settings(tmp_path, port), env={}), env={"PD_TEST_KEY": KEY})
    finally:
        holder.close(linger=0)
        context.term()
