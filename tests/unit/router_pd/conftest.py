"""Fixtures for the router's PD tests: fake engines (faults), real engine processes, PDClient builders."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import aiohttp
import pytest

from stack.common.health import SERVING, probe_async
from stack.common.logging import setup_logging
from stack.router.backends import PoolConfig
from stack.router.config import RouterConfig
from stack.router.metrics import Metrics
from stack.protocol.parse import parse
from stack.protocol.types import Request
from stack.router.fleet import Fleet
from stack.router.pd import PDClient
from stack.router.scheduler import SchedulerConfig
from tests.ports import free_port
from tests.unit.router_pd.fake_engine import FakeEngine

REPO = Path(__file__).resolve().parents[3]


class LogCapture:
    """JSON log lines written during a test (a text sink for setup_logging)."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def write(self, text: str) -> None:
        self.lines.extend(json.loads(line) for line in text.splitlines() if line.strip())

    def flush(self) -> None:
        pass

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["event"] == name]


@pytest.fixture
def logs() -> LogCapture:
    capture = LogCapture()
    setup_logging("router", sink=capture)  # type: ignore[arg-type]
    return capture


# Real engines started here answer only callers with this key (stack/common/internal_auth.py), as in compose.
INTERNAL_KEY = "pd-test-internal-key-0123456789"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """The router's upstream session in these tests: it carries the internal key, as upstream.new_session does."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {INTERNAL_KEY}"}) as s:
        yield s


@pytest.fixture
async def fake() -> AsyncIterator[Callable[..., Any]]:
    started: list[FakeEngine] = []

    async def start(role: str, **kwargs: Any) -> FakeEngine:
        engine = await FakeEngine(role, **kwargs).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        await engine.stop()


def pool(engines: Sequence[Any], max_concurrent: int = 8, health_check: str = "grpc") -> PoolConfig:
    """A PoolConfig over started engines (anything with url and health_addr); decodes tell their KV port on GET /health."""
    return PoolConfig(endpoints=tuple(e.url for e in engines), max_concurrent=max_concurrent, health_check=health_check,
                      health_addrs=tuple(e.health_addr for e in engines))


@pytest.fixture
async def pd(session: aiohttp.ClientSession) -> AsyncIterator[Callable[..., Any]]:
    """Build and start a PDClient: await pd(prefills, decodes, max_concurrent=…, clock=…, **scheduler settings)."""
    clients: list[PDClient] = []

    async def build(prefills: Sequence[Any], decodes: Sequence[Any], max_concurrent: int = 8, health_check: str = "grpc",
                    clock: Callable[[], float] = time.monotonic, kv_addrs: tuple[str, ...] = (), kv_transfer_port: int = 0,
                    **settings: Any) -> PDClient:
        settings.setdefault("health_interval_ms", 200)
        decode = dataclasses.replace(pool(decodes, max_concurrent, health_check), kv_addrs=kv_addrs)
        config = RouterConfig(prefill=pool(prefills, max_concurrent, health_check), decode=decode,
                              scheduler=SchedulerConfig(**settings), kv_transfer_port=kv_transfer_port)
        metrics = Metrics()
        client = PDClient(Fleet(config, session, metrics, clock=clock), metrics)
        await client.fleet.start()
        clients.append(client)
        return client

    yield build
    for client in clients:
        await client.fleet.close()


async def batches(client: PDClient, *args: Any, **kwargs: Any) -> AsyncIterator[list[Any]]:
    """`client.open(*args, **kwargs)` read as an async generator of chunk batches, closed however the caller stops."""
    stream = await client.open(*args, **kwargs)
    try:
        while (batch := await stream.next()) is not None:
            yield batch
    finally:
        stream.close()


def typed(body: dict[str, Any]) -> tuple[Request, dict[str, Any]]:
    """A body as the API front ends hand it to PDClient: parsed (stack.protocol), and as the engines get it."""
    return parse("chat" if "messages" in body else "completion", body), body


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Wait until `predicate()` holds (polled every 10 ms); the bound only catches a hang."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"still not {what} after {timeout_s} s"
        await asyncio.sleep(0.01)


def backend(client: PDClient, url: str) -> Any:
    """The router's Backend for `url`."""
    return next(b for b in client.fleet.scheduler.backends if b.url == url)


async def wait_for_state(client: PDClient, url: str, state: str, timeout_s: float = 10.0) -> None:
    """Wait until the router sees backend `url` in `state` ("up"/"down"); the bound only catches a hang."""
    deadline = time.monotonic() + timeout_s
    while (seen := next(b["state"] for b in client.health_snapshot()["backends"] if b["url"] == url)) != state:
        assert time.monotonic() < deadline, f"{url} still {seen} after {timeout_s} s, expected {state}"
        await asyncio.sleep(0.02)


