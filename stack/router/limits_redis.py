"""Per-key limits shared by several routers: the windows, slots and totals of limits.py, kept in Redis.

The model is LiteLLM's proxy (`litellm/proxy/hooks/parallel_request_limiter_v3.py`): per-key counters
in Redis, checked and taken in one Lua script so two routers can never both take the last slot, keys
in a `{key_name}` hash tag so a Redis Cluster keeps one key's counters on one shard, and TTLs so
idle counters vanish. Unlike LiteLLM's fixed windows, these are the same sliding minutes as the
in-process limiter (sorted sets scored by the Redis server's own clock, so the routers' clocks do not
matter), and unlike LiteLLM (which falls back to in-memory counters when Redis fails) a router that
cannot reach Redis refuses generation requests with a 503 `limits_unavailable`: N routers falling
back to their own counters would each allow the key's whole limit, and the quota is money.

Each admit is one script call and each release one more; the calls a router makes in one event-loop turn go
to Redis as one pipeline (`_TurnPipeline`), so under load many admits and releases share a round trip, and the
client library's per-command work is paid once a turn, not once a call.

Leak protection: a request in flight holds a slot in `{name}:slots` scored by its lease's expiry.
The router renews its slots every lease/3; a router that dies stops renewing, and every `take` first
drops expired leases, so a crashed router's slots come back within `lease_ms`.

Usage is durable in two places: each router still commits every finished request to its own SQLite
file before it logs `router.request_done` (usage.py; the per-router ledger, which survives losing Redis), and the
shared totals the quota is checked against are a Redis hash, which survives a Redis restart with
append-only persistence (`appendonly yes`, `appendfsync everysec`: the compose profile and the
Kubernetes manifests run Redis so). A charge that fails to reach Redis is kept and retried with the
next renewal, so a short Redis outage does not lose tokens from the quota.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Iterator

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from stack.common import events
from stack.common.errors import Overloaded
from stack.common.logging import log_event
from stack.router.config import KeyLimits, LimitsStoreConfig
from stack.router.limits import WINDOW_S, Refusal
from stack.router.usage import Usage

_WINDOW_MS = int(WINDOW_S * 1000)
_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"

# KEYS: slots, requests, tokens, totals. ARGV: slot, rpm, tpm, max_concurrent, token_quota, lease_ms, window_ms.
# Returns nil (taken) or {limit, current, maximum, retry_ms}. Token entries are "slot:tokens" scored by finish time.
_TAKE = _NOW + """
local slot, rpm, tpm, conc, quota = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local lease, window = tonumber(ARGV[6]), tonumber(ARGV[7])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)  -- leases that ran out: their router died or hung
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - window)
if quota > 0 then
  local used = tonumber(redis.call('HGET', KEYS[4], 'prompt_tokens') or 0) + tonumber(redis.call('HGET', KEYS[4], 'completion_tokens') or 0)
  if used >= quota then return {'quota', used, quota, 0} end
end
if conc > 0 then
  local n = redis.call('ZCARD', KEYS[1])
  if n >= conc then return {'concurrency', n, conc, 1000} end
end
if rpm > 0 then
  local n = redis.call('ZCARD', KEYS[2])
  if n >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[2], n - rpm, n - rpm, 'WITHSCORES')
    return {'rpm', n, rpm, tonumber(oldest[2]) + window - now}
  end
end
if tpm > 0 then
  local entries = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
  local sum = 0
  for i = 1, #entries, 2 do sum = sum + tonumber(string.match(entries[i], ':(%d+)$')) end
  if sum >= tpm then
    local remaining = sum
    for i = 1, #entries, 2 do
      remaining = remaining - tonumber(string.match(entries[i], ':(%d+)$'))
      if remaining < tpm then return {'tpm', sum, tpm, tonumber(entries[i + 1]) + window - now} end
    end
    return {'tpm', sum, tpm, window}
  end
