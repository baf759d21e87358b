"""The engine's `config.json`: the article's schema plus our CPU-engine fields, parsed once at start.

The article's keys (model, role, tensor_parallel_size, pipeline_parallel_size, max_num_batched_tokens,
kv_transfer_config {kv_connector, kv_role, kv_port, kv_buffer_size}, gpu_memory_utilization) are all
accepted; the ones that mean nothing on a CPU engine are listed by `ignored_fields` and logged once
at start (`config.ignored`). Unknown keys and wrong types raise `ConfigError` (file: key: problem).

`PD_PREFIX_CACHING=0|1` in the environment overrides `prefix_caching` (benchmark arms flip it per run), and
`PD_ATTENTION=numba|numpy` overrides `attention` and `PD_GEMM=auto|mkl|numba|numpy` overrides `gemm` (back to the numpy
reference without editing the config).
`KV_TRANSFER_PORT` in the environment is the one override of where a KV consumer (decode) listens;
decode reports the port it got on `/health` (`kv_port`), which is where the router learns it. A
producer (prefill) never needs a port: it pushes to the `decode_kv_addr` each request names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

from stack.common.config import ConfigError, build, check, read_file

Role = Literal["prefill", "decode", "both"]
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KVDtype = Literal["float32", "float16"]
Attention = Literal["numba", "numpy"]
Gemm = Literal["auto", "mkl", "numba", "numpy"]

# Our own connector: TCP push from prefill to the decode's kv_port (see kv_transfer.py).
OWN_CONNECTOR = "PdTcpConnector"
# kv_role each engine role implies when the config does not say.
DEFAULT_KV_ROLE: dict[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
KV_PORT_ENV = "KV_TRANSFER_PORT"  # overrides a KV consumer's kv_transfer_config.kv_port (compose passes it from .env)
PREFIX_CACHING_ENV = "PD_PREFIX_CACHING"  # 0 | 1: overrides prefix_caching (the benchmark's arms with and without it)
ATTENTION_ENV = "PD_ATTENTION"  # numba | numpy: overrides attention
GEMM_ENV = "PD_GEMM"  # auto | mkl | numba | numpy: overrides gemm
# Environment variables that override one config key each: variable -> (key, {accepted text: value}).
_ENV_CHOICES: dict[str, tuple[str, dict[str, Any]]] = {
    PREFIX_CACHING_ENV: ("prefix_caching", {"0": False, "1": True}),
    ATTENTION_ENV: ("attention", {name: name for name in get_args(Attention)}),
    GEMM_ENV: ("gemm", {name: name for name in get_args(Gemm)}),
}
KV_HOST_ENV = "KV_ADVERTISE_HOST"  # overrides a KV consumer's kv_transfer_config.kv_advertise_host


@dataclass(frozen=True)
class KVTransferConfig:
    """`kv_transfer_config`: vLLM's names where they exist, so one file reads the same on GPU."""

    kv_connector: str = OWN_CONNECTOR  # vLLM names (P2pNcclConnector, NixlConnector…) are accepted and ignored
    kv_role: KVRole | None = None  # default from role: prefill→kv_producer, decode→kv_consumer, both→kv_both
    kv_ip: str = "0.0.0.0"  # address the KV listener binds (consumers only)
    kv_port: int = 9100  # KV listener port (consumers only; env KV_TRANSFER_PORT overrides it); 0 picks a free one
    kv_buffer_size: float = 8e9  # bytes a consumer may hold: received-but-unclaimed plus in-flight KV ("8e9" ok)
    kv_transfer_timeout_ms: int = 5000  # how long a decode request waits for its KV (prefill: bound of each socket step of a push)
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"  # KV never came: error (vLLM default) or prefill locally
    # pushed KV nobody claims is freed after this (NIXL's kv_lease_duration is 30 s); a push that sends nothing for this
    # long is closed (the lease counts from the last byte: a long prompt's push lasts as long as its prefill)
    kv_lease_ms: int = 30000
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)  # vLLM's; accepted and ignored
    # The name prefill reaches this consumer's KV listener by, reported on /health as `kv_host` (routers that discover
    # replicas by DNS use it; env KV_ADVERTISE_HOST overrides it, e.g. a Kubernetes pod IP). Empty: this host's name,
    # which for a container is its short id, resolved by Docker's DNS on every network it joins.
    kv_advertise_host: str = ""

    def __post_init__(self) -> None:
        check(0 <= self.kv_port <= 65535, "kv_port", f"must be a TCP port (0-65535), got {self.kv_port}")
        check(self.kv_buffer_size > 0, "kv_buffer_size", f"must be positive bytes, got {self.kv_buffer_size:g}")
        check(self.kv_transfer_timeout_ms > 0, "kv_transfer_timeout_ms", f"must be positive, got {self.kv_transfer_timeout_ms}")
        check(self.kv_lease_ms > 0, "kv_lease_ms", f"must be positive, got {self.kv_lease_ms}")

    @property
    def buffer_bytes(self) -> int:
        return int(self.kv_buffer_size)


