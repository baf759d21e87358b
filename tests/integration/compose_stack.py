"""Start the real compose stacks for tests: one helper for the stack, doctor and benchmark tests.

    from tests.integration.compose_stack import ensure_image, start_stack

    ensure_image()                                   # once per session (cached: seconds)
    stack = start_stack("pdt-mine", env={"PD_CHECKPOINT": "dummy:tiny"})
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key)
        ...
        stack.events("prefill", request_id="abc")    # parsed JSON log lines of one service
    finally:
        stack.stop()

Every stack gets its own compose project name, a free host port for the router and a fresh key, all
written to its own env file (so the developer's .env and shell never leak in). `up --wait` goes
through testcontainers' `DockerCompose`, which runs `docker compose` (the v2 plugin).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import docker
from docker.models.containers import Container
from testcontainers.compose import DockerCompose
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DISAGGREGATED = ("compose.yaml",)
COLOCATED = ("compose.colocated.yaml",)
# Variables compose would read from the shell before the env file; tests must not inherit them.
STACK_VARIABLES = (
    "TAOTOKEN_API_KEY", "PD_INTERNAL_KEY", "ROUTER_BIND", "TAOTOKEN_BASE_URL", "PREFILL_ENDPOINT", "DECODE_ENDPOINT", "KV_TRANSFER_PORT",
    "ROUTER_PORT", "PD_CHECKPOINT", "PD_CHECKPOINT_DIR", "PREFILL_CPUS", "DECODE_CPUS", "ENGINE_CPUS",
    "ROUTER_CPUS", "HEALTHCHECK_INTERVAL", "COMPOSE_PROJECT_NAME", "COMPOSE_FILE", "COMPOSE_PROFILES",
    "PD_ENV_FILE",  # the stack's env file names itself (write_env_file)
    "PROMETHEUS_PORT", "PROMETHEUS_CONFIG_DIR",  # compose.observability.yaml
)


class StackError(RuntimeError):
    """`docker compose up` failed; the message carries compose's stderr and the services' last logs."""


def ensure_image() -> None:
    """Install the compose plugin if missing and build the app image (cached layers: seconds)."""
    for script in ("compose-plugin.sh", "image.sh"):
        subprocess.run([str(REPO / "scripts" / script)], check=True, cwd=REPO)


def unique_project(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def parse_ts(text: str) -> datetime:
    """Docker timestamps (nanoseconds, Z) → aware datetime."""
    head, _, frac = text.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00")


@dataclass
class Stack:
    """A running compose project: where the router is, its key, its containers and their logs."""

    project: str
    files: tuple[str, ...]
    env: dict[str, str]
    env_file: Path
    compose: DockerCompose
    started_at: float  # wall clock just before `up`
    events_at_start: list[dict[str, Any]] = field(default_factory=list)  # docker events during `up`
    inspect_at_start: dict[str, dict[str, Any]] = field(default_factory=dict)  # service -> inspect right after `up`

    @property
    def router_port(self) -> int:
        return int(self.env["ROUTER_PORT"])

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def base_url(self) -> str:
        return f"{self.router_url}/v1"

    @property
    def api_key(self) -> str:
        return self.env["TAOTOKEN_API_KEY"]

    def container(self, service: str) -> Container:
        """The service's container (docker SDK), found by compose's labels."""
        found = docker.from_env().containers.list(all=True, filters={"label": [
            f"com.docker.compose.project={self.project}", f"com.docker.compose.service={service}"]})
        assert len(found) == 1, f"expected one {service} container in {self.project}, found {len(found)}"
        return found[0]

    def network(self, name: str) -> str:
        """Docker's name of a compose network (e.g. `kv` → `<project>_kv`)."""
        return f"{self.project}_{name}"

    def logs(self, service: str) -> str:
        return self.container(service).logs(stdout=True, stderr=True).decode(errors="replace")

    def _lines(self, service: str) -> list[dict[str, Any]]:
        lines = []
        for line in self.logs(service).splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                lines.append(record)
        return lines

    def request_ids(self, client_request_id: str) -> set[str]:
        """The router's own ids for the requests a client sent with X-Request-ID `client_request_id` (the router names
        every request itself and keeps the client's as client_request_id; the engines see the router's)."""
        return {r["request_id"] for r in self._lines("router") if r.get("client_request_id") == client_request_id}

    def events(self, service: str, request_id: str | None = None) -> list[dict[str, Any]]:
        """The service's JSON log lines (non-JSON lines skipped), optionally for one request id: the router's own id,
        or the X-Request-ID a client sent (then the lines of the router's ids for it, in every service)."""
        lines = self._lines(service)
        if request_id is None:
            return lines
        ids = {request_id} | self.request_ids(request_id)
        return [r for r in lines if r.get("request_id") in ids or r.get("client_request_id") == request_id]

    def wait_for_event(self, service: str, prefix: str, request_id: str | None = None, timeout_s: float = 30) -> list[dict[str, Any]]:
        """Poll until `service` logged an event starting with `prefix`; returns the matching lines."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [e for e in self.events(service, request_id) if str(e.get("event", "")).startswith(prefix)]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.3)

    def wait_healthy(self, service: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            container = self.container(service)
            if container.attrs["State"].get("Health", {}).get("Status") == "healthy":
                return
            time.sleep(0.5)
        raise TimeoutError(f"{service} in {self.project} not healthy after {timeout_s} s")

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Any `docker compose` command on this project (same files and env file)."""
        return compose_run(self.files, self.env_file, args, check=check)

    def stop(self) -> None:
        """`down --volumes`, then forget the env file."""
        try:
            self.compose.stop(down=True)
        finally:
            self.env_file.unlink(missing_ok=True)


