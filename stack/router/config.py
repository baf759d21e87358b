"""The router's settings.toml (the article's schema plus limits, keys and usage), parsed once.

    [server]    host, port, health_port, max_body_bytes
    [taotoken]  base_url, api_key_env, model_id
    [prefill]   endpoint | endpoints | discover, max_concurrent, health_addrs            (PoolConfig)
    [decode]    endpoint | endpoints | discover, max_concurrent, kv_addrs, health_addrs  (PoolConfig)
    [scheduler] policy, kv_connector, kv_transfer_timeout_ms, …               (SchedulerConfig)
    [auth]      keys_file: optional TOML/JSON naming more keys (by env var) with their own limits
    [limits]    rpm, tpm, max_concurrent, token_quota: per-key defaults, 0 = unlimited
    [usage]     db_path: the SQLite file holding per-key usage across restarts
    [limits_store] redis_url, lease_ms, …: limits shared by several routers through Redis (LimitsStoreConfig)
    [p2pnccl]   registry_port, instance_ttl_ms: vLLM P2pNccl engines register themselves (P2pNcclConfig)

`PREFILL_ENDPOINT` and `DECODE_ENDPOINT` in the environment override the file (the article's
.env), as do `PREFILL_DISCOVER` and `DECODE_DISCOVER` (a dns://NAME:PORT every replica is found under); so do `BACKEND_HEALTH_CHECK`, `BACKEND_CAPABILITIES`, `KV_CONNECTOR` and `P2PNCCL_REGISTRY_PORT` (the GPU overlays),
and `LIMITS_REDIS_URL` (several routers).
`KV_TRANSFER_PORT` sets nothing here: decode reports its KV port on GET /health, and the router
only checks the variable against that (discovery.py). Keys never live in these files: a value
that looks like a secret stops start-up with a message naming the env var to use instead.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from stack.common.config import ConfigError, build, check, read_file
from stack.router.backends import PoolConfig, check_topology
from stack.router.handoff import KV_CONNECTORS
from stack.router.p2pnccl import P2pNcclConfig
from stack.router.scheduler import SchedulerConfig

_NOT_SETTINGS = ("source", "kv_transfer_port")  # RouterConfig fields load() fills in

# Key names whose values would be secrets, and value shapes that are keys whatever the name.
_SECRET_NAME = re.compile(r"(^|_)(api_?key|secret|token|password|passwd)$", re.IGNORECASE)
# (A long unbroken alphanumeric run is a generated secret; model ids and paths have separators.)
_SECRET_VALUE = re.compile(r"^(Bearer\s+\S+|sk-[A-Za-z0-9_\-]{6,}|sk_[A-Za-z0-9_\-]{6,}|[A-Za-z0-9]{32,})$")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"  # where the HTTP API listens (in its container; compose publishes it on ROUTER_BIND, loopback)
    port: int = 8080  # HTTP API port (the one clients use)
    health_port: int = 50052  # gRPC health port (compose health checks)
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413 (long agent contexts fit)
    # A connection must send a complete request head within this long of opening (or of its last answer), else it is
    # closed (slowloris, idle sockets). Clients' keep-alive pools (httpx 5 s, undici 4 s) expire sooner.
    header_timeout_ms: int = 15_000
    body_timeout_ms: int = 30_000  # the whole body must arrive within this long (then 408); only then does it count as in flight
    # POST /tokenize and /detokenize answer without a key, as vLLM's own server does (its --api-key guards only /v1
    # paths): `vllm bench serve` aligns its prompts through them and sends no key there. They only count tokens.
    public_tokenizer: bool = False

    def __post_init__(self) -> None:
        check(self.header_timeout_ms >= 1000, "header_timeout_ms", f"must be at least 1000, got {self.header_timeout_ms}")
        check(self.body_timeout_ms >= 1000, "body_timeout_ms", f"must be at least 1000, got {self.body_timeout_ms}")
        check(0 <= self.port < 65536, "port", f"must be 0..65535, got {self.port}")
        check(0 <= self.health_port < 65536, "health_port", f"must be 0..65535, got {self.health_port}")
        check(self.max_body_bytes >= 1024, "max_body_bytes", f"must be at least 1024, got {self.max_body_bytes}")


@dataclass(frozen=True)
class TaotokenConfig:
    base_url: str = "https://taotoken.net/api"  # the public channel clients know; informational here
    api_key_env: str = "TAOTOKEN_API_KEY"  # env var holding the unified key (never the key itself)
    model_id: str = "your-model-id"  # the public model id clients send; mapped to the engines' model
    # Other names accepted for the same model, as shell-style patterns: Claude Code asks for
    # claude-* models (e.g. its small/fast model) unless every ANTHROPIC_*_MODEL variable is set.
    model_aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env) is not None, "api_key_env",
              f"must be the NAME of an environment variable (like TAOTOKEN_API_KEY), got {self.api_key_env!r}")
        check(bool(self.model_id.strip()), "model_id", "must not be empty")


@dataclass(frozen=True)
class KeyLimits:
    rpm: int = 0  # requests per minute (sliding 60 s window); 0 = unlimited
    tpm: int = 0  # prompt + completion tokens per minute; 0 = unlimited
    max_concurrent: int = 0  # requests in flight at once; 0 = unlimited
    token_quota: int = 0  # total prompt + completion tokens ever (kept in the usage db); 0 = unlimited

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrent", "token_quota"):
            value = getattr(self, name)
            check(value >= 0, name, f"must be >= 0 (0 = unlimited), got {value}")


@dataclass(frozen=True)
class AuthConfig:
    keys_file: str = ""  # optional TOML/JSON with [[keys]] name, env, limits (relative to settings.toml)


@dataclass(frozen=True)
class UsageConfig:
    db_path: str = "data/router-usage.sqlite3"  # SQLite file (relative paths: to the working directory)
    # Finished requests are written in one WAL commit per event-loop turn, before `router.request_done` is logged:
    # a kill -9 loses none whose line was logged. This interval only paces retries after a failed write (a full disk).
    flush_interval_ms: int = 1000

    def __post_init__(self) -> None:
        check(self.flush_interval_ms > 0, "flush_interval_ms", f"must be > 0, got {self.flush_interval_ms}")


@dataclass(frozen=True)
class LimitsStoreConfig:
    """Where per-key limits are counted: this process (default) or a Redis shared by several routers (limits_redis.py)."""

    # "" = in this process (one router); "redis://redis:6379/0" = every router using that Redis shares the key's
    # rpm, tpm, concurrency and quota. LIMITS_REDIS_URL overrides. No password in the URL: use password_env.
    redis_url: str = ""
    password_env: str = ""  # the env var holding Redis's password (AUTH), if it has one
    key_prefix: str = "pd:limits:"  # Redis key prefix (routers of one deployment share it)
    # A request in flight holds a slot leased for this long and renewed every lease/3 by its router: a router that dies
    # leaves slots that free themselves within lease_ms.
    lease_ms: int = 30_000
    timeout_ms: int = 1000  # each Redis call; past it the request gets a 503 limits_unavailable (fail closed)

    def __post_init__(self) -> None:
        if self.redis_url:
            parts = urlsplit(self.redis_url)
            check(parts.scheme in ("redis", "rediss", "unix"), "redis_url",
                  f"must be a redis://host:port/db (or rediss://, unix://) URL, got {parts.scheme or self.redis_url!r}")
            check(parts.password is None, "redis_url", "must not carry a password: put it in an env var named by password_env")
        check(self.password_env == "" or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.password_env) is not None, "password_env",
              f"must be the NAME of an environment variable, got {self.password_env!r}")
        check(self.lease_ms >= 3000, "lease_ms", f"must be at least 3000, got {self.lease_ms}")
        check(100 <= self.timeout_ms <= 10_000, "timeout_ms", f"must be 100..10000, got {self.timeout_ms}")


@dataclass(frozen=True)
class RouterConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    taotoken: TaotokenConfig = field(default_factory=TaotokenConfig)
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    limits: KeyLimits = field(default_factory=KeyLimits)
    usage: UsageConfig = field(default_factory=UsageConfig)
    limits_store: LimitsStoreConfig = field(default_factory=LimitsStoreConfig)
    p2pnccl: P2pNcclConfig = field(default_factory=P2pNcclConfig)
    source: str = "<defaults>"  # the file this came from (set by load(); not a settings key)
    kv_transfer_port: int = 0  # KV_TRANSFER_PORT, checked against the port decode reports (set by load(); 0 = not given)


@dataclass(frozen=True)
class KeyEntry:
    """One [[keys]] entry of the keys file: a named key read from `env`, with optional own limits."""

    name: str
    env: str  # the env var holding this key
    rpm: int | None = None  # None = the [limits] default
    tpm: int | None = None
    max_concurrent: int | None = None
    token_quota: int | None = None

    def __post_init__(self) -> None:
        check(re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", self.name) is not None, "name",
              f"must be 1-64 letters, digits, '_', '.', '-', got {self.name!r}")
        check(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.env) is not None, "env",
              f"must be the NAME of an environment variable, got {self.env!r}")
        for name in ("rpm", "tpm", "max_concurrent", "token_quota"):
            value = getattr(self, name)
            check(value is None or value >= 0, name, f"must be >= 0 (0 = unlimited), got {value}")

    def limits(self, defaults: KeyLimits) -> KeyLimits:
        own = {name: getattr(self, name) for name in ("rpm", "tpm", "max_concurrent", "token_quota")}
        return dataclasses.replace(defaults, **{k: v for k, v in own.items() if v is not None})


@dataclass(frozen=True)
class KeysFile:
    keys: tuple[KeyEntry, ...] = ()

    def __post_init__(self) -> None:
        names = [entry.name for entry in self.keys]
        dupes = sorted({n for n in names if names.count(n) > 1})
        check(not dupes, "keys", f"duplicate key names: {', '.join(dupes)}")


def _reject_secrets(data: Mapping[str, Any], file: str, env_hint: str, prefix: str = "") -> None:
    """Stop on any value in a config file that is (or is named like) a key."""
    for name, value in data.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            _reject_secrets(value, file, env_hint, f"{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, Mapping):
                    _reject_secrets(item, file, env_hint, f"{key}[{i}].")
                elif isinstance(item, str) and _SECRET_VALUE.match(item.strip()):
                    raise ConfigError(file, f"{key}[{i}]", f"looks like an API key; keys never go in config files: put it in the environment variable {env_hint} instead")
        elif isinstance(value, str) and value.strip() and (_SECRET_NAME.search(name) or _SECRET_VALUE.match(value.strip())):
            raise ConfigError(file, key, f"looks like an API key; keys never go in config files: put it in the environment variable {env_hint} instead")


def _with_env_overrides(data: dict[str, Any], env: Mapping[str, str], file: str) -> dict[str, Any]:
    """Apply the article's .env overrides on top of the file's tables."""
    data = {name: dict(value) if isinstance(value, dict) else value for name, value in data.items()}
    for table in ("prefill", "decode"):
        var, discover_var = f"{table.upper()}_ENDPOINT", f"{table.upper()}_DISCOVER"
        endpoints_text, discover = env.get(var, "").strip(), env.get(discover_var, "").strip()
        if endpoints_text and discover:
            raise ConfigError("environment", discover_var, f"set {var} (fixed endpoints) or {discover_var} (a DNS name), not both")
        if endpoints_text or discover:
            section = data.setdefault(table, {})
            if not isinstance(section, dict):
                raise ConfigError(file, table, f"expected a table, got {type(section).__name__}")
            # Either variable replaces every form of the file's pool: the endpoint (or a comma-separated list for
            # xPyD), or the name every replica is found under (replicas.py).
            for key in ("endpoint", "endpoints", "discover"):
                section.pop(key, None)
            if discover:
                section["discover"] = discover
            else:
                section["endpoints"] = [e.strip() for e in endpoints_text.split(",") if e.strip()]
    connector = env.get("KV_CONNECTOR", "").strip()
    if connector:  # the GPU overlays' vLLM engines hand KV over their own way
        if connector not in KV_CONNECTORS:
            raise ConfigError("environment", "KV_CONNECTOR", f"must be one of {', '.join(KV_CONNECTORS)}, got {connector!r}")
        section = data.setdefault("scheduler", {})
        if isinstance(section, dict):
            section["kv_connector"] = connector
    health_check = env.get("BACKEND_HEALTH_CHECK", "").strip()
    if health_check:  # the GPU overlay's vLLM engines answer GET /health, not gRPC health
        if health_check not in ("grpc", "http"):
            raise ConfigError("environment", "BACKEND_HEALTH_CHECK", f"must be grpc or http, got {health_check!r}")
        for table in ("prefill", "decode"):
            section = data.setdefault(table, {})
            if isinstance(section, dict):
                section["health_check"] = health_check
    capabilities = env.get("BACKEND_CAPABILITIES", "").strip()
    if capabilities:  # the GPU overlay's vLLM engines report no capabilities: "vllm" (or a comma-separated list of flags)
        value: Any = capabilities if "," not in capabilities and capabilities in ("auto", "vllm", "none") else \
            [flag.strip() for flag in capabilities.split(",") if flag.strip()]
        for table in ("prefill", "decode"):
            section = data.setdefault(table, {})
            if isinstance(section, dict):
                section["capabilities"] = value
    redis_url = env.get("LIMITS_REDIS_URL", "").strip()
    if redis_url:  # several routers: the deployment names their shared Redis
        section = data.setdefault("limits_store", {})
        if isinstance(section, dict):
            section["redis_url"] = redis_url
    registry_text = env.get("P2PNCCL_REGISTRY_PORT", "").strip()
    if registry_text:
        if not registry_text.isdigit() or not 0 <= int(registry_text) < 65536:
            raise ConfigError("environment", "P2PNCCL_REGISTRY_PORT", f"must be a port number 0..65535, got {registry_text!r}")
        section = data.setdefault("p2pnccl", {})
        if isinstance(section, dict):
            section["registry_port"] = int(registry_text)
    return data


def _kv_transfer_port(env: Mapping[str, str]) -> int:
    text = env.get("KV_TRANSFER_PORT", "").strip()
    if text and (not text.isdigit() or not 0 < int(text) < 65536):
        raise ConfigError("environment", "KV_TRANSFER_PORT", f"must be a port number 1..65535, got {text!r}")
    return int(text or 0)


def _check_handoff(config: RouterConfig, file: str) -> None:
    """kv_connector, the registry and the endpoints agree (handoff.py says what each kind needs)."""
    connector, registry_port = config.scheduler.kv_connector, config.p2pnccl.registry_port
    if connector == "p2pnccl" and not registry_port:
        raise ConfigError(file, "scheduler.kv_connector", "is 'p2pnccl', but p2pnccl.registry_port (or P2PNCCL_REGISTRY_PORT) is not "
                          "set: vLLM P2pNccl engines register with the router on that port (their proxy_port)")
    if registry_port and connector != "p2pnccl":
        raise ConfigError(file, "p2pnccl.registry_port", f"is set, but scheduler.kv_connector is {connector!r}: set kv_connector = "
                          "\"p2pnccl\" (or KV_CONNECTOR=p2pnccl) to route through the engines that register")
    if connector == "p2pnccl":
        return  # the pools are whoever registers; the configured endpoints are ignored
    for side in ("prefill", "decode"):
        pool: PoolConfig = getattr(config, side)
        if not pool.urls and not pool.discover:
            raise ConfigError(file, f"{side}.endpoint", f"no endpoint: set {side}.endpoint (or {side}.endpoints, or {side}.discover) "
                              f"or {side.upper()}_ENDPOINT")
        if pool.discover and not config.scheduler.health_interval_ms:
            raise ConfigError(file, "scheduler.health_interval_ms", f"is 0, but {side}.discover needs health probes: a replica "
                              "joins its pool only once its health says SERVING")
    try:
        check_topology(config.prefill, config.decode)
    except ConfigError as exc:
        raise ConfigError(file, exc.key, exc.problem) from None


def load(path: str | Path, env: Mapping[str, str] | None = None) -> RouterConfig:
    """Read settings.toml, apply env overrides, validate; raise ConfigError (one line) on any problem."""
    env = os.environ if env is None else env
    file = str(path)
    data = read_file(path)
    taotoken = data.get("taotoken")
    named = taotoken.get("api_key_env") if isinstance(taotoken, dict) else None
    env_hint = named if isinstance(named, str) and named else TaotokenConfig.api_key_env
    _reject_secrets(data, file, env_hint)
    for key in _NOT_SETTINGS:
        if key in data:
            raise ConfigError(file, key, "unknown key")
    config = build(RouterConfig, _with_env_overrides(data, env, file), file)
    _check_handoff(config, file)
    return dataclasses.replace(config, source=file, kv_transfer_port=_kv_transfer_port(env))


def load_keys_file(config: RouterConfig) -> KeysFile:
    """The optional keys file (path relative to settings.toml); key values stay in env vars."""
    if not config.auth.keys_file:
        return KeysFile()
    path = Path(config.auth.keys_file)
    if not path.is_absolute() and config.source != "<defaults>":
        path = Path(config.source).parent / path
    data = read_file(path)
    _reject_secrets(data, str(path), "named by each entry's `env`")
    return build(KeysFile, data, path)