@dataclass(frozen=True)
class EngineConfig:
    """One engine process: which model, which role, how it batches and how its KV moves."""

    model: str = "your-model-id"  # the model id clients send and /v1/models lists (the article's placeholder)
    role: Role = "both"  # prefill | decode | both (colocated)
    tensor_parallel_size: int = 1  # accepted for the article's schema; the CPU engine is one process
    pipeline_parallel_size: int = 1  # as above
    max_num_batched_tokens: int = 2048  # tokens per step: prefill tokens plus one per running decode
    kv_transfer_config: KVTransferConfig = field(default_factory=KVTransferConfig)
    gpu_memory_utilization: float = 0.9  # accepted; the KV pool size is kv_cache_bytes
    checkpoint: str = "dummy:small"  # dummy:tiny | dummy:small (seeded random weights) or an HF checkpoint directory
    seed: int = 0  # seed of the dummy weights (prefill and decode must agree; the fingerprint checks it)
    max_model_len: int | None = None  # prompt + completion limit; default the model's max_seq_len
    kv_cache_bytes: float = 1e9  # KV block pool budget in bytes ("1e9" ok)
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # sequences admitted at once (running + prefilling)
    chunked_prefill: bool = False  # split long prompts to fit the step budget beside running decodes
    prefix_caching: bool = True  # keep full KV blocks after a request and reuse them for equal prefixes (env PD_PREFIX_CACHING=0|1)
    kv_dtype: KVDtype = "float32"  # dtype of cached blocks and of KV on the wire; float16 halves both (compute stays float32)
    # decode attention: numba = the compiled paged kernel (kernels.py; numpy when numba does not import), numpy =
    # attention.py, the reference (env PD_ATTENTION=numba|numpy)
    attention: Attention = "numba"
    # weight matmuls for 2-256 rows (gemm.py): mkl = oneMKL's packed GEMM (numpy when MKL does not load), numba = the
    # compiled rows_matmul on transposed weights (numpy without numba), numpy = OpenBLAS through numpy, the reference;
    # auto = mkl on an Intel CPU, numba on others (env PD_GEMM=auto|mkl|numba|numpy)
    gemm: Gemm = "auto"

    def __post_init__(self) -> None:
        check(bool(self.model.strip()), "model", "must not be empty")
        check(self.max_num_batched_tokens > 0, "max_num_batched_tokens", f"must be positive, got {self.max_num_batched_tokens}")
        check(self.max_model_len is None or self.max_model_len > 0, "max_model_len", f"must be positive, got {self.max_model_len}")
        check(self.kv_cache_bytes > 0, "kv_cache_bytes", f"must be positive bytes, got {self.kv_cache_bytes:g}")
        check(self.block_size > 0, "block_size", f"must be positive, got {self.block_size}")
        check(self.max_num_seqs > 0, "max_num_seqs", f"must be positive, got {self.max_num_seqs}")
        check(bool(self.checkpoint.strip()), "checkpoint", "must not be empty")
        kv_role = self.kv_transfer_config.kv_role
        allowed = {"prefill": ("kv_producer", "kv_both"), "decode": ("kv_consumer", "kv_both"), "both": ("kv_both", "kv_producer", "kv_consumer")}
        check(
            kv_role is None or kv_role in allowed[self.role],
            "kv_transfer_config.kv_role",
            f"{kv_role!r} does not fit role {self.role!r} (use one of {', '.join(allowed[self.role])})",
        )

    @property
    def kv_role(self) -> str:
        return self.kv_transfer_config.kv_role or DEFAULT_KV_ROLE[self.role]

    @property
    def is_kv_consumer(self) -> bool:
        """Listens on kv_port for pushed KV (decode, or a colocated engine configured as kv_both)."""
        if self.role == "both":
            return self.kv_transfer_config.kv_role in ("kv_consumer", "kv_both")
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def pool_bytes(self) -> int:
        return int(self.kv_cache_bytes)


