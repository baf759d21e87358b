"""vLLM P2pNcclConnector engines register with the router over ZMQ, as they do with vLLM's xPyD proxy.

Wire format (vLLM: `P2pNcclEngine.ping` in vllm/distributed/kv_transfer/kv_connector/v1/p2p/
p2p_nccl_engine.py, and `_listen_for_register` in examples/online_serving/
disaggregated_serving_p2p_nccl_xpyd/disagg_proxy_p2p_nccl_xpyd.py): every instance whose
kv_connector_extra_config names `proxy_ip`/`proxy_port` connects a DEALER socket (identity = its
zmq_address) to that port and sends, every 3 s,

    msgpack {"type": "P" | "D", "http_address": "ip:http_port", "zmq_address": "ip:kv_port"}

The router binds the ROUTER end (`[p2pnccl] registry_port`, with `[scheduler] kv_connector =
"p2pnccl"`), adds each new instance to the prefill or decode pool (monitor.py `join`) and drops one
that has not pinged for `instance_ttl_ms` (vLLM's proxy: 5 s).

The hand-off (handoff.py `P2pNccl`) then differs from the kv_transfer_params ones: both legs carry
the request id that tells the engines where the KV goes (`leg_request_id`), the prefill leg has no
kv_transfer_params and the decode leg is the client's request as is.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from stack.common import events
from stack.common.config import check
from stack.common.logging import log_event
from stack.router.backends import HOST_PORT

_ROLES = {"P": "prefill", "D": "decode"}


@dataclass(frozen=True)
class P2pNcclConfig:
    """[p2pnccl]: off unless registry_port is set (or P2PNCCL_REGISTRY_PORT)."""

    registry_port: int = 0  # the engines' proxy_port (vLLM's proxy uses 30001); 0 = no registry
    instance_ttl_ms: int = 5000  # an instance silent this long is dropped (they ping every 3 s)

    def __post_init__(self) -> None:
        check(0 <= self.registry_port < 65536, "registry_port", f"must be 0..65535, got {self.registry_port}")
        check(self.instance_ttl_ms > 0, "instance_ttl_ms", f"must be > 0, got {self.instance_ttl_ms}")


def leg_request_id(prefill_zmq_address: str, decode_zmq_address: str) -> str:
    """The X-Request-Id both legs carry: P parses the decode address from it (`___decode_addr_(.*):(\\d+)`),
    D the prefill address (`___prefill_addr_(.*):(\\d+)___`); the uuid keeps it unique."""
    return f"___prefill_addr_{prefill_zmq_address}___decode_addr_{decode_zmq_address}_{uuid.uuid4().hex}"


def parse_registration(payload: bytes) -> tuple[str, str, str]:
    """(role, http URL, zmq address) from one ping, or ValueError saying what is wrong with it."""
    try:
        data = msgpack.unpackb(payload)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"not msgpack ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a map, got {type(data).__name__}")
    kind, http, zmq_address = data.get("type"), data.get("http_address"), data.get("zmq_address")
    if kind not in _ROLES:
        raise ValueError(f"type must be 'P' or 'D', got {kind!r}")
    for name, value in (("http_address", http), ("zmq_address", zmq_address)):
        if not isinstance(value, str) or not HOST_PORT.match(value):
            raise ValueError(f"{name} must be host:port, got {value!r}")
    return _ROLES[kind], f"http://{http}", zmq_address


class Registry:
    """The ROUTER socket (bound at construction, so a busy port fails start-up) and the live instances."""

    def __init__(self, config: P2pNcclConfig, host: str = "0.0.0.0") -> None:
        self.config = config
        self._on_join: Callable[[str, str, str], None] = lambda role, url, zmq_address: None
        self._on_leave: Callable[[str], None] = lambda url: None
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{host}:{config.registry_port}")
        self.port = int(self._socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._seen: dict[str, tuple[str, str, float]] = {}  # url -> (role, zmq_address, last ping)
        self._complained: set[bytes] = set()  # senders whose bad pings were logged (once each)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, on_join: Callable[[str, str, str], None], on_leave: Callable[[str], None]) -> None:
        """Listen; `on_join(role, url, zmq_address)` and `on_leave(url)` keep the router's pools."""
        self._on_join, self._on_leave = on_join, on_leave
        self._tasks = [asyncio.create_task(self._receive(), name="p2pnccl-registry"),
                       asyncio.create_task(self._expire(), name="p2pnccl-expiry")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._socket.close()
        self._context.term()

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"role": role, "url": url, "zmq_address": zmq_address, "last_ping_ms": round((now - seen) * 1000)}
                for url, (role, zmq_address, seen) in self._seen.items()]

    async def _receive(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            sender, payload = frames[0], frames[-1]
            try:
                role, url, zmq_address = parse_registration(payload)
            except ValueError as exc:
                if sender not in self._complained:  # an instance pings every 3 s: say it once
                    self._complained.add(sender)
                    log_event(events.P2PNCCL_BAD_PING, f"ignored a registration from {sender!r}: {exc}", "WARNING",
                              sender=sender.decode(errors="replace"), error=str(exc))
                continue
            self._register(role, url, zmq_address)

    def _register(self, role: str, url: str, zmq_address: str) -> None:
        known = self._seen.get(url)
        self._seen[url] = (role, zmq_address, time.monotonic())
        if known is not None and known[:2] == (role, zmq_address):
            return
        if known is not None:  # same HTTP address, new role or KV address: a restarted instance
            self._on_leave(url)
        log_event(events.P2PNCCL_JOINED, f"{role} instance {url} registered (KV at {zmq_address})", role=role,
                  backend=url, zmq_address=zmq_address)
        self._on_join(role, url, zmq_address)

    async def _expire(self) -> None:
        ttl = self.config.instance_ttl_ms / 1000
        while True:
            await asyncio.sleep(ttl / 4)
            deadline = time.monotonic() - ttl
            for url, (role, zmq_address, seen) in list(self._seen.items()):
                if seen < deadline:
                    del self._seen[url]
                    log_event(events.P2PNCCL_LEFT, f"{role} instance {url} stopped pinging; removed", "WARNING",
                              role=role, backend=url, zmq_address=zmq_address)
                    self._on_leave(url)