end
redis.call('ZADD', KEYS[1], now + lease, slot)
redis.call('ZADD', KEYS[2], now, slot)
redis.call('PEXPIRE', KEYS[1], lease + window)
redis.call('PEXPIRE', KEYS[2], window)
return nil
"""

# KEYS: slots, tokens, totals. ARGV: slot, prompt_tokens, completion_tokens, window_ms.
_GIVE_BACK = _NOW + """
redis.call('ZREM', KEYS[1], ARGV[1])
local prompt, completion = tonumber(ARGV[2]), tonumber(ARGV[3])
if prompt + completion > 0 then
  redis.call('ZADD', KEYS[2], now, ARGV[1] .. ':' .. (prompt + completion))
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[4]))
end
redis.call('HINCRBY', KEYS[3], 'requests', 1)
redis.call('HINCRBY', KEYS[3], 'prompt_tokens', prompt)
redis.call('HINCRBY', KEYS[3], 'completion_tokens', completion)
return 1
"""

# KEYS: slots. ARGV: lease_ms, slot... Only slots still held are renewed (XX): an expired lease stays freed.
_RENEW = _NOW + """
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i]) end
return 1
"""

# KEYS: slots. Counts live leases only.
_IN_FLIGHT = _NOW + "return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')\n"


_SCRIPTS = {"take": _TAKE, "give_back": _GIVE_BACK, "renew": _RENEW, "in_flight": _IN_FLIGHT}


class _TurnPipeline:
    """The script calls made in one event-loop turn, sent to Redis as one pipeline (one round trip for all of them).

    Each call is still one script, atomic on its own; a pipeline only shares the round trip, so a router under load
    pays one write and one read for every admit and release of a turn instead of one each. The first call of a turn
    starts the sender task, whose first step runs in the next turn, after every call of this one is queued."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._sha = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in _SCRIPTS.items()}
        self._queued: list[tuple[str, list[str], list[object], asyncio.Future[object]]] = []
        self._senders: set[asyncio.Task[None]] = set()  # strong references until each pipeline is answered

    def call(self, script: str, keys: list[str], args: list[object]) -> asyncio.Future[object]:
        loop = asyncio.get_running_loop()
        if not self._queued:
            sender = loop.create_task(self._send(), name="limit-store-pipeline")
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)
        future = loop.create_future()
        self._queued.append((script, keys, args, future))
        return future

    async def _send(self) -> None:
        batch, self._queued = self._queued, []
        try:
            results = await self._execute(batch)
        except Exception as exc:  # Redis unreachable: each caller maps it (a 503, or a charge kept for later)
            results = [exc] * len(batch)
        except asyncio.CancelledError:  # the router shutting down
            for *_, future in batch:
                future.cancel()
            raise
        for (*_, future), result in zip(batch, results):
            if future.done():  # a caller that was cancelled meanwhile
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _execute(self, batch: list[tuple[str, list[str], list[object], asyncio.Future[object]]]) -> list[object]:
        results = await self._pipeline(batch)
        missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if missing:  # a restarted Redis (or SCRIPT FLUSH) forgot the scripts: load them, send those calls again
            for script in {batch[i][0] for i in missing}:
                await self._redis.script_load(_SCRIPTS[script])
            for i, result in zip(missing, await self._pipeline([batch[i] for i in missing])):
                results[i] = result
        return results

    async def _pipeline(self, batch: list[tuple[str, list[str], list[object], asyncio.Future[object]]]) -> list[object]:
        pipe = self._redis.pipeline(transaction=False)
        for script, keys, args, _ in batch:
            pipe.evalsha(self._sha[script], len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)


def _keys(prefix: str, name: str) -> dict[str, str]:
    tag = f"{prefix}{{{name}}}"  # one hash tag per key name: a Redis Cluster keeps them on one shard
    return {part: f"{tag}:{part}" for part in ("slots", "requests", "tokens", "totals")}