def ignored_fields(config: EngineConfig, raw: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(key, value, why) for each key in the file that the CPU engine accepts but does not use."""
    ignored: list[tuple[str, Any, str]] = []
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization"):
        if key in raw:
            ignored.append((key, raw[key], "the CPU engine runs in one process without a GPU"))
    kv_raw = raw.get("kv_transfer_config", {})
    kv = config.kv_transfer_config
    if "kv_connector" in kv_raw and kv.kv_connector != OWN_CONNECTOR:
        ignored.append(("kv_transfer_config.kv_connector", kv.kv_connector, f"the CPU engine always uses {OWN_CONNECTOR} (TCP push)"))
    if kv.kv_connector_extra_config:
        ignored.append(("kv_transfer_config.kv_connector_extra_config", kv.kv_connector_extra_config, "vLLM connector options"))
    if not config.is_kv_consumer:
        for key, why in (("kv_port", "listens"), ("kv_buffer_size", "buffers")):
            if key in kv_raw:
                ignored.append((f"kv_transfer_config.{key}", kv_raw[key], f"only a KV consumer {why}; this is a {config.kv_role}"))
    return ignored


def load_config(path: str | Path, overrides: dict[str, Any] | None = None,
                env: Mapping[str, str] | None = None) -> tuple[EngineConfig, dict[str, Any]]:
    """Read and validate `path`, apply CLI `overrides` (dotted keys), then `KV_TRANSFER_PORT` from
    `env` (default os.environ) on a KV consumer unless `--kv-port` set the port, PD_PREFIX_CACHING, PD_ATTENTION and PD_GEMM;
    return (config, raw file dict).

    Overrides go through the same validation, so a bad `--kv-port` fails like a bad file value and a
    bad KV_TRANSFER_PORT names the variable.
    """
    raw = read_file(path)
    merged = dict(raw)
    if isinstance(raw.get("kv_transfer_config"), dict):
        merged["kv_transfer_config"] = dict(raw["kv_transfer_config"])  # overrides must not edit `raw`
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        target = merged
        *parents, leaf = dotted.split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    environ = os.environ if env is None else env
    for variable, (key, choices) in _ENV_CHOICES.items():
        text = environ.get(variable, "").strip()
        if text:
            if text not in choices:
                *others, last = choices
                raise ConfigError("environment", variable, f"must be {', '.join(others)} or {last}, got {text!r}")
            merged[key] = choices[text]
    config = build(EngineConfig, merged, path)
    if config.is_kv_consumer and (overrides or {}).get("kv_transfer_config.kv_port") is None:
        port = _env_kv_port(environ)
        if port is not None:
            config = replace(config, kv_transfer_config=replace(config.kv_transfer_config, kv_port=port))
    advertised = (os.environ if env is None else env).get(KV_HOST_ENV, "").strip()
    if config.is_kv_consumer and advertised:
        config = replace(config, kv_transfer_config=replace(config.kv_transfer_config, kv_advertise_host=advertised))
    return config, raw


def _env_kv_port(env: Mapping[str, str]) -> int | None:
    text = env.get(KV_PORT_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) > 65535:
        raise ConfigError("environment", KV_PORT_ENV, f"must be a TCP port (0-65535; 0 picks a free one), got {text!r}")
    return int(text)

