"""The engines the router serves from: the hand-off kind, the pools and their scheduler, health, discovery.

Built once from settings.toml by the app's wiring (app.py `_lifecycle`), before the PD client that runs requests
over it: which hand-off runs (handoff.py), the prefill and decode pools (backends.py; empty when engines register,
p2pnccl.py), their scheduler, the health monitor that gates them and learns decode's KV address, and the DNS
watchers of discover pools (replicas.py). Its ops calls (the tokenizer endpoints) take no slot.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver

from stack.common import events, json_text
from stack.common.logging import log_event
from stack.router.backends import build_pool, is_colocated
from stack.router.config import RouterConfig
from stack.router.deadlines import worst_case_s
from stack.router.discovery import KVDiscovery, kv_hints
from stack.router.engine_http import EngineHTTP, Response
from stack.router.handoff import handoff_for
from stack.router.metrics import Metrics
from stack.router.monitor import HealthMonitor
from stack.router.replicas import ReplicaWatcher
from stack.router.scheduler import Scheduler
from stack.router.upstream import leg_headers, leg_timeout, timeout


class Fleet:
    """The pools, their scheduler and their health (see the module doc)."""

    def __init__(self, config: RouterConfig, session: aiohttp.ClientSession, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic, resolver: AbstractResolver | None = None) -> None:
        """`clock` times the backends' circuit breakers and the prefill's KV lease (tests pass a fake one); `resolver`
        finds discover pools' replicas (default aiohttp's)."""
        self.settings = s = config.scheduler
        self.handoff = handoff_for(s.kv_connector, same_endpoints=is_colocated(config.prefill, config.decode))
        self.mode = "disaggregated" if self.handoff.prefill_leg else "colocated"
        self.clock = clock
        self.session = session  # health checks, KV discovery
        self.engines = EngineHTTP(session.headers)  # the legs (engine_http.py), with the session's headers: the internal key
        registers = self.handoff.registers
        breaker = (s.breaker_failures, s.breaker_cooldown_ms / 1000)
        decode_role = "decode" if self.handoff.prefill_leg else "both"
        roles = [(config.decode, decode_role)] + ([(config.prefill, "prefill")] if self.handoff.prefill_leg else [])
        pools = {"prefill" if role == "prefill" else "decode": [] if registers else build_pool(pool, role, *breaker, clock)
                 for pool, role in roles}
        self.scheduler = Scheduler(s, pools, metrics.affinity)
        kv = (KVDiscovery(session, kv_hints(config.decode, config.kv_transfer_port, config.source),
                          timeout(s.connect_timeout_ms, 5000), config.kv_transfer_port) if self.handoff.discovers_kv_addr else None)
        self.monitor = HealthMonitor(config, self.scheduler, session, metrics, kv, clock)
        # Discover pools (replicas.py): the members are whatever their DNS name resolves to, health-gated by the monitor.
        self.watchers = [ReplicaWatcher(pool, role, self.scheduler, breaker, self.monitor.leave, self.monitor.admit, resolver, clock)
                         for pool, role in roles if pool.discover and not registers]
        self._sources = {"decode": config.decode.discover or "static", "prefill": config.prefill.discover or "static"}
        self._tokenize_timeout = leg_timeout(s.connect_timeout_ms, s.first_token_timeout_ms)

    async def start(self) -> None:
        """The discover pools' first members, then the monitor's first round over them (real states), then both loops."""
        await asyncio.gather(*(watcher.refresh(admit=False) for watcher in self.watchers))  # the first round probes them
        await self.monitor.start()
        for watcher in self.watchers:
            watcher.start()
        bounds = self.worst_case_s()  # after the first round: the engines told their window
        log_event(events.ROUTER_BOUNDS, f"a request ends within {bounds['first_byte_s']:g}s to its first byte, "
                  f"{bounds['non_streamed_s']:g}s non-streamed, {bounds['stream_s']:g}s streamed (a prompt of "
                  f"{bounds['window_tokens'] or 'unknown'} tokens)", worst_case_s=bounds)

    async def close(self) -> None:
        await asyncio.gather(*(watcher.close() for watcher in self.watchers))
        await self.monitor.close()
        await self.engines.close()

    def worst_case_s(self) -> dict[str, Any]:
        """The request time bounds at the engines' window (deadlines.py)."""
        return worst_case_s(self.settings, self.monitor.max_model_len)

    def health_snapshot(self) -> dict[str, Any]:
        return {"mode": self.mode, "kv_connector": self.handoff.kind, "policy": self.settings.policy,
                "queue_depth": self.scheduler.queue_depth, "worst_case_s": self.worst_case_s(), "pools": self.pools(),
                "backends": [b.snapshot() for b in self.scheduler.backends]}

    def pools(self) -> dict[str, dict[str, Any]]:
        """Per role: where its members come from (a discover name, or "static"), how many there are, how many are up, and
        how many report each model fingerprint (one during normal operation; two while a model update rolls)."""
        fingerprints = self.monitor.fingerprints
        return {role: {"source": self._sources[role], "backends": len(pool), "up": sum(b.usable for b in pool),
                       "models": dict(Counter(fingerprints[b.url] for b in pool if b.url in fingerprints))}
                for role in ("prefill", "decode") if role in self.scheduler.roles for pool in (self.scheduler.pool(role),)}

    async def tokenizer_call(self, request_id: str, path: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        """POST `body` to vLLM's `path` (/tokenize, /detokenize) on a usable decode: (status, JSON answer), or None
        when no decode answers. Takes no slot (issue 10: the router's /tokenize, exact prompt counts). On the legs'
        client: a streamed Anthropic message asks this with its whole prompt (message_start's input_tokens), unless
        the context clamp counted it already."""
        payload = json_text.compact(body)
        for backend in self.scheduler.pool("decode"):
            if not backend.usable:
                continue
            response: Response | None = None
            try:
                response = await self.engines.post(backend.url + path, payload, leg_headers(request_id), self._tokenize_timeout)
                return response.status, json_text.loads(await response.read())
            except (ConnectionError, TimeoutError, ValueError):  # engine_http's typed failures; an answer not JSON
                continue
            finally:
                if response is not None:
                    response.close()  # read to its end, it is back in the pool already; else dropped (the engine stops)
        return None
