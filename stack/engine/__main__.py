"""`python -m stack.engine --config prefill/config.json --host H --port P --health-port G`

Starts one engine (role from the config): loads the model, listens for HTTP (OpenAI API), gRPC
health (SERVING after a warm-up forward) and, for KV consumers, the KV port. A bad config or
checkpoint prints one line naming the file, key and problem and exits with code 2.
"""

from __future__ import annotations

import os

from stack.engine import blas_env  # before anything loads numpy

blas_env.apply_defaults()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from stack.common import events
from stack.common.config import ConfigError
from stack.common.logging import log_event, setup_logging
from stack.common.server import serve
from stack.engine.config import EngineConfig, ignored_fields, load_config
from stack.engine.errors import CheckpointError
from stack.engine.model import Model, load_model

EXIT_CONFIG = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stack.engine", description="CPU LLM engine: role prefill, decode or both (colocated).")
    parser.add_argument("--config", required=True, help="engine config.json (prefill/config.json, decode/config.json or colocated/config.json)")
    parser.add_argument("--host", default="0.0.0.0", help="address for HTTP and gRPC health (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI API (default 8000)")
    parser.add_argument("--health-port", type=int, default=50051, help="gRPC health port (default 50051)")
    parser.add_argument("--checkpoint", default=os.environ.get("PD_CHECKPOINT") or None,
                        help="override the config's checkpoint: dummy:tiny, dummy:small or an HF directory (env PD_CHECKPOINT)")
    parser.add_argument("--kv-port", type=int, default=None,
                        help="override kv_transfer_config.kv_port and KV_TRANSFER_PORT, 0 = any free port (local runs, tests)")
    parser.add_argument("--seed", type=int, default=_env_int("PD_SEED"), help="override the dummy-weight seed (env PD_SEED)")
    parser.add_argument("--service-name", default=os.environ.get("PD_SERVICE_NAME") or None,
                        help="`service` field of every log line (default: the role; env PD_SERVICE_NAME)")
    parser.add_argument("--log-level", default=os.environ.get("PD_LOG_LEVEL", "INFO"), help="DEBUG, INFO, WARNING… (default INFO)")
    return parser.parse_args(argv)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.lstrip("-").isdigit() else None


def load(args: argparse.Namespace) -> tuple[EngineConfig, Model, dict]:
    """Config then model; raises ConfigError (the model's problems are reported against `checkpoint`)."""
    overrides = {"checkpoint": args.checkpoint, "seed": args.seed, "kv_transfer_config.kv_port": args.kv_port}
    config, raw = load_config(args.config, overrides)
    try:
        model = load_model(config.checkpoint, config.seed, config.gemm)
    except CheckpointError as exc:
        raise ConfigError(args.config, "checkpoint", str(exc)) from None
    if config.max_model_len is not None and config.max_model_len > model.config.max_seq_len:
        raise ConfigError(args.config, "max_model_len", f"{config.max_model_len} exceeds the model's max_seq_len {model.config.max_seq_len}")
    return config, model, raw


def _config_failed(exc: ConfigError) -> int:
    log_event(events.CONFIG_INVALID, str(exc), "ERROR", file=exc.file, key=exc.key, problem=exc.problem)
    print(f"error: {exc}", file=sys.stderr)
    return EXIT_CONFIG


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.service_name or "engine", args.log_level)
    started = time.perf_counter()
    try:
        config, model, raw = load(args)
    except ConfigError as exc:
        return _config_failed(exc)
    if args.service_name is None:  # named by role; a colocated engine ("both") is the doctor's "engine"
        setup_logging("engine" if config.role == "both" else config.role, args.log_level)
    log_event(events.SERVICE_STARTING, f"engine role {config.role} serving {config.model} ({model.name})", config=args.config,
              role=config.role, kv_role=config.kv_role, model=config.model, checkpoint=config.checkpoint,
              fingerprint=model.fingerprint, load_ms=round((time.perf_counter() - started) * 1000, 1))
    for key, value, why in ignored_fields(config, raw):
        log_event(events.CONFIG_IGNORED, f"{key}={value!r} is accepted but ignored: {why}", key=key, value=value)

    from stack.engine.server import create_app, warm_up  # after logging: importing is not free

    try:
        app = create_app(config, model)
    except ConfigError as exc:  # PD_INTERNAL_KEY_FILE names a file it cannot read
        return _config_failed(exc)
    asyncio.run(serve(app, host=args.host, port=args.port, health_port=args.health_port, warmup=lambda: warm_up(app)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
