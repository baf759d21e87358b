"""Router front-end fixtures: a router app in-process (real config loader, real SQLite) over a backend.

Two backends. `RealEngine` is a real `python -m stack.engine` process (role both, dummy:tiny
weights) on loopback: the SDK tests run over it. `FakeEngine` is a small OpenAI-wire stand-in
(chat/completions streamed with `stream_options.include_usage` as our engine answers, plus
`/v1/models`) with deterministic hooks the front-end behaviour tests need. The router runs in
colocated mode (prefill endpoint == decode endpoint: one plain request); PD end-to-end over
prefill + decode engines lives in tests/unit/router_pd/.
A user message containing "BREAK" makes the stand-in cut its stream after two chunks; one
containing "HOLD" waits for `engine.release` before answering (to keep requests in flight); "SLOW"
spaces its chunks 50 ms apart; "INBAND" sends a vLLM-style in-band error frame after two chunks (then
[DONE]); "SPACED" writes its frames with json.dumps' default spacing (the bytes tell a frame relayed
undecoded from one re-encoded). `engine.frames` keeps every stream's data frames as sent.
"""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from stack.common import sse
from stack.common.health_probe import SERVING, probe
from stack.common.logging import setup_logging
from stack.router import config as router_config
from stack.router.app import create_app
from tests.ports import free_port

KEY = "pd-test-unified-key-1a2b3c"
KEY_ENV = "TAOTOKEN_API_KEY"
MODEL = "your-model-id"
BACKEND_MODEL = "fake/tiny-engine"
WORDS = ["Hello", " from", " the", " fake", " engine", ".", " More", " words", " follow", " here"]


class FakeEngine:
    """An OpenAI-wire backend: deterministic words, usage by prompt length, optional mid-stream break."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.frames: list[list[bytes]] = []  # per streamed answer, each data frame's bytes as sent
        self.release = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/chat/completions", self.generate)
        self.app.router.add_post("/v1/completions", self.generate)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": BACKEND_MODEL, "object": "model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"path": request.path, "body": body, "request_id": request.headers.get("X-Request-ID")})
        chat = request.path.endswith("chat/completions")
        prompt = json.dumps(body.get("messages") if chat else body.get("prompt"))
        if "HOLD" in prompt:
            await self.release.wait()
        if "REFUSE" in prompt:  # a value only the engine checks, refused in vLLM's shape
            return web.json_response({"error": {"message": "seed must be below 2**63 (stand-in)", "type": "BadRequestError",
                                                "param": "seed", "code": 400}}, status=400)
        n = min(body.get("max_tokens") or 8, len(WORDS))
        usage = {"prompt_tokens": len(prompt) // 4, "completion_tokens": n, "total_tokens": len(prompt) // 4 + n}
        finish = "length" if n < len(WORDS) else "stop"
        base = {"id": "cmpl-fake", "created": int(time.time()), "model": BACKEND_MODEL}
        if not body.get("stream"):
            text = "".join(WORDS[:n])
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            return web.json_response({**base, "object": "chat.completion" if chat else "text_completion",
                                      "choices": [{**choice, "finish_reason": finish}], "usage": usage})
        response = await sse.open_stream(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        sent: list[bytes] = []
        self.frames.append(sent)

        async def send(data: dict[str, Any]) -> None:
            sent.append(json.dumps(data).encode() if "SPACED" in prompt else sse.dumps(data))
            await response.write(b"data: " + sent[-1] + b"\n\n")

        for i, word in enumerate(WORDS[:n]):
            if i == 2 and "BREAK" in prompt:
                request.transport.close()  # the engine dies mid-stream
                return response
            if i == 2 and "INBAND" in prompt:
                await send({"error": {"message": "decode step failed (stand-in)", "type": "InternalServerError", "code": 500}})
                await sse.send_done(response)
                return response
            if "SLOW" in prompt:
                await asyncio.sleep(0.05)
            choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
            choice["finish_reason"] = finish if i == n - 1 else None
            await send({**base, "object": kind, "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({**base, "object": kind, "choices": [], "usage": usage})
        await sse.send_done(response)
        return response


class ServiceProcess:
    """A service (`python -m stack.engine` or `stack.router`) started with `args`, logging to `log_path`; the
    constructor returns once its gRPC health at `health_addr` says SERVING (within `bound_s`: the bound only
    catches a hung or crashed start)."""

    def __init__(self, name: str, args: list[str], log_path: Path, health_addr: str, *, env: dict[str, str] | None = None,
                 bound_s: float = 60) -> None:
        self.log_path = log_path
        self.log = log_path.open("w")
        self.process = subprocess.Popen([sys.executable, "-m", *args], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + bound_s
        while probe(health_addr, timeout=0.5) != SERVING:
            assert self.process.poll() is None, f"{name} exited early: {log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"{name} not SERVING after {bound_s:g} s"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class RealEngine(ServiceProcess):
    """A `python -m stack.engine` process, role both, dummy:tiny weights, on free loopback ports."""

    def __init__(self, workdir: Path) -> None:
        self.port, self.health_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.health_addr = f"127.0.0.1:{self.health_port}"
        config = workdir / "engine.json"
        config.write_text(json.dumps({"model": MODEL, "role": "both", "checkpoint": "dummy:tiny",
                                      "kv_transfer_config": {"kv_port": 0}}))
        super().__init__("engine", ["stack.engine", "--config", str(config), "--host", "127.0.0.1", "--port", str(self.port),
                                    "--health-port", str(self.health_port)], workdir / "engine.log", self.health_addr)


@pytest.fixture(scope="module")
def real_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    engine = RealEngine(tmp_path_factory.mktemp("engine"))
    yield engine
    engine.stop()


@pytest.fixture
async def engine() -> Any:
    fake = FakeEngine()
    server = TestServer(fake.app, host="127.0.0.1")
    await server.start_server()
    fake.url = f"http://127.0.0.1:{server.port}"  # type: ignore[attr-defined]
    yield fake
    await server.close()


@pytest.fixture
def logs() -> io.StringIO:
    """Everything the router logs during the test, DEBUG lines included, as JSON lines."""
    sink = io.StringIO()
    setup_logging("router", level="DEBUG", sink=sink)
    return sink


def log_events(sink: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in sink.getvalue().splitlines() if line.strip()]


async def wait_for_events(sink: io.StringIO, event: str, count: int, bound_s: float = 5) -> list[dict[str, Any]]:
    """The `event` lines once there are `count` of them: a request's summary line follows its usage commit, a loop
    turn after a stream's last byte (the bound only catches a line that never comes)."""
    deadline = time.monotonic() + bound_s
    while len(lines := [e for e in log_events(sink) if e["event"] == event]) < count:
        assert time.monotonic() < deadline, f"{len(lines)} of {count} {event} lines after {bound_s:g} s"
        await asyncio.sleep(0.01)
    return lines