def relay_app(client: PDClient) -> Any:
    """The smallest OpenAI front over a PDClient (what api/openai.py does): SSE out, in-band error once started."""
    from aiohttp import web

    from stack.common.errors import REQUEST_ID, APIError, error_middleware, openai_error_body, request_id_middleware
    from stack.common.sse import open_stream, send_done, send_event

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        api = "completions" if request.path == "/v1/completions" else "chat"
        if not body.get("stream"):
            return web.json_response(await client.complete(request[REQUEST_ID], api, request.path, *typed(body)))
        decode = await client.open(request[REQUEST_ID], api, request.path, *typed(body))
        stream = await open_stream(request)
        try:
            while (batch := await decode.next()) is not None:
                for chunk in batch:
                    await send_event(stream, chunk)
        except APIError as err:
            await send_event(stream, openai_error_body(err))
            await stream.write_eof()
            return stream
        finally:
            decode.close()
        await send_done(stream)
        return stream

    app = web.Application(middlewares=[request_id_middleware, error_middleware()])
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_post("/v1/completions", handle)
    return app


class EngineProcess:
    """A real `python -m stack.engine` process on loopback, logging JSON lines to a file."""

    def __init__(self, role: str, tmp_path: Any, checkpoint: str = "dummy:tiny", host: str = "127.0.0.1",
                 ports: tuple[int, int] | None = None) -> None:
        """`host`, `ports` (HTTP, gRPC health): a replica of a discover pool (test_replicas.py); default free ports."""
        self.role = role
        self.checkpoint = checkpoint
        self.host = host
        (self.port, self.health_port), self.kv_port = ports or (free_port(), free_port()), free_port()
        self.url = f"http://{host}:{self.port}"
        self.health_addr = f"{host}:{self.health_port}"
        self.log_path = tmp_path / f"{role}-{host}-{self.port}.log"
        source = "decode" if role == "both" else role
        config = json.loads((REPO / source / "config.json").read_text())
        config["role"] = role
        if role == "both":
            config["kv_transfer_config"].pop("kv_role", None)
        self.config_path = tmp_path / f"{role}-{host}-{self.port}.json"
        self.config_path.write_text(json.dumps(config))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EngineProcess:
        cmd = [sys.executable, "-m", "stack.engine", "--config", str(self.config_path), "--host", self.host, "--port", str(self.port),
               "--health-port", str(self.health_port), "--kv-port", str(self.kv_port), "--checkpoint", self.checkpoint]
        self.proc = subprocess.Popen(cmd, stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "PD_INTERNAL_KEY": INTERNAL_KEY})
        return self

    async def ready(self, timeout_s: float = 60.0) -> None:
        """Wait for gRPC health SERVING (upper bound: model build + warm-up on a busy 2-core box)."""
        deadline = time.monotonic() + timeout_s
        while await probe_async(self.health_addr, 1.0) != SERVING:
            assert self.proc is not None and self.proc.poll() is None, f"{self.role} engine exited: {self.log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"{self.role} engine not SERVING after {timeout_s}s"
            await asyncio.sleep(0.2)

    def kill(self) -> None:
        assert self.proc is not None, "not started"
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def events(self, name: str) -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]
        return [line for line in lines if line.get("event") == name]


def router_settings(tmp_path: Path, name: str, prefill: Any, decode: Any, model_id: str, server: str = "") -> Path:
    """A settings.toml for a router over real engines; `server` adds [server] lines (port, health_port)."""
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[server]
host = "127.0.0.1"
{server}
[taotoken]
api_key_env = "PD_TEST_KEY"
model_id = "{model_id}"
[prefill]
endpoint = "{prefill.url}"
health_addrs = ["{prefill.health_addr}"]
[decode]
endpoint = "{decode.url}"
health_addrs = ["{decode.health_addr}"]
[usage]
db_path = "{tmp_path / (name + '.sqlite3')}"
""")
    return path


@pytest.fixture
async def engines(tmp_path: Any) -> AsyncIterator[Callable[..., Any]]:
    """Start real engines: `p, d = await engines("prefill", "decode")` (in parallel; stopped after the test).

    dummy:tiny by default; `checkpoint="dummy:small"` where a generation must last long enough to be interrupted.
    """
    started: list[EngineProcess] = []

    async def start(*roles: str, checkpoint: str = "dummy:tiny") -> list[EngineProcess]:
        batch = [EngineProcess(role, tmp_path, checkpoint).start() for role in roles]
        started.extend(batch)
        await asyncio.gather(*(engine.ready() for engine in batch))
        return batch

    yield start
    for engine in started:
        engine.stop()
