"""Run an aiohttp app plus its gRPC health server until SIGTERM/SIGINT (engine and router mains).

Order: health server up (NOT_SERVING) → HTTP site listening → `warmup()` → SERVING →
wait for a signal → NOT_SERVING → stop accepting, let in-flight requests finish → exit.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from stack.common import events
from stack.common.health import start_health_server
from stack.common.logging import AccessLogger, log_event


async def serve(
    app: web.Application,
    *,
    host: str,
    port: int,
    health_port: int,
    warmup: Callable[[], Awaitable[None]] | None = None,
    shutdown_timeout: float = 10.0,
) -> None:
    health = await start_health_server(health_port, host)
    # handler_cancellation: a client that disconnects cancels its handler, so a non-streamed request
    # stops its upstream work too (the router's PD legs, the engine's sequence). aiohttp's TestServer,
    # which the in-process tests use, does the same.
    runner = web.AppRunner(app, access_log_class=AccessLogger, shutdown_timeout=shutdown_timeout, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    started = time.perf_counter()
    if warmup is not None:
        await warmup()
    await health.set_serving()
    log_event(
        events.SERVICE_READY,
        f"serving HTTP on {host}:{port}, gRPC health on {host}:{health.port}",
        host=host,
        port=port,
        health_port=health.port,
        warmup_ms=round((time.perf_counter() - started) * 1000, 1),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log_event(events.SERVICE_STOPPING, "signal received; draining")
    await health.set_not_serving()
    await runner.cleanup()
    await health.stop()
