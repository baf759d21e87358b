"""Backends as the router sees them: a pool config per role, per-backend load and health, breakers.

A `Backend` is one engine endpoint in one role. The router keeps its own accounting (requests in
flight, outstanding tokens) because it is the only one sending work there; the health monitor
(monitor.py) and request outcomes decide whether it is `up` and what its breaker allows.

    closed ──N consecutive failures──▶ open ──cool-down──▶ half_open ──success──▶ closed
                                         ▲                     │
                                         └──────failure────────┘   (one trial request at a time)
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from stack.common import events
from stack.common.config import check
from stack.common.logging import log_event
from stack.protocol.capabilities import Capabilities, from_setting

DEFAULT_HEALTH_PORT = 50051
HOST_PORT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")  # host:port, [v6]:port
HOST = re.compile(r"^([A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.]+\])$")  # a name, an IPv4 address or [v6]

Role = Literal["prefill", "decode", "both"]


def split_addr(addr: str) -> tuple[str, int | None]:
    """("decode", 9200) from "decode:9200", ("[fd00::5]", None) from "[fd00::5]"; ValueError for a port out of range."""
    parts = urlsplit(f"//{addr}")
    port = parts.port
    return (parts.netloc.rsplit(":", 1)[0], port) if port is not None else (parts.netloc, None)


def url_host(url: str) -> str:
    """The host of an endpoint URL as it goes before ":port" (IPv6 keeps its brackets)."""
    return split_addr(urlsplit(url).netloc)[0]


def _check_url(url: str, key: str) -> None:
    parts = urlsplit(url)
    check(parts.scheme in ("http", "https") and bool(parts.hostname), key,
          f"must be an http(s) URL like http://10.0.0.11:8000, got {url!r}")
    check(parts.path in ("", "/"), key, f"must not contain a path (the router adds /v1/...), got {url!r}")


@dataclass(frozen=True)
class PoolConfig:
    """One [prefill] or [decode] table: the engines serving that role."""

    endpoint: str = ""  # the article's single endpoint ("http://10.0.0.11:8000")
    endpoints: tuple[str, ...] = ()  # xPyD: several endpoints (merged with `endpoint`, order kept)
    max_concurrent: int = 32  # requests in flight per backend; more wait in the router's queue
    # decode only, with kv_connector "pd-push": the host (or host:port) prefill pushes KV to, per endpoint, when the KV
    # network names decode differently; default: the endpoint's host. The port is always the one decode reports on its
    # GET /health (discovery.py); a port given here is only checked against it.
    kv_addrs: tuple[str, ...] = ()
    health_addrs: tuple[str, ...] = ()  # gRPC health address per endpoint (default host:50051)
    health_check: Literal["grpc", "http"] = "grpc"  # our engines serve gRPC health; vLLM serves GET /health
    # What these engines can do (stack.protocol.capabilities): "auto" = what each reports on GET /health
    # (`capabilities`, our engine; nothing reported = none of the extras), a preset ("vllm": all vLLM takes,
    # "none"), or a list of flag names. Requests asking for more get the API's 400 naming the parameter.
    capabilities: str | tuple[str, ...] = "auto"
    # Instead of endpoints: "dns://NAME:PORT" = every address NAME resolves to is one backend http://ADDR:PORT, re-resolved
    # every discover_interval_ms (replicas.py: compose --scale, Swarm tasks.<service>, Kubernetes headless Services).
    # Their gRPC health is ADDR:discover_health_port (or http://ADDR:PORT/health with health_check "http").
    discover: str = ""
    discover_interval_ms: int = 2000
    discover_health_port: int = DEFAULT_HEALTH_PORT

    def __post_init__(self) -> None:
        if self.discover:
            check(not self.urls, "discover", "set either endpoint/endpoints or discover, not both")
            for name in ("kv_addrs", "health_addrs"):
                check(not getattr(self, name), name, "is per endpoint; a discover pool learns each replica's addresses itself")
            check(discover_target(self.discover) is not None, "discover", f"must be dns://NAME:PORT like dns://prefill:8000, got {self.discover!r}")
        check(0 < self.discover_health_port < 65536, "discover_health_port", f"must be 1..65535, got {self.discover_health_port}")
        check(self.discover_interval_ms >= 100, "discover_interval_ms", f"must be at least 100, got {self.discover_interval_ms}")
        for i, url in enumerate(self.urls):
            _check_url(url, "endpoint" if url == self.endpoint else f"endpoints[{i}]")
        check(self.max_concurrent > 0, "max_concurrent", f"must be > 0, got {self.max_concurrent}")
        for name in ("kv_addrs", "health_addrs"):
            addrs = getattr(self, name)
            check(not addrs or len(addrs) == len(self.urls), name,
                  f"needs one address per endpoint ({len(self.urls)}), got {len(addrs)}")
        if self.capabilities != "auto":
            try:
                from_setting(self.capabilities)
            except ValueError as exc:
                check(False, "capabilities", str(exc))
        for i, addr in enumerate(self.health_addrs):
            check(bool(HOST_PORT.match(addr)), f"health_addrs[{i}]", f"must be host:port, got {addr!r}")
        for i, addr in enumerate(self.kv_addrs):
            check(bool(HOST.match(addr) or HOST_PORT.match(addr)), f"kv_addrs[{i}]", f"must be host or host:port, got {addr!r}")
            try:
                port = split_addr(addr)[1]
            except ValueError:
                port = 0
            check(port != 0, f"kv_addrs[{i}]", f"port must be 1..65535, got {addr!r}")

    @property
    def target(self) -> tuple[str, int] | None:
        """(NAME, PORT) of a discover pool; None for a static one."""
        return discover_target(self.discover) if self.discover else None

    @property
    def urls(self) -> tuple[str, ...]:
        merged = ((self.endpoint,) if self.endpoint else ()) + self.endpoints
        return tuple(dict.fromkeys(url.rstrip("/") for url in merged))

    @property
    def is_vllm(self) -> bool:
        """Declared vLLM (the "vllm" preset): vLLM's own request fields (VLLM_EXTRAS) pass through to it."""
        return self.capabilities == "vllm"

    @property
    def declared(self) -> Capabilities | None:
        """The capabilities settings.toml sets for this pool, or None: learn them from each backend."""
        return None if self.capabilities == "auto" else from_setting(self.capabilities)

    def health_addr(self, index: int) -> str:
        if self.health_check == "http":
            return f"{self.urls[index]}/health"
        return self.health_addrs[index] if self.health_addrs else f"{url_host(self.urls[index])}:{DEFAULT_HEALTH_PORT}"


