"""The router's Prometheus metrics (text exposition from stack.common.metrics, no client library).

Histograms (seconds): `pd_router_ttft_seconds{mode}`, `pd_router_itl_seconds`, `pd_router_e2e_seconds{api}`,
`pd_router_prefill_seconds`, `pd_router_kv_handoff_seconds` (decode leg sent → its first chunk:
KV claim plus first token), `pd_router_tpot_seconds` (per streamed request: (last − first chunk) /
(chunks − 1), as `vllm bench serve` defines TPOT). Counters: `pd_router_requests_total{api,status}`,
`pd_router_backend_requests_total{backend,role,outcome}`, `pd_router_retries_total{role}`,
`pd_router_slo_requests_total{slo="met"|"missed"}` (streamed requests against the TTFT and TPOT SLOs;
goodput is the rate of `met`), `pd_router_affinity_decisions_total{role,backend,decision}` (policy cache_aware:
"session"/"prefix" kept the affinity, "imbalanced"/"unavailable"/"no_key" went load-aware; affinity.py), and per
backend that computed the prompt (prefill; colocated: the engine) `pd_router_prompt_tokens_total{backend}` and
`pd_router_cached_prompt_tokens_total{backend}` from the engines' usage (`prompt_tokens_details.cached_tokens`):
their ratio is the backend's prefix-cache hit rate. Gauges are read at scrape time from registered collectors (backend
up / in flight / breaker, queue depth, the SLOs, per-key usage and quota), so the hot path never
touches them.

SLOs come from the environment (`PD_SLO_TTFT_MS`, `PD_SLO_TPOT_MS`; `SLO.from_env`) and are exported as
`pd_router_slo_ttft_seconds` / `pd_router_slo_tpot_seconds`, so recording and alert rules compare
against the router's own numbers instead of copies.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from stack.common.config import ConfigError
from stack.common.metrics import CONTENT_TYPE, Collector, Counter, CounterSeries, GaugeSample, Histogram, HistogramSeries, render_gauges

__all__ = ["CONTENT_TYPE", "ITL_BUCKETS", "LATENCY_BUCKETS", "SLO", "Counter", "GaugeSample", "Histogram", "Metrics"]

# Latency buckets (s): sub-ms relay overhead up to minutes-long CPU generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


# What the metrics read, described here rather than imported: the backends, keys, usage and limits report to
# Metrics, so the metrics module depends on none of them (read-only properties: any class with those fields fits).

class BackendRef(Protocol):
    """A backend (stack.router.backends.Backend), named by its URL, and its role."""

    @property
    def url(self) -> str: ...
    @property
    def role(self) -> str: ...


class KeyLimits(Protocol):
    @property
    def token_quota(self) -> int: ...


class Caller(Protocol):
    """A key (stack.router.auth.Caller): its name and limits."""

    @property
    def name(self) -> str: ...
    @property
    def limits(self) -> KeyLimits: ...


class Totals(Protocol):
    @property
    def requests(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...


class UsageTotals(Protocol):
    """A key's persistent totals (stack.router.usage.UsageStore)."""

    def get(self, key_name: str, /) -> Totals: ...


class InFlight(Protocol):
    """Requests of a key in flight now (stack.router.limits.Limiter)."""

    def in_flight(self, key_name: str, /) -> int: ...


@dataclass(frozen=True)
class SLO:
    """The latency targets goodput is counted against (design §6: a request meets every given SLO)."""

    ttft_s: float = 2.0  # time to first token; PD_SLO_TTFT_MS
    tpot_s: float = 0.2  # time per output token after the first; PD_SLO_TPOT_MS

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SLO:
        """PD_SLO_TTFT_MS / PD_SLO_TPOT_MS (ms) over the defaults; ConfigError (one line at start-up) if bad."""
        env = os.environ if env is None else env
        values = {}
        for field, var in (("ttft_s", "PD_SLO_TTFT_MS"), ("tpot_s", "PD_SLO_TPOT_MS")):
            text = env.get(var, "").strip()
            if text:
                try:
                    ms = float(text)
                except ValueError:
                    raise ConfigError("environment", var, f"must be a number of milliseconds, got {text!r}") from None
                if not ms > 0:
                    raise ConfigError("environment", var, f"must be > 0 ms, got {text!r}")
                values[field] = ms / 1000
        return cls(**values)


