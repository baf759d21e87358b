"""Pool members found by DNS: a `discover = "dns://NAME:PORT"` pool is every address NAME resolves to.

One mechanism for the three orchestrators, because each answers a service name with every replica's address:
compose `--scale` (Docker's embedded DNS: one A record per container of the service), Docker Swarm
(`tasks.<service>`: one per running task) and Kubernetes headless Services (one per ready pod).

    start, then every discover_interval_ms: resolve NAME (aiohttp's resolver: getaddrinfo in a thread)
        a new address        → backend http://ADDR:PORT joins its pool *down* and is probed at once: it takes requests
                               once it is SERVING (a pd-push decode first tells its KV address, discovery.py)
        an address gone      → it leaves the pool, after that round's joiners were probed: no new request goes there;
                               requests in flight hold their Backend and finish (the engine drains on SIGTERM:
                               stack/common/server.py). In a rolling update (Swarm's start-first) the replacement
                               enters DNS as the old task leaves it, often in one answer; the old one keeps serving a
                               few seconds after SIGTERM, so probing the replacement first leaves no moment without one.
        NAME has no address  → the pool empties (scaled to 0; requests get 503 no_<role>_backend + Retry-After)
        the lookup fails     → the pool stays as it was (a DNS hiccup must not empty it); one WARNING per failure streak

A replica's health is gRPC at ADDR:discover_health_port (our engines: 50051), or GET http://ADDR:PORT/health with health_check "http"
(vLLM). Static pools (endpoint/endpoints) are not touched here.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

from aiohttp.abc import AbstractResolver
from aiohttp.resolver import DefaultResolver
from loguru import logger

from stack.common import events
from stack.common.logging import log_event
from stack.router.backends import Backend, Breaker, PoolConfig, Role
from stack.router.scheduler import Scheduler

# What getaddrinfo says when a name has no address (compose/Swarm: no replica running; Kubernetes: none ready).
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class ReplicaWatcher:
    """Keeps one role's pool equal to what its discover name resolves to (see the module docstring)."""

    def __init__(self, pool: PoolConfig, role: Role, scheduler: Scheduler, breaker: tuple[int, float],
                 on_leave: Callable[[str], None], admit: Callable[[list[Backend]], Awaitable[None]],
                 resolver: AbstractResolver | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`breaker`: (failures, cool-down s) for joiners; `on_leave(url)`: forget what was learned about a backend;
        `admit(joined)`: probe joiners now (HealthMonitor.admit)."""
        target = pool.target
        assert target is not None, "a ReplicaWatcher needs a discover pool"
        self.name, self.port = target
        self.pool, self.role, self.scheduler = pool, role, scheduler
        self._breaker, self._on_leave, self._admit, self._clock = breaker, on_leave, admit, clock
        self._resolver = resolver or DefaultResolver()
        self._failing = False  # logged the current failure streak already
        self._task: asyncio.Task[None] | None = None

    def _mine(self) -> dict[str, Backend]:
        return {b.url: b for b in self.scheduler.pool("prefill" if self.role == "prefill" else "decode")}

    async def resolve(self) -> set[str] | None:
        """Every address the name has now; None when the lookup failed (as opposed to: no address)."""
        try:
            answers = await self._resolver.resolve(self.name, self.port, family=socket.AF_UNSPEC)
        except OSError as exc:
            errno = getattr(exc, "errno", None) or getattr(exc.__cause__, "errno", None)
            if errno in _NO_ADDRESS:
                return set()
            if not self._failing:
                log_event(events.DISCOVERY_FAILED, f"cannot resolve {self.pool.discover}: {exc}; the {self.role} pool stays as it was",
                          "WARNING", role=self.role, discover=self.pool.discover, error=f"{type(exc).__name__}: {exc}")
            self._failing = True
            return None
        self._failing = False
        return {answer["host"] for answer in answers}

    def _url(self, address: str) -> tuple[str, str]:
        host = f"[{address}]" if ":" in address else address
        url = f"http://{host}:{self.port}"
        return url, f"{url}/health" if self.pool.health_check == "http" else f"{host}:{self.pool.discover_health_port}"

    async def refresh(self, admit: bool = True) -> None:
        """One resolution, applied: joiners added (down) and probed (unless not `admit`: at start the monitor's first
        round does it), then leavers removed."""
        addresses = await self.resolve()
        if addresses is None:
            return
        current = self._mine()
        wanted = dict(self._url(a) for a in sorted(addresses))
        joined: list[Backend] = []
        for url, health_addr in wanted.items():
            if url in current:
                continue
            threshold, cooldown = self._breaker
            backend = Backend(url, self.role, self.pool.max_concurrent, health_addr, Breaker(url, threshold, cooldown, self._clock),
                              self.pool.health_check)
            backend.up = False  # health-gated: admitted below once SERVING
            self.scheduler.add_backend(backend)
            joined.append(backend)
            log_event(events.DISCOVERY_JOINED, f"{self.role} replica {url} found under {self.pool.discover}; in once healthy",
                      role=self.role, backend=url, discover=self.pool.discover, replicas=len(wanted))
        if joined and admit:
            await self._admit(joined)
        for url, backend in current.items():
            if url in wanted:
                continue
            self.scheduler.remove_backend(url)
            self._on_leave(url)
            log_event(events.DISCOVERY_LEFT, f"{self.role} replica {url} no longer under {self.pool.discover}; "
                      f"{backend.in_flight} request(s) in flight finish there", role=self.role, backend=url,
                      discover=self.pool.discover, replicas=len(wanted), in_flight_requests=backend.in_flight)

    def start(self) -> None:
        self._task = asyncio.create_task(self._every(self.pool.discover_interval_ms / 1000), name=f"pd-replicas-{self.role}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._resolver.close()

    async def _every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a bug here must not silently freeze the pool
                logger.opt(exception=True).error("replica discovery round failed; retrying next interval")
