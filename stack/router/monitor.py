"""The router's background view of its backends: who is up, where decode takes KV, what the model is called.

    start, then every health_interval_ms: probe every backend (gRPC health for our engines, GET /health for vLLM's)
        NOT_SERVING or unreachable                 → down at once
        no answer in time                          → down after health_timeouts_to_down in a row
        SERVING                                    → up; a pd-push decode first tells its KV address (discovery.py),
                                                     on every return, and stays down until it has; asked again
                                                     every round (a recreated container has a new hostname)
    each backend's window, the engines' model id   → its /v1/models `max_model_len` (asked when it comes up); the
                                                     model id from the decode that answered last
    each backend's capabilities and fingerprint    → settings.toml [prefill]/[decode] `capabilities` when set, else
                                                     its GET /health `capabilities` (asked when it comes up; none
                                                     reported = none of the extras); `capabilities` is what every
                                                     backend a request may reach honours (the intersection)
    vLLM P2pNccl instances (p2pnccl.py Registry)   → join and leave the pools

Every change goes through the Scheduler (`mark`, `add_backend`, `remove_backend`), which wakes the
requests waiting on that role. The /metrics backend gauges are read from here at scrape time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

import aiohttp
from loguru import logger

from stack.common import events
from stack.common.health import NOT_SERVING, SERVING, TIMEOUT, UNREACHABLE, probe_async
from stack.common.logging import log_event
from stack.protocol.capabilities import CPU_ENGINE, FLAGS, Capabilities, from_names
from stack.router.backends import Backend, Breaker, PoolConfig
from stack.router.config import RouterConfig
from stack.router.discovery import KVAddressUnknown, KVDiscovery
from stack.router.metrics import GaugeSample, Metrics
from stack.router.upstream import timeout
from stack.router.scheduler import Scheduler

_BREAKER_STATE = {"closed": 0, "half_open": 1, "open": 2}


class HealthMonitor:
    """Health probes, KV address discovery, model learning and P2pNccl membership (see the module docstring)."""

    def __init__(self, config: RouterConfig, scheduler: Scheduler, session: aiohttp.ClientSession, metrics: Metrics,
                 kv: KVDiscovery | None, clock: Callable[[], float] = time.monotonic) -> None:
        """`kv`: learns pd-push decodes' KV addresses (None: the hand-off needs none); `clock` for joiners' breakers."""
        self.config = config
        self.scheduler = scheduler
        self.session = session
        self.kv = kv
        self.model = config.taotoken.model_id  # the engines' model id once learned; the public one until then
        self.max_model_len: int | None = None  # the decodes' context length (their /v1/models `max_model_len`, vLLM's field)
        # By backend URL: each engine's own window, asked when it comes up. A decode that refuses what its prefill
        # accepted is the client's fault only when the two windows are the same (upstream.LegFailed.after_prefill).
        self.windows: dict[str, int] = {}
        self._capabilities: dict[str, Capabilities] = {}  # by backend URL: learned from GET /health (pools on "auto")
        # By backend URL: the model fingerprint its GET /health reports (our engines), asked with its capabilities.
        # A prefill and a decode are paired only when theirs agree (pairing.py: a rolling model update never mixes them).
        self.fingerprints: dict[str, str] = {}
        self._clock = clock
        self._loop: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        metrics.add_gauges({
            "pd_router_backend_up": "1 if the backend's gRPC health is SERVING (as last probed).",
            "pd_router_backend_in_flight": "Requests the router has in flight on the backend.",
            "pd_router_backend_outstanding_tokens": "Prompt + max tokens the router has outstanding on the backend.",
            "pd_router_backend_circuit": "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
            "pd_router_queue_depth": "Requests waiting for a backend slot.",
            # Per role, so that a pool whose replicas are gone (discover pools drop them: replicas.py) still has a series.
            "pd_router_pool_backends": "Backends in the role's pool (a discover pool: the replicas its DNS name has now).",
            "pd_router_pool_up": "Backends of the role that take requests now (up, circuit not open).",
        }, self._gauges)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """One round before the first request (real states, KV addresses, capabilities, windows and the model id known),
        then the loop."""
        interval_ms = self.config.scheduler.health_interval_ms
        await self._round(probe=bool(interval_ms))  # without probes: the KV addresses, capabilities and windows, once
        if interval_ms:
            self._loop = asyncio.create_task(self._every(interval_ms / 1000), name="pd-health-monitor")

    async def close(self) -> None:
        tasks = [*self._background, *([self._loop] if self._loop else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop = None

    # -- P2pNccl membership (the Registry's callbacks) -------------------------------------------------
    def join(self, role: str, url: str, zmq_address: str) -> None:
        """A registered vLLM P2pNccl instance joins its pool; its health is vLLM's GET /health."""
        pool, settings = (self.config.prefill if role == "prefill" else self.config.decode), self.config.scheduler
        breaker = Breaker(url, settings.breaker_failures, settings.breaker_cooldown_ms / 1000, self._clock)
        backend = Backend(url, role, pool.max_concurrent, f"{url}/health", breaker, "http", kv_addr=zmq_address)  # type: ignore[arg-type]
        self.scheduler.add_backend(backend)
        for learn in (self._learn_capabilities, self._learn_model):
            task = asyncio.get_running_loop().create_task(learn(backend))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def leave(self, url: str) -> None:
        """A registered instance stopped pinging."""
        self.scheduler.remove_backend(url)
        self._capabilities.pop(url, None)
        self.fingerprints.pop(url, None)
        self.windows.pop(url, None)

    # -- health rounds -----------------------------------------------------------------------------
    async def _every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._round(probe=True)
            except Exception:  # noqa: BLE001 - a probe bug must not silently end health checking
                logger.opt(exception=True).error("backend health round failed; retrying next interval")

    async def admit(self, joined: list[Backend]) -> None:
        """Probe backends that just joined a discover pool now, not at the next round (replicas.py: a rolling update's
        replacement must be up before the task it replaces leaves the pool)."""
        await self._round(probe=bool(self.config.scheduler.health_interval_ms), backends=joined)

    async def _round(self, probe: bool, backends: list[Backend] | None = None) -> None:
        # A snapshot (P2pNccl instances may join or leave while the probes run), or the joiners `admit` was given.
        backends = self.scheduler.backends if backends is None else backends
        probe_timeout = min(2.0, max(0.2, self.config.scheduler.health_interval_ms / 1000))
        states: list[str | None] = [None] * len(backends)
        if probe:
            states = list(await asyncio.gather(*(self._probe(b, probe_timeout) for b in backends)))
        verdicts: list[tuple[Backend, bool, str]] = []
        for backend, state in zip(backends, states):
            if state is not None:
                backend.probe_timeouts = backend.probe_timeouts + 1 if state == TIMEOUT else 0
            if state is None or 0 < backend.probe_timeouts < self.config.scheduler.health_timeouts_to_down:
                verdicts.append((backend, backend.up, "unchanged"))  # not probed, or one slow answer: as it was
                continue
            times = f" x{backend.probe_timeouts}" if backend.probe_timeouts else ""
            verdicts.append((backend, state == SERVING, f"{backend.health_check} health {state}{times} at {backend.health_addr}"))
        # A decode coming (back) up may listen on another KV port now: ask before it takes requests. One that stayed
        # up is asked too: a container recreated between two probes keeps its address but not its hostname, the KV
        # host it reports, and prefill cannot resolve the old one. Only a decode not yet taking requests is held back
        # by a failed answer; one already serving keeps its address until a probe says it is down.
        asking = [b for b, up, _ in verdicts if up and self._learns_kv(b)]
        known = {b: b.kv_addr for b in asking}
        answers = await asyncio.gather(*(self._kv_problem(b) for b in asking))
        unknown = {b: problem for b, problem in zip(asking, answers) if problem and (not b.up or known[b] is None)}
        replaced = {b for b in asking if known[b] is not None and b.kv_addr != known[b]}
        # A backend coming (back) up, or replaced, may be another engine version: ask what it can do and its window
        # before it takes requests.
        await asyncio.gather(*(learn(b) for b, up, _ in verdicts if up and (not b.up or b in replaced or b.url not in self._capabilities)
                               for learn in (self._learn_capabilities, self._learn_model)))
        changed = False
        for backend, up, reason in verdicts:
            if unknown.get(backend):
                up, reason = False, f"KV address unknown: {unknown[backend]}"
            changed = self.scheduler.mark(backend, up, reason) or changed

    def _learns_kv(self, backend: Backend) -> bool:
        return self.kv is not None and backend.role == "decode"

    async def _kv_problem(self, decode: Backend) -> str | None:
        """None once `decode`'s KV address is known, else why not."""
        assert self.kv is not None, "KV discovery asked without a discoverer"
        try:
            await self.kv.learn(decode)
        except KVAddressUnknown as exc:
            return str(exc)
        return None

    async def _probe(self, backend: Backend, timeout_s: float) -> str:
        """SERVING, NOT_SERVING, UNREACHABLE or TIMEOUT, over gRPC health or (vLLM engines) GET /health."""
        if backend.health_check == "grpc":
            return await probe_async(backend.health_addr, timeout_s)
        try:
            async with self.session.get(backend.health_addr, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                return SERVING if response.status == 200 else NOT_SERVING
        except asyncio.TimeoutError:
            return TIMEOUT
        except aiohttp.ClientError:
            return UNREACHABLE

    # -- capabilities ----------------------------------------------------------------------------------
    def _pool_config(self, backend: Backend) -> PoolConfig:
        return self.config.prefill if backend.role == "prefill" else self.config.decode

    def backend_capabilities(self, backend: Backend) -> Capabilities | None:
        """What `backend` honours: its pool's setting, else what it reported (None: not asked yet)."""
        declared = self._pool_config(backend).declared
        return declared if declared is not None else self._capabilities.get(backend.url)

    @property
    def capabilities(self) -> Capabilities:
        """What every backend a request may reach honours: the decode and prefill pools' intersection (a
        request goes through a prefill and a decode, either may be picked). Backends not asked yet do not
        count (they take no request before the round that asks them); none known: none of the extras."""
        known = [c for b in self.scheduler.backends if (c := self.backend_capabilities(b)) is not None]
        if not known:
            return CPU_ENGINE
        result = known[0]
        for caps in known[1:]:
            result &= caps
        return result

    @property
    def vllm_fields(self) -> bool:
        """Whether vLLM's own request fields may pass: every pool a request may reach is declared vLLM."""
        return self.config.decode.is_vllm and (self.config.prefill.is_vllm or not (self.config.prefill.urls or self.config.prefill.discover))

    async def _learn_capabilities(self, backend: Backend) -> None:
        """Ask `backend`'s GET /health for its `capabilities` (pools set in settings.toml are not asked)."""
        pool = self._pool_config(backend)
        if pool.declared is not None:
            if backend.url not in self._capabilities:
                self._capabilities[backend.url] = pool.declared
                log_event(events.BACKEND_CAPABILITIES, f"{backend.url}: capabilities set in settings", backend=backend.url,
                          role=backend.role, capabilities=list(pool.declared.names),
                          reported_by=f"{'prefill' if backend.role == 'prefill' else 'decode'}.capabilities in {self.config.source}")
            return
        url = f"{backend.url}/health"
        try:
            # Connection: close: a probe's connection is never pooled, so a request after the backend died still sees
            # "cannot connect" (not a stale connection's reset).
            async with self.session.get(url, headers={"Connection": "close"},
                                        timeout=timeout(self.config.scheduler.connect_timeout_ms, 5000)) as response:
                data = await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return  # asked again when it next comes up
        fingerprint = data.get("fingerprint") if isinstance(data, dict) else None
        if isinstance(fingerprint, str) and fingerprint:
            self.fingerprints[backend.url] = fingerprint
        else:
            self.fingerprints.pop(backend.url, None)
        reported = data.get("capabilities", []) if isinstance(data, dict) else []
        try:  # a newer engine may know flags this router does not: those are ignored
            caps = from_names([n for n in reported if n in FLAGS] if isinstance(reported, list) else [])
        except ValueError:
            caps = CPU_ENGINE
        if self._capabilities.get(backend.url) != caps:
            log_event(events.BACKEND_CAPABILITIES, f"{backend.url}: capabilities {', '.join(caps.names) or 'none'}",
                      backend=backend.url, role=backend.role, capabilities=list(caps.names), reported_by=f"GET {url}")
        self._capabilities[backend.url] = caps

    async def _learn_model(self, backend: Backend) -> None:
        """`backend`'s window and, from a decode, the engines' model id and the decodes' window, from its /v1/models
        (the config's model_id until a decode answers; an engine without the field has no window known)."""
        try:
            async with self.session.get(backend.url + "/v1/models",
                                        timeout=timeout(self.config.scheduler.connect_timeout_ms, 5000)) as response:
                data = await response.json(content_type=None)
            model = data["data"][0]
            window = model.get("max_model_len")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError, AttributeError):
            return  # asked again when it next comes up
        window = window if isinstance(window, int) and not isinstance(window, bool) else None
        if window is None:
            self.windows.pop(backend.url, None)
        else:
            self.windows[backend.url] = window
        if backend.role != "prefill":  # a decode restarted with another window is asked again: its answer holds
            self.model, self.max_model_len = model["id"], window

    def _gauges(self) -> Iterable[GaugeSample]:
        for b in self.scheduler.backends:
            labels = {"backend": b.url, "role": b.role}
            yield "pd_router_backend_up", labels, float(b.up)
            yield "pd_router_backend_in_flight", labels, float(b.in_flight)
            yield "pd_router_backend_outstanding_tokens", labels, float(b.outstanding_tokens)
            yield "pd_router_backend_circuit", labels, float(_BREAKER_STATE[b.breaker.state])
        yield "pd_router_queue_depth", {}, float(self.scheduler.queue_depth)
        for role in self.scheduler.roles:
            pool = self.scheduler.pool(role)
            yield "pd_router_pool_backends", {"role": role}, float(len(pool))
            yield "pd_router_pool_up", {"role": role}, float(sum(b.usable for b in pool))
