"""Shared test setup. Area fixtures live in each folder's own conftest.py."""

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

# Ryuk's image cannot be pulled where there is no registry; compose tests clean up themselves.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
# A log call whose fields differ from its event's declaration raises in tests (stack.common.logging's
# STRICT_ENV). Set before anything imports stack; the services tests start as subprocesses inherit it.
os.environ.setdefault("PD_LOG_STRICT", "1")

# Every process this test session starts inherits this mark (tests pass {**os.environ, …} to their services), so the
# session-end check below finds its own engines and routers, also those a dead parent left to init, and never
# those another checkout's tests run on the same machine at the same time.
SESSION_ENV = "PD_TEST_SESSION"
os.environ[SESSION_ENV] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
SERVICES = ("stack.engine", "stack.router")
LEFTOVER_GRACE_S = 10.0  # a service told to stop may still be draining (PD_STOP_DELAY_S) when the last test ends


def _proc(pid: int, name: str) -> bytes:
    try:
        return (Path("/proc") / str(pid) / name).read_bytes()
    except OSError:  # gone meanwhile, or not ours to read
        return b""


def _parent(pid: int) -> int:
    stat = _proc(pid, "stat")  # "pid (comm) state ppid …"; comm may hold spaces and parentheses
    return int(stat[stat.rindex(b")") + 2:].split()[1]) if stat else 0


def service_processes(mark: str, ancestor: int) -> dict[int, str]:
    """pid → command line of every live `python -m stack.engine` / `stack.router` that carries `mark` in its
    environment or descends from `ancestor`."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        argv = _proc(pid, "cmdline").decode(errors="replace").split("\0")
        if not any(a == "-m" and b in SERVICES for a, b in zip(argv, argv[1:])):
            continue
        ours = f"{SESSION_ENV}={mark}".encode() in _proc(pid, "environ").split(b"\0")
        parent = pid
        while not ours and parent > 1:
            parent = _parent(parent)
            ours = parent == ancestor
        if ours:
            found[pid] = " ".join(a for a in argv if a)
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if an engine or router this session started outlives it, then stop them: a green run leaves
    nothing behind."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := service_processes(os.environ[SESSION_ENV], os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(left)} engine/router process(es) started by this test session outlived it (stopped now):"]
    lines += [f"  pid {pid}: {cmd}" for pid, cmd in sorted(left.items())]
    if reporter is not None:
        reporter.ensure_newline()
    for line in lines:
        reporter.write_line(line, red=True) if reporter is not None else print(line)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
async def silent_address() -> AsyncIterator[str]:
    """HOST:PORT of a listener that accepts connections and never answers: what a hung service or a
    black-holed network looks like to a client (its probes time out, they are not refused)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.fixture
async def sdk() -> AsyncIterator[Callable[..., Any]]:
    """Official SDK clients closed in the test's own event loop: sdk(openai.AsyncOpenAI, base_url=…, api_key=…).
    (An unclosed httpx client is closed by the garbage collector later, on a loop that is gone.)"""
    clients: list[Any] = []

    def make(cls: Callable[..., Any], **kwargs: Any) -> Any:
        client = cls(max_retries=0, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()