def _clean_environment() -> None:
    # compose lets the shell override the env file; the stack under test must see only its env file.
    for name in STACK_VARIABLES:
        os.environ.pop(name, None)


def write_env_file(env: Mapping[str, str]) -> Path:
    fd, path = tempfile.mkstemp(prefix="pd-stack-", suffix=".env")
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{key}={value}\n" for key, value in env.items())
        f.write(f"PD_ENV_FILE={path}\n")  # as ./pd does: the router's env_file is this file
    return Path(path)


def compose_run(files: Sequence[str], env_file: Path, args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    _clean_environment()
    cmd = ["docker", "compose", *[a for f in files for a in ("-f", f)], "--env-file", str(env_file), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=check)


def stack_env(project: str, overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The env file's contents: project, free router port, fresh keys, tiny model; None drops a key."""
    env: dict[str, str | None] = {
        "COMPOSE_PROJECT_NAME": project,
        "ROUTER_PORT": str(free_port()),
        "TAOTOKEN_API_KEY": f"sk-test-{secrets.token_hex(16)}",
        "PD_INTERNAL_KEY": secrets.token_hex(16),  # router → engines (as ./pd up generates it)
        "PD_CHECKPOINT": "dummy:tiny",
    }
    env.update(overrides or {})
    return {key: value for key, value in env.items() if value is not None}


class _EventRecorder:
    """Records the project's container events (start, health_status …) live while `up` runs.

    A live subscription, not a replay afterwards: the daemon keeps only its last 256 events, and
    other stacks' health probes can push ours out of that buffer.
    """

    def __init__(self, project: str) -> None:
        self.events: list[dict[str, Any]] = []
        self._stream = docker.from_env().events(
            since=int(time.time()) - 1, decode=True,
            filters={"type": "container", "label": f"com.docker.compose.project={project}"})
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        self.events.extend(self._stream)  # ends when stop() closes the stream

    def stop(self) -> list[dict[str, Any]]:
        time.sleep(0.5)  # let the last health event of `up --wait` arrive
        self._stream.close()
        self._thread.join(timeout=5)
        return list(self.events)


def start_stack(project: str, files: Sequence[str] = DISAGGREGATED,
                env: Mapping[str, str | None] | None = None) -> Stack:
    """`docker compose up --wait` a stack under its own project; raises StackError if it fails."""
    values = stack_env(project, env)
    env_file = write_env_file(values)
    compose = DockerCompose(context=REPO, compose_file_name=list(files), env_file=str(env_file), wait=True, build=False)
    _clean_environment()
    started = time.time()
    recorder = _EventRecorder(project)
    try:
        compose.start()
    except subprocess.CalledProcessError as exc:
        recorder.stop()
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr)
        logs = compose_run(files, env_file, ["logs", "--no-color", "--tail", "20"], check=False).stdout
        compose_run(files, env_file, ["down", "--volumes"], check=False)
        env_file.unlink(missing_ok=True)
        raise StackError(f"compose up of {project} failed:\n{stderr}\n--- last logs ---\n{logs}") from None
    stack = Stack(project, tuple(files), values, env_file, compose, started)
    stack.events_at_start = recorder.stop()
    for container in docker.from_env().containers.list(filters={"label": f"com.docker.compose.project={project}"}):
        stack.inspect_at_start[container.labels["com.docker.compose.service"]] = container.attrs
    return stack