def discover_target(setting: str) -> tuple[str, int] | None:
    """("prefill", 8000) from "dns://prefill:8000"; None when it is not of that form."""
    parts = urlsplit(setting)
    try:
        port = parts.port
    except ValueError:
        return None
    if parts.scheme != "dns" or not parts.hostname or not port or parts.path not in ("", "/") or parts.query or parts.username:
        return None
    return parts.hostname, port


def check_topology(prefill: PoolConfig, decode: PoolConfig) -> None:
    """Prefill and decode pools are either the same engines (colocated) or disjoint (disaggregated)."""
    check(bool(decode.urls or decode.discover), "decode.endpoint", "at least one decode endpoint (or decode.discover) is required")
    if prefill.discover or decode.discover:
        return  # names, not addresses: the same discover name is colocated (is_colocated), different ones disaggregated
    shared = set(prefill.urls) & set(decode.urls)
    check(not shared or set(prefill.urls) == set(decode.urls), "prefill.endpoints",
          "prefill and decode endpoints must be identical (colocated) or disjoint (disaggregated); "
          f"shared: {', '.join(sorted(shared))}")


def is_colocated(prefill: PoolConfig, decode: PoolConfig) -> bool:
    """No prefill pool, or the very same engines as decode (same endpoints, or the same discover name)."""
    if not prefill.urls and not prefill.discover:
        return True
    return set(prefill.urls) == set(decode.urls) and prefill.discover == decode.discover


