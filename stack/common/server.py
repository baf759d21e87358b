"""Run an aiohttp app plus its gRPC health server until SIGTERM/SIGINT (engine and router mains).

Order: health server up (NOT_SERVING) → HTTP site listening → `warmup()` → SERVING → liveness
watchdog → wait for a signal → (`PD_STOP_DELAY_S`: keep serving) → NOT_SERVING → stop accepting, let in-flight
requests finish → exit.

`PD_STOP_DELAY_S` (default 0) is Kubernetes' preStop sleep: a replaced replica keeps serving that long after SIGTERM,
so a router that discovers replicas by DNS (interval + a health probe) has found the new one before the old one
leaves. Swarm's start-first update stops the old task the moment the new one is healthy; with a single replica
and no delay the pool is empty for that gap (deploy/swarm/stack.yaml sets it).

Self-healing (issue 12). Docker's restart policies act only on a container that exits; an
*unhealthy* one keeps running (moby/moby#28400, open since 2016; `--exit-on-unhealthy` was cut from
the healthcheck PR moby/moby#22719; docker/compose#4826). Swarm and Kubernetes restart unhealthy
tasks, plain compose does not, and the usual add-on (willfarrell/autoheal) is an image this offline
project cannot pull and which would need the Docker socket. So each service does what
`--exit-on-unhealthy` would have: `LivenessWatchdog`, a thread outside the event loop, runs the
compose health check's own probe (stack.common.health_probe) against this process every
`PD_LIVENESS_INTERVAL_S`; after `PD_LIVENESS_FAILURES` failures in a row (Kubernetes'
periodSeconds × failureThreshold) it logs `service.liveness_failed` and exits 70, and compose's
`restart: unless-stopped` starts a fresh process. It begins only after SERVING (the compose
`start_period` covers start-up) and stops before draining. PD_LIVENESS_FAILURES=0 turns it off.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from stack.common import events
from stack.common.health import start_health_server
from stack.common.health_probe import SERVING, probe
from stack.common.logging import AccessLogger, _Output, log_event

LIVENESS_EXIT_CODE = 70  # EX_SOFTWARE: the process is alive but does not answer its own health check


class PortInUse(Exception):
    """The HTTP or health port is taken; `owner` names the process listening there when /proc shows it."""

    def __init__(self, port: int, kind: str, owner: str | None) -> None:
        super().__init__(f"{kind} port {port} is already in use" + (f" by {owner}" if owner else ""))
        self.port, self.kind, self.owner = port, kind, owner


def _check_free(host: str, port: int, kind: str) -> None:
    if not port:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe_socket:
        probe_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is not "in use"
        try:
            probe_socket.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(port, kind, port_owner(port)) from None
            raise


def port_owner(port: int) -> str | None:
    """`comm (pid N)` of the process listening on TCP `port`, from /proc (None: not Linux, or not ours to see)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    fields = row.split()  # sl local_address rem_address st ... inode
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(f"socket:[{fields[9]}]")
        except OSError:
            continue
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                with open(f"/proc/{pid}/comm") as comm:
                    return f"{comm.read().strip()} (pid {pid})"
        except OSError:  # another user's process, or one that just exited
            continue
    return None


class LivenessWatchdog:
    """Exits the process when its own health check fails `failures` times in a row (see the module doc)."""

    def __init__(self, health_addr: str, interval_s: float, failures: int, exit: Callable[[int], None] = os._exit) -> None:
        self.health_addr = health_addr
        self.interval_s = interval_s
        self.failures = failures
        self._exit = exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness-watchdog", daemon=True)

    @classmethod
    def from_env(cls, host: str, health_port: int) -> LivenessWatchdog | None:
        failures = int(os.environ.get("PD_LIVENESS_FAILURES", "6"))
        interval = float(os.environ.get("PD_LIVENESS_INTERVAL_S", "5"))
        target = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host  # where the health server listens
        return cls(f"{target}:{health_port}", interval, failures) if failures > 0 and interval > 0 else None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        streak, first_failure = 0, 0.0
        while not self._stop.wait(self.interval_s):
            state = probe(self.health_addr, timeout=min(self.interval_s, 5.0))
            if state == SERVING or self._stop.is_set():
                streak = 0
                continue
            streak += 1
            first_failure = first_failure if streak > 1 else time.monotonic()
            if streak >= self.failures:
                stalled = round(time.monotonic() - first_failure + self.interval_s, 1)
                log_event(events.SERVICE_LIVENESS_FAILED, f"own health check failed {streak} times in a row ({state}); exiting "
                          f"{LIVENESS_EXIT_CODE} so the restart policy starts a fresh process", "ERROR",
                          stalled_s=stalled, limit_s=self.failures * self.interval_s)
                _Output.stream.flush()
                self._exit(LIVENESS_EXIT_CODE)
                return


async def serve(
    app: web.Application,
    *,
    host: str,
    port: int,
    health_port: int,
    warmup: Callable[[], Awaitable[None]] | None = None,
    shutdown_timeout: float = 10.0,
    header_timeout_s: float = 75.0,
) -> None:
    """`header_timeout_s`: a connection must deliver a complete request head within this long of opening (or of its
    last answer), else it is closed: slowloris and idle sockets cannot pile up. aiohttp arms this timer at connect
    (its keepalive_timeout); engines keep it above the router's client keep-alive (30 s) so they never close a
    connection the router is about to reuse."""
    stop_delay_s = float(os.environ.get("PD_STOP_DELAY_S") or 0)  # read at start: a bad value fails now, not at stop
    # Before anything starts: a taken port is one line (PortInUse), not a traceback after the app's start-up ran
    # (grpcio would also print its own C-level lines).
    _check_free(host, port, "HTTP")
    _check_free(host, health_port, "gRPC health")
    health = await start_health_server(health_port, host)
    # handler_cancellation: a client that disconnects cancels its handler, so a non-streamed request
    # stops its upstream work too (the router's PD legs, the engine's sequence). aiohttp's TestServer,
    # which the in-process tests use, does the same.
    # auto_decompress=False: a Content-Encoding body reaches the app as sent, so the router answers 415 in its API's
    # shape (aiohttp would otherwise fail to decode it in its parser: a plain-text 400, or an ERROR after the answer).
    runner = web.AppRunner(app, access_log_class=AccessLogger, shutdown_timeout=shutdown_timeout, handler_cancellation=True,
                           keepalive_timeout=header_timeout_s, auto_decompress=False)
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
    watchdog = LivenessWatchdog.from_env(host, health.port)
    if watchdog is not None:
        watchdog.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if watchdog is not None:
        watchdog.stop()
    log_event(events.SERVICE_STOPPING, "signal received; draining")
    await asyncio.sleep(stop_delay_s)
    await health.set_not_serving()
    await runner.cleanup()
    await health.stop()
