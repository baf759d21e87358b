"""Where each decode's KV listener is: asked of the decode itself, not configured in several places.

Our engine reports its KV listener's port on GET /health (`kv_port`, stack/engine/server.py). The
health monitor (monitor.py) asks a decode when it becomes healthy and keeps it out of the pool
until it has answered, so no prefill is ever told to push towards a guessed address. The host is
the decode endpoint's host, or the host of its `kv_addrs` entry when the KV network names decode
differently; for a replica found by DNS (replicas.py), the `kv_host` it reports beside `kv_port`. A
port the router was given (KV_TRANSFER_PORT, or a `kv_addrs` entry's port) is a check, not a setting: when it disagrees, `router.kv_port_mismatch` (ERROR) names both values and
where each came from, and the reported port is used.

Only the "pd-push" hand-off needs this: vLLM's connectors carry their own addresses (NIXL in
prefill's kv_transfer_params, P2pNccl in the registration).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from stack.common import events
from stack.common.logging import log_event
from stack.router.backends import HOST, Backend, PoolConfig, split_addr, url_host


class KVAddressUnknown(Exception):
    """A decode did not say where its KV listener is; the message says why."""


@dataclass(frozen=True)
class KVHint:
    """What the router was told about one decode's KV address."""

    host: str  # where prefill reaches the decode's KV listener
    claims: tuple[tuple[int, str], ...] = ()  # (port, where it was given): checked against the reported port, never used


def kv_hints(decode: PoolConfig, kv_transfer_port: int, source: str) -> dict[str, KVHint]:
    """Per decode URL: the KV host and the ports the router was given (`kv_transfer_port` 0: none; `source`: the file)."""
    hints: dict[str, KVHint] = {}
    for i, url in enumerate(decode.urls):
        host, port = split_addr(decode.kv_addrs[i]) if decode.kv_addrs else (url_host(url), None)
        claims = ((port, f"decode.kv_addrs[{i}] in {source}"),) if port else ()
        if kv_transfer_port:
            claims += ((kv_transfer_port, "KV_TRANSFER_PORT"),)
        hints[url] = KVHint(host, claims)
    return hints


def _reported_host(body: dict) -> str | None:
    host = body.get("kv_host")
    return host if isinstance(host, str) and HOST.match(host) else None


class KVDiscovery:
    """Learns decodes' KV addresses from their GET /health (see the module docstring)."""

    def __init__(self, session: aiohttp.ClientSession, hints: dict[str, KVHint], client_timeout: aiohttp.ClientTimeout,
                 kv_transfer_port: int = 0) -> None:
        """`hints`: the configured decodes'; a discovered one's port is checked against `kv_transfer_port` (0: none)."""
        self._session = session
        self._hints = hints
        self._timeout = client_timeout
        self._discovered_claims = ((kv_transfer_port, "KV_TRANSFER_PORT"),) if kv_transfer_port else ()

    async def learn(self, decode: Backend) -> str:
        """Ask `decode` for its KV port and set `decode.kv_addr`; KVAddressUnknown if it cannot say."""
        url = f"{decode.url}/health"
        try:
            async with self._session.get(url, timeout=self._timeout) as response:
                body = await response.json(content_type=None)  # 503 while warming up still names the port
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise KVAddressUnknown(f"GET {url} failed ({type(exc).__name__}: {exc})") from None
        port = body.get("kv_port") if isinstance(body, dict) else None
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise KVAddressUnknown(f"GET {url} reports no kv_port (is the decode engine running with kv_role kv_consumer?)")
        # A configured decode: the host the router was given. A discovered replica (replicas.py): the host it reports
        # (`kv_host`: its hostname, which Docker's DNS resolves on every network the container joins, so prefill
        # reaches it on the KV network; or KV_ADVERTISE_HOST), else the address it was discovered at.
        hint = self._hints.get(decode.url) or KVHint(_reported_host(body) or url_host(decode.url), self._discovered_claims)
        addr = f"{hint.host}:{port}"
        for claimed, given_by in hint.claims:
            if claimed != port:
                log_event(events.ROUTER_KV_PORT_MISMATCH,
                          f"{given_by} says KV port {claimed}, but decode {decode.url} reports {port} on GET /health; using {port}",
                          "ERROR", backend=decode.url, kv_addr=addr, reported_port=port, reported_by=f"GET {url}",
                          configured_port=claimed, configured_by=given_by)
        if addr != decode.kv_addr:
            log_event(events.BACKEND_KV_ADDR, f"decode {decode.url} receives KV at {addr}", backend=decode.url, kv_addr=addr,
                      reported_by=f"GET {url}")
        decode.kv_addr = addr
        return addr