class Breaker:
    """Consecutive-failure circuit breaker for one backend (see the module diagram); `clock` is injectable for tests."""

    def __init__(self, backend: str, threshold: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self.state: Literal["closed", "open", "half_open"] = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self.trial_in_flight = False

    def _move(self, state: Literal["closed", "open", "half_open"]) -> None:
        if state != self.state:
            self.state = state
            log_event(events.BACKEND_CIRCUIT, f"circuit {state} for {self.backend}", "WARNING" if state == "open" else "INFO",
                      backend=self.backend, state=state, failures=self.failures)

    def allows(self) -> bool:
        """May a new request go to this backend now? Moves open → half_open after the cool-down."""
        if self.state == "open" and self._clock() - self.opened_at >= self.cooldown_s:
            self._move("half_open")
        if self.state == "half_open":
            return not self.trial_in_flight
        return self.state == "closed"

    def retry_after_s(self) -> float:
        return max(0.0, self.cooldown_s - (self._clock() - self.opened_at)) if self.state == "open" else 0.0

    def probe_ok(self) -> bool:
        """The health monitor saw the backend SERVING: an open circuit lets its trial request through now, without
        waiting out the cool-down (a recovered engine is re-admitted within one health interval). True if it moved."""
        if self.state != "open":
            return False
        self._move("half_open")
        return True

    def on_start(self) -> None:
        if self.state == "half_open":
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.failures = 0
        self.trial_in_flight = False
        self._move("closed")

    def on_failure(self) -> None:
        self.failures += 1
        self.trial_in_flight = False
        if self.state == "half_open" or self.failures >= self.threshold:
            self.opened_at = self._clock()
            self._move("open")


class Backend:
    """One engine endpoint in one role, with the router's own load accounting."""

    def __init__(self, url: str, role: Role, max_concurrent: int, health_addr: str, breaker: Breaker,
                 health_check: str = "grpc", kv_addr: str | None = None) -> None:
        self.url = url
        self.role = role
        self.max_concurrent = max_concurrent
        # Where the KV goes: learned from decode's GET /health (pd-push), or the zmq address a P2pNccl instance registered.
        self.kv_addr = kv_addr
        self.health_addr = health_addr
        self.health_check = health_check
        self.breaker = breaker
        self.up = True  # until the health monitor or a connect error says otherwise
        self.probe_timeouts = 0  # consecutive health probes that got no answer in time
        self.in_flight = 0
        self.outstanding_tokens = 0

    def __repr__(self) -> str:
        return f"Backend({self.role} {self.url})"

    @property
    def usable(self) -> bool:
        """Up and allowed by its breaker (it may still be full)."""
        return self.up and self.breaker.allows()

    @property
    def has_slot(self) -> bool:
        return self.in_flight < self.max_concurrent

    def take(self, tokens: int) -> None:
        self.in_flight += 1
        self.outstanding_tokens += tokens
        self.breaker.on_start()

    def give_back(self, tokens: int) -> None:
        self.in_flight -= 1
        self.outstanding_tokens -= tokens
        # A half-open trial that ended without a verdict (client went away) must not block the next one.
        self.breaker.trial_in_flight = False

    def set_up(self, up: bool, reason: str) -> bool:
        """Record health; log and return True when it changed."""
        if up == self.up:
            return False
        was = "up" if self.up else "down"
        self.up = up
        log_event(events.BACKEND_HEALTH, f"{self.role} backend {self.url} is {'up' if up else 'down'} ({reason})",
                  "INFO" if up else "WARNING", backend=self.url, role=self.role, state="up" if up else "down", was=was, reason=reason)
        return True

    def snapshot(self) -> dict[str, object]:
        return {
            "role": self.role, "url": self.url, "state": "up" if self.up else "down",
            "in_flight": self.in_flight, "max_concurrent": self.max_concurrent,
            "outstanding_tokens": self.outstanding_tokens, "breaker": self.breaker.state,
            "health_addr": self.health_addr, **({"kv_addr": self.kv_addr} if self.kv_addr else {}),
        }


def build_pool(config: PoolConfig, role: Role, breaker_threshold: int, breaker_cooldown_s: float,
               clock: Callable[[], float] = time.monotonic) -> list[Backend]:
    """The configured endpoints of one role (KV addresses are learned later, see discovery.py)."""
    return [
        Backend(url, role, config.max_concurrent, config.health_addr(i), Breaker(url, breaker_threshold, breaker_cooldown_s, clock),
                config.health_check)
        for i, url in enumerate(config.urls)
    ]