def write_settings(tmp_path: Path, engine_url: str, limits: str = "", extra: str = "", health: str = "",
                   taotoken: str = "", usage: str = "") -> Path:
    """A settings.toml for a colocated router over `engine_url`, usage in tmp_path."""
    health_lines = f'health_addrs = ["{health}"]' if health else ""
    interval = 500 if health else 0
    path = tmp_path / "settings.toml"
    path.write_text(f"""
[server]
host = "127.0.0.1"
port = 0
max_body_bytes = 65536
[taotoken]
api_key_env = "{KEY_ENV}"
model_id = "{MODEL}"
{taotoken}
[prefill]
endpoint = "{engine_url}"
{health_lines}
[decode]
endpoint = "{engine_url}"
{health_lines}
[scheduler]
health_interval_ms = {interval}
[usage]
db_path = "{tmp_path / 'usage.sqlite3'}"
{usage}
[limits]
{limits}
{extra}
""")
    return path


RouterFactory = Callable[..., Any]


@pytest.fixture
async def make_router(tmp_path: Path, engine: FakeEngine) -> Any:
    """Start routers (in-process, on a free loopback port) with settings and env; all closed at the end."""
    clients: list[TestClient] = []

    async def start(limits: str = "", extra: str = "", env: dict[str, str] | None = None,
                    backend: RealEngine | None = None, taotoken: str = "", usage: str = "") -> TestClient:
        """A router over the stand-in engine, or over `backend` (a real engine, health-checked over gRPC)."""
        url = backend.url if backend else engine.url  # type: ignore[attr-defined]
        settings = write_settings(tmp_path, url, limits, extra, backend.health_addr if backend else "", taotoken, usage)
        config = router_config.load(settings, env={})
        app = create_app(config, env={KEY_ENV: KEY} if env is None else env)
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


@pytest.fixture
async def router(make_router: RouterFactory) -> TestClient:
    return await make_router()


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 4, **extra}
