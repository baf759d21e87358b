"""Which prefill and which decode serve an attempt, and what a failure excludes from the next one.

    acquire_pair(job, tried) -> Pair
      1. decode first: the decode `tried` still holds (the last prefill failed, not it), else a new one from the
         scheduler under the request's affinity key, never one that failed this request. Decode goes first because
         it is the scarce side: it keeps the KV for the whole answer and the session's cached blocks.
      2. the prefill for it: one whose model fingerprint matches the decode's (monitor.py; KV of another model
         version would not fit), never one that failed this request. None when colocated, or when every usable
         prefill runs another model (a rolling update): decode then computes the prompt itself.
      3. the route (handoff.py), and one `router.scheduled` line.
    failed(pair, tried, failure, leg) -> bool: the breakers count it, `tried` excludes the culprit, and the answer
      says whether another attempt may run (max_retries new pairs; max_retries other prefills per decode).

Slots: a pair's decode slot is held from acquire_pair until the request ends (`release_decode`) or its decode is
given up; its prefill slot only for the prefill leg (`release_prefill`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from stack.common import events
from stack.common.logging import log_event, ms
from stack.router.affinity import Affinity, request_affinity
from stack.router.backends import Backend
from stack.router.handoff import Handoff, Route
from stack.router.job import Job
from stack.router.metrics import Metrics
from stack.router.monitor import HealthMonitor
from stack.router.scheduler import NoBackendAvailable, Scheduler, SchedulerConfig
from stack.router.upstream import DECODE_KV_CAPACITY, LegFailed


@dataclass
class Tried:
    """One request's attempts so far: what failed and is not picked again, and the decode kept for another prefill."""

    key: Affinity | None  # session / prompt-prefix affinity (policy cache_aware): the same pair every turn
    decode_tokens: int  # what the request's decode slot counts (Job.decode_tokens)
    decodes: set[Backend] = field(default_factory=set)
    prefills: set[Backend] = field(default_factory=set)  # for the held decode
    held: Backend | None = None  # the current attempt's decode (slot taken): kept while another prefill is tried
    attempt: int = 0  # decodes acquired
    prefill_try: int = 0  # prefills tried for the current decode
    last: LegFailed | None = None  # what the client gets when no backend is left to try


@dataclass(frozen=True)
class Pair:
    """One attempt's backends (slots taken) and hand-off."""

    decode: Backend
    prefill: Backend | None  # None: decode computes the prompt (colocated, or no prefill runs its model)
    route: Route
    attempt: int
    prefill_try: int


