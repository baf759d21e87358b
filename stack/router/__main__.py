"""`python -m stack.router [--config router/settings.toml]`: the router (HTTP 8080, gRPC health 50052).

A bad config prints one line naming file, key and problem, and exits 2; so does a port another process holds
(which port, which process when /proc shows it, what to set).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys

import uvloop

from stack.common import events
from stack.common.config import ConfigError
from stack.common.logging import log_event, setup_logging
from stack.common.server import PortInUse, serve
from stack.router import config as router_config
from stack.router.app import create_app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stack.router", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="router/settings.toml", help="path to settings.toml (default router/settings.toml)")
    parser.add_argument("--host", help="override [server] host")
    parser.add_argument("--port", type=int, help="override [server] port")
    parser.add_argument("--health-port", type=int, help="override [server] health_port")
    args = parser.parse_args(argv)
    setup_logging("router")
    try:
        config = router_config.load(args.config)
        app = create_app(config)
    except ConfigError as exc:
        log_event(events.CONFIG_INVALID, str(exc), "ERROR", file=exc.file, key=exc.key, problem=exc.problem)
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    # The cyclic collector was one of the largest items in a perf profile of PD requests (docs/router-performance.md).
    # Everything made so far (modules, the app) lives as long as the process: collected once, then frozen out of the
    # collector's walks. And a young collection every 10,000 new objects instead of 700: with many requests in flight,
    # frequent ones promoted their live objects to the older generations, which are walked again and again.
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    server = config.server
    log_event(events.SERVICE_STARTING, f"router starting with {args.config}", config=args.config,
              prefill=list(config.prefill.urls) or [config.prefill.discover], decode=list(config.decode.urls) or [config.decode.discover],
              policy=config.scheduler.policy)
    try:
        # uvloop: the stock loop and its transports were a sixth of the router's CPU per request (docs/router-performance.md).
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(app, host=args.host or server.host, port=args.port if args.port is not None else server.port,
                             health_port=args.health_port if args.health_port is not None else server.health_port,
                             header_timeout_s=server.header_timeout_ms / 1000))
    except PortInUse as exc:
        setting = _SETTINGS[exc.kind]
        log_event(events.SERVICE_PORT_IN_USE, f"{exc}; set {setting}", "ERROR", port=exc.port, setting=setting,
                  **({"owner": exc.owner} if exc.owner else {}))
        print(f"router: {exc}; stop it or set {setting} in {args.config}", file=sys.stderr)
        return 2
    return 0


# What to change when a port is taken.
_SETTINGS = {"HTTP": "[server] port (or --port)", "gRPC health": "[server] health_port (or --health-port)"}


if __name__ == "__main__":
    sys.exit(main())
