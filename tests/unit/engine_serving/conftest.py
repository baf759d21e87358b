"""Fixtures for the engine serving tests: in-process engine apps, engine subprocesses, log capture.

In-process apps (`engine_client`) are fast and let a test read the scheduler and KV buffer state;
subprocesses (`EngineProcess`) are used where the test is about processes (PD over the KV socket
between two engines, start-up failures, exit codes).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from stack.common.config import build
from stack.common.logging import setup_logging
from stack.engine.config import EngineConfig
from stack.engine.model import Model, load_model
from stack.engine.scheduler import Scheduler
from stack.engine.server import ENGINE, Engine, create_app
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 30  # an engine subprocess is up in ~1-2 s; 30 s only catches a hang on a busy box


def engine_config(role: str = "both", **fields: Any) -> EngineConfig:
    """A dummy:tiny engine config as a file would give it (kv fields under `kv`)."""
    kv = {"kv_port": 0, **fields.pop("kv", {})}
    data = {"model": "tiny", "role": role, "checkpoint": "dummy:tiny", "kv_transfer_config": kv, **fields}
    return build(EngineConfig, data, "test-config.json")


@pytest.fixture(scope="session")
def tiny() -> Model:
    return load_model("dummy:tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_other_seed() -> Model:
    return load_model("dummy:tiny", seed=1)


@dataclass
class EngineHandle:
    client: TestClient
    engine: Engine

    @property
    def kv_addr(self) -> str:
        consumer = self.engine.handoff.consumer
        assert consumer is not None, "this engine has no KV consumer"
        return f"127.0.0.1:{consumer.port}"


@pytest.fixture
def engine_client(aiohttp_client: Callable, tiny: Model) -> Callable:
    """`await engine_client(role, model=None, **config fields)` -> EngineHandle (in-process app)."""

    async def start(role: str = "both", model: Model | None = None, **fields: Any) -> EngineHandle:
        app = create_app(engine_config(role, **fields), model or tiny)
        client = await aiohttp_client(app)
        return EngineHandle(client, app[ENGINE])

    return start


class Logs:
    """Log lines captured from in-process engines, parsed."""

    def __init__(self) -> None:
        self.sink = io.StringIO()

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.sink.getvalue().splitlines() if line.strip()]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines() if line["event"] == name]

    def one(self, name: str) -> dict[str, Any]:
        found = self.events(name)
        assert len(found) == 1, f"expected one {name} line, got {len(found)}: {found}"
        return found[0]


@pytest.fixture
def logs() -> Iterator[Logs]:
    captured = Logs()
    setup_logging("engine-test", sink=captured.sink)
    yield captured


@pytest.fixture(autouse=True)
def _logging_back_to_stdout() -> Iterator[None]:
    """Tests redirect logging (the `logs` fixture, main() under capsys); the next test starts clean."""
    yield
    setup_logging("engine-test")


@pytest.fixture
async def run_schedulers() -> AsyncIterator[Callable[[Scheduler], Scheduler]]:
    """`run_schedulers(s)` starts `s`'s step loop; every one started is stopped after the test."""
    started: list[Scheduler] = []

    def start(s: Scheduler) -> Scheduler:
        s.start()
        started.append(s)
        return s

    yield start
    for s in started:
        await s.stop()


def chat(content: str = "hello there", **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **fields}


async def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll `condition` (a hang guard only: 5 s is far above the ~10-300 ms these states take)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def prefill_leg(body: dict[str, Any], transfer_id: str, decode_kv_addr: str) -> dict[str, Any]:
    """The prefill leg exactly as the router builds it (design §2)."""
    leg = {k: v for k, v in body.items() if k != "stream_options"}
    return leg | {"max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id, "decode_kv_addr": decode_kv_addr}}


# -- subprocess engines ----------------------------------------------------------------------------


class EngineProcess:
    """`python -m stack.engine` on free ports; stdout JSON lines are collected as they come, and waits
    wake on each new line (or on the process closing its stdout) instead of polling."""

    def __init__(self, tmp: Path, name: str, config: dict[str, Any], extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.config_path = tmp / f"{name}.json"
        self.config_path.write_text(json.dumps(config))
        self.port, self.health_port = free_port(), free_port()
        self.lines: list[dict[str, Any]] = []
        self._arrived = threading.Condition()  # notified per line and at end of output
        self._output_closed = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stack.engine", "--config", str(self.config_path), "--host", "127.0.0.1",
             "--port", str(self.port), "--health-port", str(self.health_port), "--service-name", name, *extra_args],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                with self._arrived:
                    self.lines.append(json.loads(line))
                    self._arrived.notify_all()
        with self._arrived:
            self._output_closed = True
            self._arrived.notify_all()

    def _wait_for_event(self, name: str, timeout: float) -> bool:
        """True once a `name` line is in; False if the output closed or `timeout` passed first."""
        with self._arrived:
            self._arrived.wait_for(lambda: bool(self.events(name)) or self._output_closed, timeout)
            return bool(self.events(name))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> EngineProcess:
        if not self._wait_for_event("service.ready", START_TIMEOUT_S):
            exited = self._output_closed  # it ended; a hang leaves stderr unread (reading it would block)
            stderr = self.proc.communicate(timeout=10)[1] if exited else ""
            raise AssertionError(f"engine did not start (rc={self.proc.poll()}): {stderr} {self.lines}")
        return self

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in list(self.lines) if line.get("event") == name]

    def wait_event(self, name: str, timeout: float = 10.0) -> dict[str, Any]:
        assert self._wait_for_event(name, timeout), f"no {name} in {self.lines[-5:]}"
        return self.events(name)[0]

    def kv_port(self) -> int:
        return self.wait_event("kv_consumer.listening")["kv_port"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., EngineProcess]]:
    started: list[EngineProcess] = []

    def start(name: str, config: dict[str, Any], *extra_args: str) -> EngineProcess:
        engine = EngineProcess(tmp_path, name, config, extra_args)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


def write_hf_checkpoint(root: Path, seed: int = 3) -> Path:
    """A tiny Llama checkpoint in Hugging Face layout (the engine core's fixture: byte-level BPE, ChatML template)."""
    from tests.unit.engine_core.hf_fixture import CHECKPOINT_CONFIG, write_checkpoint
    from tests.unit.engine_core.reference import random_hf_tensors

    return write_checkpoint(root, CHECKPOINT_CONFIG, random_hf_tensors(CHECKPOINT_CONFIG, seed))
