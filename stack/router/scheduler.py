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
from stack.common.metrics import Counter
from stack.router import affinity
from stack.router.affinity import Affinity, Guard
from stack.router.backends import Backend
from stack.router.handoff import HandoffSettings


@dataclass(frozen=True)
class SchedulerConfig(HandoffSettings):
    """The [scheduler] table: policy, queue, retries, health, breakers and upstream timeouts (kv_*: handoff.py)."""

    # load_aware = fewest outstanding tokens; cache_aware = session / prompt-prefix affinity with an imbalance guard,
    # load_aware for requests without a key (affinity.py)
    policy: Literal["load_aware", "round_robin", "cache_aware"] = "load_aware"
    affinity_prefix_chars: int = 2048  # cache_aware without a session header: characters of the prompt hashed
    # cache_aware's imbalance guard (vllm-router's defaults): the preferred backend is skipped when it has more than
    # this many requests in flight beyond the least loaded one AND more than balance_rel_threshold times as many
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
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
    # Leg timeouts (deadlines.py, docs/deadlines.md). A prompt's prefill may take work_s(T) = T / prefill_tokens_per_s
    # × (1 + T / prefill_attention_tokens) on top of the fixed budgets below, T its size (characters, capped at the
    # window): the prefill leg, the request's deadline, and a decode leg that computes the prompt itself grow by it.
    connect_timeout_ms: int = 2000  # TCP connect to an engine
    prefill_timeout_ms: int = 60_000  # the whole prefill leg of a short prompt (KV push included)
    # The slowest prefill throughput on short prompts the budgets allow (a loaded 2-core host running dummy:small;
    # a 60k-token prompt then gets ~43 min, room for what it takes there).
    prefill_tokens_per_s: int = 250
    # The prompt length at which attention costs as much as the rest of a prefill: parameters / (layers × width)
    # (dummy:small ~6k, a 7B model ~53k); 0 = no quadratic term.
    prefill_attention_tokens: int = 6144
    first_token_timeout_ms: int = 30_000  # decode leg: headers + first chunk, on top of kv_transfer_timeout_ms
    idle_timeout_ms: int = 30_000  # longest silence between two chunks of a decode stream
    decode_timeout_ms: int = 120_000  # a non-streamed decode leg, whole (it sends nothing until it is done)
    request_timeout_ms: int = 600_000  # a streamed decode leg, whole (idle_timeout_ms bounds each silence in it)
    # The one bound over everything before a request's first byte (streams) or its whole answer (non-streamed): queue
    # waits, prefill, KV hand-off, retries on other backends; a long prompt adds its work_s. Past it: 504
    # deadline_exceeded. See deadlines.worst_case_s().
    deadline_ms: int = 120_000
    default_max_tokens: int = 256  # load estimate for requests that do not say max_tokens

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("queue_timeout_ms", "breaker_failures", "breaker_cooldown_ms", "health_timeouts_to_down",
                     "connect_timeout_ms", "decode_timeout_ms", "deadline_ms", "prefill_tokens_per_s",
                     "prefill_timeout_ms", "first_token_timeout_ms", "idle_timeout_ms", "request_timeout_ms", "default_max_tokens"):
            check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        for name in ("queue_size", "max_retries", "health_interval_ms", "balance_abs_threshold", "prefill_attention_tokens"):
            check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        check(self.affinity_prefix_chars > 0, "affinity_prefix_chars", f"must be > 0, got {self.affinity_prefix_chars}")
        check(self.balance_rel_threshold >= 1.0, "balance_rel_threshold",
              f"must be >= 1.0 (a ratio of in-flight requests), got {self.balance_rel_threshold}")

    @property
    def guard(self) -> Guard:
        return Guard(self.balance_abs_threshold, self.balance_rel_threshold)


class NoBackendAvailable(Overloaded):
    """Every backend of a role is down or has an open circuit (503)."""


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


class Scheduler:
    """Policy choice plus the wait queue, over pools of backends keyed by role."""

    def __init__(self, config: SchedulerConfig, pools: dict[str, list[Backend]], decisions: Counter | None = None) -> None:
        """`decisions` counts cache_aware's choices by role, backend and decision (the router's /metrics)."""
        self.config = config
        self._pools = pools
        self._decisions = decisions
        self._next = dict.fromkeys(pools, 0)  # round-robin position; also breaks load_aware ties
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {role: deque() for role in pools}
        self.queue_depth = 0

    # -- membership and health ---------------------------------------------------------------------
    @property
    def backends(self) -> tuple[Backend, ...]:
        """Every backend of every pool (a snapshot: the pools may change while the caller awaits)."""
        return tuple(b for pool in self._pools.values() for b in pool)

    @property
    def roles(self) -> tuple[str, ...]:
        """The pools' roles: "decode", and "prefill" when disaggregated."""
        return tuple(self._pools)

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
    def _pick(self, role: str, exclude: Collection[Backend], key: Affinity | None) -> Backend | None:
        pool = self._pools[role]
        start = self._next[role]
        usable = [b for b in (pool[(start + i) % len(pool)] for i in range(len(pool))) if b not in exclude and b.usable]
        ready = [b for b in usable if b.has_slot]
        if not ready:
            return None
        if self.config.policy == "round_robin":
            chosen = ready[0]
        elif self.config.policy == "cache_aware":
            chosen, decision = affinity.choose(key, usable, ready, self.config.guard) if key else (affinity.least_loaded(ready), "no_key")
            if self._decisions is not None:
                self._decisions.inc(role=role, backend=chosen.url, decision=decision)
        else:
            chosen = affinity.least_loaded(ready)
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

    async def acquire(self, role: str, tokens: int, exclude: Collection[Backend] = (), key: Affinity | None = None) -> Backend:
        """A backend of `role` with a slot taken for this request; waits in the queue if all are full. `key` (session
        or prompt prefix) steers the pick under policy cache_aware."""
        backend = self._pick(role, exclude, key)
        if backend is None:
            self._check_usable(role, exclude)
            backend = await self._wait(role, exclude, key)
        backend.take(tokens)
        return backend

    async def _wait(self, role: str, exclude: Collection[Backend], key: Affinity | None) -> Backend:
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
                backend = self._pick(role, exclude, key)
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