class Metrics:
    """All router metrics; `render()` gives the /metrics body and its content type."""

    def __init__(self, slo: SLO | None = None) -> None:
        self.slo = slo or SLO.from_env()
        self.ttft = Histogram("pd_router_ttft_seconds", "Router-measured time to first token chunk (decode leg included prefill).", LATENCY_BUCKETS)
        self.itl = Histogram("pd_router_itl_seconds", "Gaps between consecutive relayed token chunks.", ITL_BUCKETS)
        self.tpot = Histogram("pd_router_tpot_seconds", "Per streamed request: (last - first chunk) / (chunks - 1).", ITL_BUCKETS)
        self.e2e = Histogram("pd_router_e2e_seconds", "Request latency from arrival to the last byte sent.", LATENCY_BUCKETS)
        self.prefill = Histogram("pd_router_prefill_seconds", "Prefill leg duration (prompt KV computed and pushed).", LATENCY_BUCKETS)
        self.kv_handoff = Histogram("pd_router_kv_handoff_seconds", "Decode leg sent until its first chunk (KV claim + first token).", LATENCY_BUCKETS)
        self.requests = Counter("pd_router_requests_total", "Client requests by API and HTTP status.")
        self.backend_requests = Counter("pd_router_backend_requests_total", "Upstream legs by backend, role and outcome.")
        self.retries = Counter("pd_router_retries_total", "Retried legs by role.")
        self.slo_requests = Counter("pd_router_slo_requests_total", "Completed streamed requests that met (or missed) the TTFT and TPOT SLOs.")
        self.affinity = Counter("pd_router_affinity_decisions_total",
                                "cache_aware picks by role, backend and decision (session/prefix: affinity kept; imbalanced/unavailable/no_key: load-aware).")
        self.prompt_tokens = Counter("pd_router_prompt_tokens_total", "Prompt tokens by the backend that computed the prompt (engine usage).")
        self.cached_tokens = Counter("pd_router_cached_prompt_tokens_total",
                                     "Prompt tokens the backend served from its prefix cache (usage.prompt_tokens_details.cached_tokens).")
        # The series each request touches, by their labels' values: a lookup, not the labels sorted (stack.common.metrics).
        self._by_request: dict[tuple[str, int], tuple[CounterSeries, HistogramSeries]] = {}
        self._by_leg: dict[tuple[str, str, str], CounterSeries] = {}
        self._by_prompt_backend: dict[str, tuple[CounterSeries, CounterSeries]] = {}
        self._by_mode: dict[str, HistogramSeries] = {}
        self._by_slo: dict[bool, CounterSeries] = {}
        self._collectors: list[Collector] = [self._slo_gauges]
        self._gauge_help: dict[str, str] = {
            "pd_router_slo_ttft_seconds": "The TTFT SLO goodput is counted against (PD_SLO_TTFT_MS).",
            "pd_router_slo_tpot_seconds": "The TPOT SLO goodput is counted against (PD_SLO_TPOT_MS).",
        }

    def observe_request(self, api: str, status: int, e2e_seconds: float) -> None:
        """Called by the API layer once per client request."""
        series = self._by_request.get((api, status))
        if series is None:
            series = self._by_request[(api, status)] = (self.requests.labels(api=api, status=str(status)), self.e2e.labels(api=api))
        series[0].value += 1
        series[1].observe(e2e_seconds)

    def observe_leg(self, backend: BackendRef, outcome: str) -> None:
        """An upstream leg's outcome: ok, error (retryable) or rejected."""
        series = self._by_leg.get((backend.url, backend.role, outcome))
        if series is None:
            series = self._by_leg[(backend.url, backend.role, outcome)] = \
                self.backend_requests.labels(backend=backend.url, role=backend.role, outcome=outcome)
        series.value += 1

    def observe_ttft(self, ttft_seconds: float, mode: str) -> None:
        series = self._by_mode.get(mode)
        if series is None:
            series = self._by_mode[mode] = self.ttft.labels(mode=mode)
        series.observe(ttft_seconds)

    def observe_stream(self, ttft_seconds: float, decode_seconds: float, chunks: int) -> None:
        """Called once per completed streamed request: its TPOT and whether it met both SLOs."""
        tpot = decode_seconds / (chunks - 1) if chunks > 1 else 0.0
        if chunks > 1:
            self.tpot.observe(tpot)
        met = ttft_seconds <= self.slo.ttft_s and tpot <= self.slo.tpot_s
        series = self._by_slo.get(met)
        if series is None:
            series = self._by_slo[met] = self.slo_requests.labels(slo="met" if met else "missed")
        series.value += 1

    def observe_prompt_cache(self, backend: BackendRef, usage: Any) -> None:
        """Count an engine's usage for the backend that computed the prompt: hit rate = cached / prompt tokens."""
        if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
            return
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        series = self._by_prompt_backend.get(backend.url)
        if series is None:
            series = self._by_prompt_backend[backend.url] = (self.prompt_tokens.labels(backend=backend.url),
                                                             self.cached_tokens.labels(backend=backend.url))
        series[0].value += usage["prompt_tokens"]
        series[1].value += cached if isinstance(cached, int) and not isinstance(cached, bool) else 0

    def add_gauges(self, help_: dict[str, str], collector: Callable[[], Iterable[GaugeSample]]) -> None:
        """Register gauges computed at scrape time (name → help, and a function yielding samples)."""
        self._gauge_help.update(help_)
        self._collectors.append(collector)

    def add_key_gauges(self, callers: Callable[[], Iterable[Caller]], usage: UsageTotals, limiter: InFlight) -> None:
        """Per-key usage (from the persistent totals, so it survives restarts), quota and requests in flight."""
        def collect() -> Iterable[GaugeSample]:
            for caller in callers():
                name, totals = caller.name, usage.get(caller.name)
                yield "pd_router_key_requests", {"key_name": name}, totals.requests
                yield "pd_router_key_tokens_used", {"key_name": name, "kind": "prompt"}, totals.prompt_tokens
                yield "pd_router_key_tokens_used", {"key_name": name, "kind": "completion"}, totals.completion_tokens
                yield "pd_router_key_in_flight", {"key_name": name}, limiter.in_flight(name)
                if caller.limits.token_quota:
                    yield "pd_router_key_token_quota", {"key_name": name}, caller.limits.token_quota
        self.add_gauges({
            "pd_router_key_requests": "Requests the key has made (usage db: survives restarts).",
            "pd_router_key_tokens_used": "Tokens the key has used, by kind (usage db: survives restarts).",
            "pd_router_key_in_flight": "Requests of the key in flight now.",
            "pd_router_key_token_quota": "The key's total token quota (only keys that have one).",
        }, collect)

    def _slo_gauges(self) -> Iterable[GaugeSample]:
        yield "pd_router_slo_ttft_seconds", {}, self.slo.ttft_s
        yield "pd_router_slo_tpot_seconds", {}, self.slo.tpot_s

    def render(self) -> tuple[str, str]:
        parts: list[str] = []
        for metric in (self.ttft, self.itl, self.tpot, self.e2e, self.prefill, self.kv_handoff, self.requests,
                       self.backend_requests, self.retries, self.slo_requests, self.affinity, self.prompt_tokens, self.cached_tokens):
            parts.extend(metric.render())
        parts.extend(render_gauges(self._gauge_help, self._collectors))
        return "".join(parts), CONTENT_TYPE
