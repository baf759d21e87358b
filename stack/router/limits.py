"""Per-key limits: requests/min, tokens/min, requests in flight, and a total token quota.

The policy (which limit, what message, which status and headers) lives here, in `Limiter`; the
counting lives behind one seam, `Counters`, with two implementations: `MemoryCounters` below (the
embedded default: sliding 60-second windows in this process, which reset on restart as a minute
should; the quota reads the persistent totals in `UsageStore`) and `RedisCounters`
(limits_redis.py: the same windows, slots and totals in a Redis every router shares, so limits hold
across router replicas). Token limits are checked before a request (tokens already used) and
charged after it (tokens actually used), like LiteLLM's pre-call check: a request that starts under
the limit may finish a little over it.

Every rejection is a 429. A rate limit (`rate_limit_exceeded`) carries `Retry-After` = seconds until
the window frees enough room; an exhausted quota (`insufficient_quota`) carries
`x-should-retry: false` instead, because waiting does not help (the OpenAI and Anthropic SDKs
honour that header and stop their automatic retries).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from stack.common import events
from stack.common.errors import QuotaExhausted, RateLimited, new_id
from stack.common.logging import log_event
from stack.router.auth import Caller
from stack.router.config import KeyLimits
from stack.router.usage import Usage, UsageStore

WINDOW_S = 60.0
_WHAT = {"concurrency": "{} requests in flight at once", "rpm": "{} requests per minute", "tpm": "{} tokens per minute"}


@dataclass(frozen=True)
class Refusal:
    """Why a key may not start another request now: the limit, where the key stands, and when to retry."""

    limit: str  # quota | concurrency | rpm | tpm
    current: int
    maximum: int
    retry_s: float = 1.0  # seconds until the window frees room (unused for quota)


class Counters(Protocol):
    """Where per-key windows, in-flight slots and totals are kept: one process, or a store routers share."""

    async def take(self, name: str, limits: KeyLimits, slot: str) -> Refusal | None:
        """Atomically check every limit and, if none refuses, hold `slot` and count the request's start."""

    async def give_back(self, name: str, slot: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Free `slot` and charge the tokens the request used to the minute window and the totals."""

    async def totals(self, name: str) -> Usage:
        """The key's totals the quota is checked against."""

    async def in_flight(self, name: str) -> int:
        """The key's requests in flight, on every router that shares these counters."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


@dataclass
class _KeyState:
    requests: deque[float] = field(default_factory=deque)  # start times in the window
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (finish time, tokens) in the window
    token_sum: int = 0
    in_flight: int = 0

    def prune(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]

    def tpm_wait(self, tpm: int, now: float) -> float:
        """Seconds until enough tokens leave the window to be under `tpm` again."""
        remaining = self.token_sum
        for finished, tokens in self.tokens:
            remaining -= tokens
            if remaining < tpm:
                return finished + WINDOW_S - now
        return WINDOW_S


class MemoryCounters:
    """The embedded default: windows and slots in this process; the quota from the usage file's totals."""

    def __init__(self, usage: UsageStore, clock: Callable[[], float] = time.monotonic) -> None:
        self._usage = usage
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}

    async def take(self, name: str, limits: KeyLimits, slot: str) -> Refusal | None:
        state = self._keys.setdefault(name, _KeyState())
        now = self._clock()
        state.prune(now)
        used = self._usage.get(name).total_tokens
        if limits.token_quota and used >= limits.token_quota:
            return Refusal("quota", used, limits.token_quota)
        if limits.max_concurrent and state.in_flight >= limits.max_concurrent:
            return Refusal("concurrency", state.in_flight, limits.max_concurrent)
        if limits.rpm and len(state.requests) >= limits.rpm:
            return Refusal("rpm", len(state.requests), limits.rpm, state.requests[len(state.requests) - limits.rpm] + WINDOW_S - now)
        if limits.tpm and state.token_sum >= limits.tpm:
            return Refusal("tpm", state.token_sum, limits.tpm, state.tpm_wait(limits.tpm, now))
        state.requests.append(now)
        state.in_flight += 1
        return None

    async def give_back(self, name: str, slot: str, prompt_tokens: int, completion_tokens: int) -> None:
        state = self._keys[name]
        state.in_flight -= 1
        tokens = prompt_tokens + completion_tokens
        if tokens:
            state.tokens.append((self._clock(), tokens))
            state.token_sum += tokens

    async def totals(self, name: str) -> Usage:
        return self._usage.get(name)

    async def in_flight(self, name: str) -> int:
        return self._keys[name].in_flight if name in self._keys else 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def _seconds(delay: float) -> int:
    return max(1, math.ceil(delay))


class Limiter:
    """Admits a request for a caller (or raises a 429) and charges it when it finishes."""

    def __init__(self, usage: UsageStore, counters: Counters | None = None) -> None:
        self._usage = usage
        self.counters: Counters = counters if counters is not None else MemoryCounters(usage)
        self._local: Counter[str] = Counter()  # this router's requests in flight per key (its gauge)

    def in_flight(self, key_name: str) -> int:
        """Requests of the key in flight on this router (the shared count: `counters.in_flight`)."""
        return self._local[key_name]

    async def admit(self, caller: Caller) -> str:
        """Take a slot for one request and return its id, or raise QuotaExhausted / RateLimited with the reason."""
        limits, name = caller.limits, caller.name
        slot = new_id()
        refusal = await self.counters.take(name, limits, slot)
        if refusal is None:
            self._local[name] += 1
            return slot
        if refusal.limit == "quota":
            log_event(events.LIMIT_QUOTA, f"key {name!r} used its token quota", "WARNING", key_name=name,
                      used=refusal.current, quota=refusal.maximum)
            raise QuotaExhausted(
                f"Token quota exhausted: key {name!r} has used {refusal.current} of its {refusal.maximum} tokens. "
                "Waiting will not help; ask the operator to raise token_quota.",
                code="insufficient_quota", headers={"x-should-retry": "false"})
        retry = _seconds(refusal.retry_s)
        log_event(events.LIMIT_RATE, f"key {name!r} hit its {refusal.limit} limit", "WARNING", key_name=name,
                  limit=refusal.limit, current=refusal.current, maximum=refusal.maximum, retry_after_s=retry)
        raise RateLimited(f"Rate limit reached for key {name!r}: {_WHAT[refusal.limit].format(refusal.maximum)} "
                          f"({refusal.limit}); retry in {retry} s.",
                          code=f"{refusal.limit}_limit_exceeded", headers={"Retry-After": str(retry)})

    async def release(self, caller: Caller, slot: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Charge the tokens used to the usage totals (the file has them once `UsageStore.durable()` returns), then free
        the slot."""
        self._usage.add(caller.name, prompt_tokens, completion_tokens)
        self._local[caller.name] -= 1
        await self.counters.give_back(caller.name, slot, prompt_tokens, completion_tokens)
