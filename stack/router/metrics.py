"""The router's Prometheus metrics, rendered in the text exposition format (no client library).

Histograms (seconds): `pd_router_ttft_seconds`, `pd_router_itl_seconds`, `pd_router_e2e_seconds`,
`pd_router_prefill_seconds`, `pd_router_kv_handoff_seconds` (decode leg sent → its first chunk:
KV claim plus first token). Counters: `pd_router_requests_total{api,status}`,
`pd_router_backend_requests_total{backend,role,outcome}`, `pd_router_retries_total{role}`.
Gauges are read at scrape time from registered collectors (backend up / in flight / breaker,
queue depth), so the hot path never touches them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets (s): sub-ms relay overhead up to minutes-long CPU generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

Labels = tuple[tuple[str, str], ...]
GaugeSample = tuple[str, dict[str, str], float]  # (metric name, labels, value)


def _labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{v}"'.replace("\n", " ") for k, v in labels] + ([extra] if extra else [])
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    def __init__(self, name: str, help_: str) -> None:
        self.name, self.help = name, help_
        self.values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}\n# TYPE {self.name} counter\n"
        for key, value in self.values.items():
            yield f"{self.name}{_labels(key)} {_num(value)}\n"


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_, buckets
        self.series: dict[Labels, list[float]] = {}  # per label set: bucket counts…, +Inf count, sum

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items())) if labels else ()  # unlabelled: the per-token ITL path
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = [0.0] * (len(self.buckets) + 2)
        series[bisect.bisect_left(self.buckets, value)] += 1
        series[-1] += value

    def count(self, **labels: str) -> int:
        series = self.series.get(tuple(sorted(labels.items())))
        return int(sum(series[:-1])) if series else 0

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}\n# TYPE {self.name} histogram\n"
        for key, series in self.series.items():
            cumulative = 0.0
            for bound, count in zip((*self.buckets, float("inf")), series[:-1]):
                cumulative += count
                le = 'le="' + _num(bound) + '"'
                yield f"{self.name}_bucket{_labels(key, le)} {_num(cumulative)}\n"
            yield f"{self.name}_sum{_labels(key)} {series[-1]!r}\n{self.name}_count{_labels(key)} {_num(cumulative)}\n"


class Metrics:
    """All router metrics; `render()` gives the /metrics body and its content type."""

    def __init__(self) -> None:
        self.ttft = Histogram("pd_router_ttft_seconds", "Router-measured time to first token chunk (decode leg included prefill).", LATENCY_BUCKETS)
        self.itl = Histogram("pd_router_itl_seconds", "Gaps between consecutive relayed token chunks.", ITL_BUCKETS)
        self.e2e = Histogram("pd_router_e2e_seconds", "Request latency from arrival to the last byte sent.", LATENCY_BUCKETS)
        self.prefill = Histogram("pd_router_prefill_seconds", "Prefill leg duration (prompt KV computed and pushed).", LATENCY_BUCKETS)
        self.kv_handoff = Histogram("pd_router_kv_handoff_seconds", "Decode leg sent until its first chunk (KV claim + first token).", LATENCY_BUCKETS)
        self.requests = Counter("pd_router_requests_total", "Client requests by API and HTTP status.")
        self.backend_requests = Counter("pd_router_backend_requests_total", "Upstream legs by backend, role and outcome.")
        self.retries = Counter("pd_router_retries_total", "Retried legs by role.")
        self._collectors: list[Callable[[], Iterable[GaugeSample]]] = []
        self._gauge_help: dict[str, str] = {}

    def observe_request(self, api: str, status: int, e2e_seconds: float) -> None:
        """Called by the API layer once per client request."""
        self.requests.inc(api=api, status=str(status))
        self.e2e.observe(e2e_seconds, api=api)

    def add_gauges(self, help_: dict[str, str], collector: Callable[[], Iterable[GaugeSample]]) -> None:
        """Register gauges computed at scrape time (name → help, and a function yielding samples)."""
        self._gauge_help.update(help_)
        self._collectors.append(collector)

    def render(self) -> tuple[str, str]:
        parts: list[str] = []
        for metric in (self.ttft, self.itl, self.e2e, self.prefill, self.kv_handoff, self.requests, self.backend_requests, self.retries):
            parts.extend(metric.render())
        samples: dict[str, list[str]] = {}
        for collector in self._collectors:
            for name, labels, value in collector():
                samples.setdefault(name, []).append(f"{name}{_labels(tuple(sorted(labels.items())))} {_num(value)}\n")
        for name, lines in samples.items():
            parts.append(f"# HELP {name} {self._gauge_help.get(name, name)}\n# TYPE {name} gauge\n")
            parts.extend(lines)
        return "".join(parts), CONTENT_TYPE