class RedisCounters:
    """`Counters` in a Redis shared by every router (see the module doc for the atomicity and leases)."""

    def __init__(self, config: LimitsStoreConfig, password: str | None = None) -> None:
        self.config = config
        timeout = config.timeout_ms / 1000
        # One immediate retry on a fresh connection: a pooled connection goes stale when Redis restarts, and that
        # must not cost a client a 503. Redis really down costs at most two timeouts.
        self._redis = aioredis.Redis.from_url(config.redis_url, password=password or None, socket_timeout=timeout,
                                              socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 1),
                                              retry_on_error=[RedisConnectionError, RedisTimeoutError])
        self._scripts = _TurnPipeline(self._redis)
        self._held: dict[str, set[str]] = {}  # key name -> this router's slots, renewed until given back
        self._unsent: list[tuple[str, str, int, int]] = []  # charges Redis did not take yet; retried each renewal
        self._renewer: asyncio.Task[None] | None = None

    @classmethod
    def from_env(cls, config: LimitsStoreConfig) -> RedisCounters:
        return cls(config, os.environ.get(config.password_env) if config.password_env else None)

    @contextlib.contextmanager
    def _reachable(self, op: str) -> Iterator[None]:
        """The one seam where a Redis failure becomes the client's 503 (never the URL's password: it has none)."""
        try:
            yield
        except (RedisError, OSError) as exc:
            log_event(events.LIMIT_STORE_UNAVAILABLE, f"limit store at {self.config.redis_url} failed during {op}: {exc}",
                      "ERROR", url=self.config.redis_url, op=op, error=f"{type(exc).__name__}: {exc}")
            raise Overloaded("This router cannot reach its shared limit store, so it cannot check the key's limits; "
                             "retry shortly (the operator should check Redis).", code="limits_unavailable",
                             headers={"Retry-After": "2"}) from None

    async def take(self, name: str, limits: KeyLimits, slot: str) -> Refusal | None:
        keys = _keys(self.config.key_prefix, name)
        args = [slot, limits.rpm, limits.tpm, limits.max_concurrent, limits.token_quota, self.config.lease_ms, _WINDOW_MS]
        with self._reachable("take"):
            result = await self._scripts.call("take", [keys["slots"], keys["requests"], keys["tokens"], keys["totals"]], args)
        if result is None:
            self._held.setdefault(name, set()).add(slot)
            return None
        limit, current, maximum, retry_ms = result
        return Refusal(limit.decode() if isinstance(limit, bytes) else limit, int(current), int(maximum), int(retry_ms) / 1000)

    async def give_back(self, name: str, slot: str, prompt_tokens: int, completion_tokens: int) -> None:
        self._held.get(name, set()).discard(slot)
        try:
            await self._charge(name, slot, prompt_tokens, completion_tokens)
        except (RedisError, OSError) as exc:  # the slot's lease frees it; the charge waits for the next renewal
            self._unsent.append((name, slot, prompt_tokens, completion_tokens))
            log_event(events.LIMIT_STORE_UNAVAILABLE, f"limit store at {self.config.redis_url} failed during give_back: {exc}; "
                      "the charge is kept and retried", "ERROR", url=self.config.redis_url, op="give_back",
                      error=f"{type(exc).__name__}: {exc}")

    async def _charge(self, name: str, slot: str, prompt_tokens: int, completion_tokens: int) -> None:
        keys = _keys(self.config.key_prefix, name)
        await self._scripts.call("give_back", [keys["slots"], keys["tokens"], keys["totals"]],
                                 [slot, prompt_tokens, completion_tokens, _WINDOW_MS])

    async def totals(self, name: str) -> Usage:
        with self._reachable("totals"):
            values = await self._redis.hgetall(_keys(self.config.key_prefix, name)["totals"])
        get = {k.decode(): int(v) for k, v in values.items()}
        return Usage(get.get("requests", 0), get.get("prompt_tokens", 0), get.get("completion_tokens", 0))

    async def in_flight(self, name: str) -> int:
        with self._reachable("in_flight"):
            return int(await self._scripts.call("in_flight", [_keys(self.config.key_prefix, name)["slots"]], []))

    async def start(self) -> None:
        """Check Redis answers (a wrong URL is found at start, not at the first request) and start renewing."""
        try:
            await self._redis.ping()
            log_event(events.LIMIT_STORE_CONNECTED, f"per-key limits shared through {self.config.redis_url}",
                      url=self.config.redis_url, lease_ms=self.config.lease_ms)
        except (RedisError, OSError) as exc:  # not fatal: the router starts and answers 503 until Redis is back
            log_event(events.LIMIT_STORE_UNAVAILABLE, f"limit store at {self.config.redis_url} is unreachable at start: {exc}",
                      "ERROR", url=self.config.redis_url, op="start", error=f"{type(exc).__name__}: {exc}")
        self._renewer = asyncio.create_task(self._renew_forever(), name="limit-lease-renewer")

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_ms / 3000)
            try:
                await self.renew()
            except (RedisError, OSError) as exc:
                log_event(events.LIMIT_STORE_UNAVAILABLE, f"limit store at {self.config.redis_url} failed during renew: {exc}",
                          "ERROR", url=self.config.redis_url, op="renew", error=f"{type(exc).__name__}: {exc}")

    async def renew(self) -> None:
        """Extend the leases of this router's slots, and send the charges Redis missed."""
        for name, slots in list(self._held.items()):
            if slots:
                await self._scripts.call("renew", [_keys(self.config.key_prefix, name)["slots"]], [self.config.lease_ms, *slots])
        while self._unsent:
            await self._charge(*self._unsent[0])
            self._unsent.pop(0)

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        with contextlib.suppress(RedisError, OSError):
            await self.renew()  # last chance for charges Redis missed
        await self._redis.aclose()