class Pairing:
    """Picks pairs over the scheduler's pools and keeps the breakers' books (see the module doc)."""

    def __init__(self, settings: SchedulerConfig, scheduler: Scheduler, monitor: HealthMonitor, handoff: Handoff,
                 metrics: Metrics) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.monitor = monitor
        self.handoff = handoff
        self.metrics = metrics
        self.mode = "disaggregated" if handoff.prefill_leg else "colocated"

    def tried(self, headers: Mapping[str, str], job: Job) -> Tried:
        """A request's first attempt: nothing excluded yet, its affinity key computed once."""
        s = self.settings
        key = request_affinity(headers, job.body, s.affinity_prefix_chars) if s.policy == "cache_aware" else None
        return Tried(key, job.decode_tokens)

    async def acquire_pair(self, job: Job, tried: Tried) -> Pair:
        """The next attempt's pair (see the module doc); NoBackendAvailable, or the last failure's error when backends
        ran out after one."""
        decode = tried.held
        if decode is None:
            decode = await self._acquire("decode", job.decode_tokens, tried.decodes, tried)
            tried.attempt, tried.prefill_try, tried.prefills = tried.attempt + 1, 0, set()
        tried.held = decode
        try:
            prefill = await self._prefill_for(job, decode, tried)
        except BaseException:
            self.release_decode(tried)
            raise
        tried.prefill_try += prefill is not None
        route = self.handoff.route(job.request_id, prefill or decode, decode)
        # ASCII only: one "→" makes the whole line a two-byte-per-character string to build, search and encode (5-9k
        # instructions more a request).
        where = f"prefill {prefill.url} -> decode {decode.url}" if prefill else f"decode {decode.url} computes the prompt ({self.mode})"
        # The request's one line before its legs: what was asked (api, model, stream) and when (queue_ms before now).
        log_event(events.ROUTER_SCHEDULED, f"{job.api} request for {job.req.model}: {where}", request_id=job.request_id,
                  api=job.api, model=job.req.model, stream=job.stream, prefill=(prefill or decode).url, decode=decode.url,
                  policy=self.settings.policy, mode=self.mode, attempt=tried.attempt, prefill_attempt=tried.prefill_try,
                  queue_ms=ms(time.perf_counter() - job.started))
        return Pair(decode, prefill, route, tried.attempt, tried.prefill_try)

    async def _acquire(self, role: str, tokens: int, exclude: set[Backend], tried: Tried) -> Backend:
        try:
            return await self.scheduler.acquire(role, tokens, exclude, tried.key)
        except NoBackendAvailable:
            if tried.last is not None:  # the others failed this request: say why, not "none left"
                raise tried.last.error from None
            raise

    async def _prefill_for(self, job: Job, decode: Backend, tried: Tried) -> Backend | None:
        if not self.handoff.prefill_leg:
            return None
        own, prefills = self.monitor.fingerprints.get(decode.url), self.scheduler.pool("prefill")
        other_versions = {p for p in prefills if own and (theirs := self.monitor.fingerprints.get(p.url)) and theirs != own}
        usable = [p for p in prefills if p.usable]
        if usable and all(p in other_versions for p in usable):
            log_event(events.ROUTER_VERSION_SPLIT, f"no prefill runs the model of decode {decode.url}; it serves the request alone",
                      "WARNING", request_id=job.request_id, decode=decode.url, fingerprint=own)
            return None
        return await self._acquire("prefill", job.prompt_tokens, tried.prefills | other_versions, tried)

    # -- outcomes ----------------------------------------------------------------------------------
    def failed(self, pair: Pair, tried: Tried, failure: LegFailed, leg: Literal["prefill", "decode"]) -> bool:
        """Book a leg's failure; True if another attempt may run (acquire_pair then picks it). A prefill that could not
        hand its KV to the decode (its push failed, or the decode has no room for it) blames the decode: a new pair
        without it, and its breaker counts the failure unless it was only full."""
        tried.last = failure
        if leg == "prefill" and pair.prefill is not None and not failure.blames_decode:
            self.outcome(pair.prefill, failure)
            tried.prefills.add(pair.prefill)
            retry = failure.retryable and pair.prefill_try <= self.settings.max_retries
            if not retry:
                self.release_decode(tried)
            else:
                self.metrics.retries.inc(role="prefill")
            return retry
        if leg == "prefill" and pair.prefill is not None:
            self.outcome(pair.prefill)
            if failure.code != DECODE_KV_CAPACITY:  # a full decode is busy, not broken
                self.outcome(pair.decode, LegFailed(failure.error, retryable=True, status=failure.status, code=failure.code))
        self.release_decode(tried)
        tried.decodes.add(pair.decode)
        retry = failure.retryable and pair.attempt <= self.settings.max_retries
        if retry:
            self.metrics.retries.inc(role="decode")
        return retry

    def outcome(self, backend: Backend, failure: LegFailed | None = None) -> None:
        """A leg's result in the backend's breaker and /metrics; an unreachable backend is marked down at once."""
        if failure is None:
            self.metrics.observe_leg(backend, "ok")
            backend.breaker.on_success()
            return
        self.metrics.observe_leg(backend, "error" if failure.retryable else "rejected")
        if not failure.retryable:
            backend.breaker.on_success()  # the engine answered properly; the request itself was bad
            return
        backend.breaker.on_failure()
        if failure.unreachable and self.settings.health_interval_ms:
            self.scheduler.mark(backend, False, "connect failed")  # the health monitor brings it back when SERVING

    def release_prefill(self, pair: Pair, job: Job) -> None:
        assert pair.prefill is not None, "release_prefill on a pair without a prefill"
        self.scheduler.release(pair.prefill, job.prompt_tokens)

    def release_decode(self, tried: Tried) -> None:
        """Give the current decode's slot back (the request ended, or this decode is given up)."""
        assert tried.held is not None, "release_decode without a decode held"
        self.scheduler.release(tried.held, tried.decode_tokens)
        tried.held = None
