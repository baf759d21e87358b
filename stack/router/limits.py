"""Per-key limits: requests/min, tokens/min, requests in flight, and a total token quota.

Rates use sliding 60-second windows kept in memory (they reset on restart, as a minute should);
the quota reads the persistent totals in `UsageStore`, so it survives restarts. Token limits are
checked before a request (tokens already used) and charged after it (tokens actually used), like
LiteLLM's pre-call check: a request that starts under the limit may finish a little over it.

Every rejection is a 429. A rate limit (`rate_limit_exceeded`) carries `Retry-After` = seconds until
the window frees enough room; an exhausted quota (`insufficient_quota`) carries
`x-should-retry: false` instead, because waiting does not help (the OpenAI and Anthropic SDKs
honour that header and stop their automatic retries).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from stack.common import events
from stack.common.errors import QuotaExhausted, RateLimited
from stack.common.logging import log_event
from stack.router.auth import Caller
from stack.router.usage import UsageStore

WINDOW_S = 60.0


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


def _seconds(delay: float) -> int:
    return max(1, math.ceil(delay))


class Limiter:
    """Admits a request for a caller (or raises a 429) and charges it when it finishes."""

    def __init__(self, usage: UsageStore, clock: Callable[[], float] = time.monotonic) -> None:
        self._usage = usage
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}

    def in_flight(self, key_name: str) -> int:
        return self._keys[key_name].in_flight if key_name in self._keys else 0

    def admit(self, caller: Caller) -> None:
        """Take a slot for one request, or raise QuotaExhausted / RateLimited with the reason."""
        limits, name = caller.limits, caller.name
        state = self._keys.setdefault(name, _KeyState())
        now = self._clock()
        state.prune(now)
        used = self._usage.get(name).total_tokens
        if limits.token_quota and used >= limits.token_quota:
            log_event(events.LIMIT_QUOTA, f"key {name!r} used its token quota", "WARNING", key_name=name, used=used, quota=limits.token_quota)
            raise QuotaExhausted(
                f"Token quota exhausted: key {name!r} has used {used} of its {limits.token_quota} tokens. "
                "Waiting will not help; ask the operator to raise token_quota.",
                code="insufficient_quota", headers={"x-should-retry": "false"})
        if limits.max_concurrent and state.in_flight >= limits.max_concurrent:
            self._rate_limited(name, "concurrency", state.in_flight, limits.max_concurrent, 1,
                               f"{limits.max_concurrent} requests in flight at once")
        if limits.rpm and len(state.requests) >= limits.rpm:
            retry = state.requests[len(state.requests) - limits.rpm] + WINDOW_S - now
            self._rate_limited(name, "rpm", len(state.requests), limits.rpm, retry, f"{limits.rpm} requests per minute")
        if limits.tpm and state.token_sum >= limits.tpm:
            self._rate_limited(name, "tpm", state.token_sum, limits.tpm, self._tpm_wait(state, limits.tpm, now),
                               f"{limits.tpm} tokens per minute")
        state.requests.append(now)
        state.in_flight += 1

    def release(self, caller: Caller, prompt_tokens: int, completion_tokens: int) -> None:
        """Free the slot and charge the tokens used to the minute window and the usage file."""
        state = self._keys[caller.name]
        state.in_flight -= 1
        tokens = prompt_tokens + completion_tokens
        if tokens:
            state.tokens.append((self._clock(), tokens))
            state.token_sum += tokens
        self._usage.add(caller.name, prompt_tokens, completion_tokens)

    @staticmethod
    def _tpm_wait(state: _KeyState, tpm: int, now: float) -> float:
        """Seconds until enough tokens leave the window to be under `tpm` again."""
        remaining = state.token_sum
        for finished, tokens in state.tokens:
            remaining -= tokens
            if remaining < tpm:
                return finished + WINDOW_S - now
        return WINDOW_S

    @staticmethod
    def _rate_limited(name: str, limit: str, current: int, maximum: int, retry_s: float, what: str) -> None:
        retry = _seconds(retry_s)
        log_event(events.LIMIT_RATE, f"key {name!r} hit its {limit} limit", "WARNING",
                  key_name=name, limit=limit, current=current, maximum=maximum, retry_after_s=retry)
        raise RateLimited(f"Rate limit reached for key {name!r}: {what} ({limit}); retry in {retry} s.",
                          code=f"{limit}_limit_exceeded", headers={"Retry-After": str(retry)})
