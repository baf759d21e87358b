"""Which backend gets a request: the [scheduler] settings, the policies, and the bounded wait queue.

`acquire(role, tokens)` returns a backend with a slot taken (and `tokens` added to its
outstanding load); `release(backend, tokens)` gives it back and wakes the oldest waiter. When
every usable backend is full, requests wait up to `queue_timeout_ms` in a queue of at most
`queue_size`; past either bound they get an error with `Retry-After` instead of hanging.

The scheduler owns the pools: backends join and leave (`add_backend`, `remove_backend`) and go up
or down (`mark`) only through it, so every change wakes the requests waiting on that role.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from stack.common import events
from stack.common.config import check
from stack.common.errors import Overloaded, RateLimited
from stack.common.logging import log_event
from stack.router.backends import Backend


@dataclass(frozen=True)
class SchedulerConfig:
    """The [scheduler] table: policy, queue, retries, health, breakers and upstream timeouts."""

    policy: Literal["load_aware", "round_robin"] = "load_aware"  # load_aware = fewest outstanding tokens
    # How prefill hands its KV to decode (handoff.py; KV_CONNECTOR overrides): "pd-push" = our engines (prefill pushes
    # to the KV port decode reports on GET /health), "nixl" = vLLM NixlConnector (prefill's kv_transfer_params go to
    # decode unchanged), "p2pnccl" = vLLM P2pNcclConnector (engines register on [p2pnccl] registry_port; the KV route
    # is in the request id). Identical prefill and decode endpoints are colocated whatever this says: one request.
    kv_connector: Literal["pd-push", "nixl", "p2pnccl"] = "pd-push"
    kv_transfer_timeout_ms: int = 5000  # the article's; the decode leg may wait this long for KV before its first token
    # vLLM NixlConnector frees the prefill's blocks this long after the prefill finished unless a decode pulls them
    # (its kv_connector_extra_config kv_lease_duration, 30 s by default; a late pull reads freed blocks and still answers
    # 200): the router never sends a decode leg later than this after the prefill answered; it re-picks the pair.
    kv_lease_ms: int = 30_000
    queue_size: int = 256  # requests allowed to wait for a backend slot; more get 429 + Retry-After
    queue_timeout_ms: int = 10_000  # longest wait for a slot; then 503 + Retry-After
    max_retries: int = 2  # extra attempts after a retryable failure (another prefill; or a new pair before decode's first byte)
    # Health probe period; 0 = no active checks (breakers only, and decode KV addresses are learned once, at start).
    health_interval_ms: int = 2000
    # Probe timeouts in a row before a backend counts as down (Kubernetes' failureThreshold): a slow answer on a
    # busy host is not a dead engine. NOT_SERVING or a refused connection takes it out at once.
    health_timeouts_to_down: int = 3
    breaker_failures: int = 5  # consecutive failures that open a backend's circuit
    breaker_cooldown_ms: int = 10_000  # an open circuit lets one trial request through after this
    connect_timeout_ms: int = 2000  # TCP connect to an engine
    prefill_timeout_ms: int = 60_000  # the whole prefill leg (long prompts on CPU take seconds)
    first_token_timeout_ms: int = 30_000  # decode leg: headers + first chunk, on top of kv_transfer_timeout_ms
    idle_timeout_ms: int = 30_000  # longest silence between two chunks of a decode stream
    decode_timeout_ms: int = 120_000  # a non-streamed decode leg, whole (it sends nothing until it is done)
    request_timeout_ms: int = 600_000  # a streamed decode leg, whole (idle_timeout_ms bounds each silence in it)
    # The one bound over everything before a request's first byte (streams) or its whole answer (non-streamed): queue
    # waits, prefill, KV hand-off, retries on other backends. Past it: 504 deadline_exceeded. See worst_case_s().
    deadline_ms: int = 120_000
    default_max_tokens: int = 256  # load estimate for requests that do not say max_tokens

    def __post_init__(self) -> None:
        for name in ("kv_transfer_timeout_ms", "kv_lease_ms", "queue_timeout_ms", "breaker_failures", "breaker_cooldown_ms", "health_timeouts_to_down",
                     "connect_timeout_ms", "decode_timeout_ms", "deadline_ms",
                     "prefill_timeout_ms", "first_token_timeout_ms", "idle_timeout_ms", "request_timeout_ms", "default_max_tokens"):
            check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        for name in ("queue_size", "max_retries", "health_interval_ms"):
            check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")


def worst_case_s(config: SchedulerConfig) -> dict[str, float]:
    """How long a request can take at most, from the settings alone (README "What happens when…", GET /health).

    Before the first byte every wait is bounded twice: by its own leg timeout, and by `deadline_ms` over all of them.
    The legs' own sum (attempts × (queue + prefill tries × (queue + prefill) + KV + first token)) is usually larger than
    the deadline, so the deadline is what a client sees; both are reported.
    """
    tries = config.max_retries + 1
    q, p = config.queue_timeout_ms, config.prefill_timeout_ms
    first_byte_legs = config.queue_timeout_ms + tries * (tries * (q + p) + config.kv_transfer_timeout_ms + config.first_token_timeout_ms)
    json_legs = config.queue_timeout_ms + tries * (tries * (q + p) + config.decode_timeout_ms)
    first_byte = min(first_byte_legs, config.deadline_ms)
    return {
        "first_byte_s": first_byte / 1000,  # a stream's first chunk or an explicit error
        "non_streamed_s": min(json_legs, config.deadline_ms) / 1000,  # a whole non-streamed answer or an explicit error
        "stream_s": (first_byte + config.request_timeout_ms) / 1000,  # a whole stream (each silence ≤ idle_timeout_ms)
        "stream_silence_s": config.idle_timeout_ms / 1000,  # the longest gap between two chunks before an in-band error
        "queue_wait_s": config.queue_timeout_ms / 1000,
    }


class NoBackendAvailable(Overloaded):
    """Every backend of a role is down or has an open circuit (503)."""


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


class Scheduler:
    """Policy choice plus the wait queue, over pools of backends keyed by role."""

    def __init__(self, config: SchedulerConfig, pools: dict[str, list[Backend]]) -> None:
        self.config = config
        self._pools = pools
        self._next = dict.fromkeys(pools, 0)  # round-robin position; also breaks load_aware ties
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {role: deque() for role in pools}
        self.queue_depth = 0

    # -- membership and health ---------------------------------------------------------------------
    @property
    def backends(self) -> tuple[Backend, ...]:
        """Every backend of every pool (a snapshot: the pools may change while the caller awaits)."""
        return tuple(b for pool in self._pools.values() for b in pool)

    def pool(self, role: str) -> tuple[Backend, ...]:
        return tuple(self._pools[role])

    def add_backend(self, backend: Backend) -> None:
        """A backend joins its role's pool; waiters re-check (one of them may take it at once)."""
        role = self.role_of(backend)
        self._pools[role].append(backend)
        self._wake_all(role)

    def remove_backend(self, url: str) -> None:
        """No new requests go to `url` (those in flight finish or fail on their own); waiters re-check, and fail fast
        if nothing usable is left."""
        for role, pool in self._pools.items():
            if any(b.url == url for b in pool):
                pool[:] = [b for b in pool if b.url != url]
                self._wake_all(role)

    def mark(self, backend: Backend, up: bool, reason: str) -> bool:
        """Record a backend's health (logged by Backend.set_up); on a change, waiters re-check. True if it changed."""
        changed = backend.set_up(up, reason)
        if up and backend.breaker.probe_ok():  # SERVING: an open circuit goes half-open at once
            changed = True
        if changed:
            self._wake_all(self.role_of(backend))
        return changed

    # -- slots -------------------------------------------------------------------------------------------
    def _pick(self, role: str, exclude: Collection[Backend]) -> Backend | None:
        pool = self._pools[role]
        start = self._next[role]
        ready = [b for b in (pool[(start + i) % len(pool)] for i in range(len(pool))) if b.has_slot and b not in exclude and b.usable]
        if not ready:
            return None
        chosen = ready[0] if self.config.policy == "round_robin" else min(ready, key=lambda b: (b.outstanding_tokens, b.in_flight))
        self._next[role] = (pool.index(chosen) + 1) % len(pool)
        return chosen

    def _check_usable(self, role: str, exclude: Collection[Backend]) -> None:
        candidates = [b for b in self._pools[role] if b not in exclude]
        if any(b.usable for b in candidates):
            return
        down = [b.url for b in candidates if not b.up]
        open_ = [b for b in candidates if b.up]
        wait = min((b.breaker.retry_after_s() for b in open_), default=self.config.health_interval_ms / 1000)
        detail = "; ".join(filter(None, [f"down: {', '.join(down)}" if down else "",
                                         f"circuit open: {', '.join(b.url for b in open_)}" if open_ else ""]))
        raise NoBackendAvailable(f"no {role} backend is available ({detail or 'none configured or registered'})", code=f"no_{role}_backend",
                                 headers=_retry_after(wait))

    async def acquire(self, role: str, tokens: int, exclude: Collection[Backend] = ()) -> Backend:
        """A backend of `role` with a slot taken for this request; waits in the queue if all are full."""
        backend = self._pick(role, exclude)
        if backend is None:
            self._check_usable(role, exclude)
            backend = await self._wait(role, exclude)
        backend.take(tokens)
        return backend

    async def _wait(self, role: str, exclude: Collection[Backend]) -> Backend:
        if self.queue_depth >= self.config.queue_size:
            log_event(events.ROUTER_QUEUE_FULL, f"every {role} slot is busy and the queue is full", "WARNING",
                      role=role, queue_depth=self.queue_depth, retry_after_s=1)
            raise RateLimited(f"the server is at capacity ({self.queue_depth} requests already queued); retry shortly",
                              code="queue_full", headers=_retry_after(1))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.queue_timeout_ms / 1000
        self.queue_depth += 1
        log_event(events.ROUTER_QUEUED, f"every {role} slot is busy; queued", role=role, queue_depth=self.queue_depth)
        waiters = self._waiters[role]
        first = True
        try:
            while True:
                waiter: asyncio.Future[None] = loop.create_future()
                # A waiter that was woken but lost the slot to a newcomer keeps its place at the front.
                waiters.append(waiter) if first else waiters.appendleft(waiter)
                first = False
                try:
                    async with asyncio.timeout_at(deadline):
                        await waiter
                except TimeoutError:
                    if waiter.done() and not waiter.cancelled():
                        self._wake(role)
                    waited = self.config.queue_timeout_ms / 1000
                    log_event(events.ROUTER_QUEUE_FULL, f"no {role} slot freed within {waited:g}s", "WARNING",
                              role=role, queue_depth=self.queue_depth, retry_after_s=1)
                    raise Overloaded(f"no {role} backend slot became free within {waited:g}s; retry shortly",
                                     code="queue_timeout", headers=_retry_after(1)) from None
                except BaseException:
                    if waiter.done() and not waiter.cancelled():
                        self._wake(role)  # pass on a wake-up this request can no longer use
                    raise
                finally:
                    if waiter in waiters:
                        waiters.remove(waiter)
                backend = self._pick(role, exclude)
                if backend is not None:
                    return backend
                self._check_usable(role, exclude)
        finally:
            self.queue_depth -= 1

    def _wake(self, role: str) -> None:
        waiters = self._waiters[role]
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def release(self, backend: Backend, tokens: int) -> None:
        """Give back a slot taken by `acquire` (or the rest of its tokens) and wake the oldest waiter."""
        backend.give_back(tokens)
        self._wake(self.role_of(backend))

    def _wake_all(self, role: str) -> None:
        """The pool or its health changed: let every waiter re-check (and fail fast if nothing is usable)."""
        for waiter in self._waiters[role]:
            if not waiter.done():
                waiter.set_result(None)

    @staticmethod
    def role_of(backend: Backend) -> str:
        return "prefill" if backend.role == "prefill" else "decode"
