"""Start and stop an arm's compose project, and wait until its router answers a real request.

Numpy arms run their compose file(s) plus a small override (arms.engine_override). vLLM arms run a project file
rendered from compose.yaml + compose.vllm-cpu.yaml by `docker compose config` and reshaped per arm
(arms.vllm_project): it holds the stack's keys, so it is written owner-only and removed with the project.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

from stack.bench.arms import REPO, Arm, engine_override, vllm_project


class StackError(RuntimeError):
    """A stack that would not start or answer; the message carries the compose output."""


def _env(arm: Arm) -> dict[str, str]:
    return {**os.environ, **{k: v for k, v in arm.env.items() if v}}


def _run(argv: list[str], arm: Arm, timeout: float) -> str:
    done = subprocess.run(argv, env=_env(arm), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise StackError(f"{shlex.join(argv)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return done.stdout


def project_file(project: str) -> Path:
    """The generated compose file of `project` (an override for numpy arms, the whole project for vLLM arms)."""
    return Path(tempfile.gettempdir()) / f"{project}.compose.json"


def _write_private(path: Path, content: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(content, out)  # JSON is YAML


def _files(arm: Arm, project: str) -> list[str]:
    generated = project_file(project)
    if arm.engine == "vllm" and generated.exists():
        return ["-f", str(generated)]
    files = [a for f in arm.compose_files for a in ("-f", str(f))]
    return files + (["-f", str(generated)] if generated.exists() else [])


def compose_argv(arm: Arm, project: str) -> list[str]:
    """`docker compose -p project -f …` for the arm, writing its generated file first."""
    generated = project_file(project)
    generated.unlink(missing_ok=True)
    if arm.engine == "vllm":
        argv = ["docker", "compose", "-p", project, *_files(arm, project), "config", "--format", "json"]
        _write_private(generated, vllm_project(json.loads(_run(argv, arm, 120)), arm))
    elif override := engine_override(arm):
        # Relative paths (volumes) still resolve against the first file's directory.
        _write_private(generated, override)
    return ["docker", "compose", "-p", project, *_files(arm, project)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(arm: Arm, project: str, timeout: float) -> str:
    """`up --wait` (health-gated) with the router on a free host port; returns the router's URL."""
    port = free_port()
    arm.env["ROUTER_PORT"] = str(port)
    argv = compose_argv(arm, project)
    print(f"[compare] starting {arm.name}: {shlex.join(argv[:4])} … up", flush=True)
    # --no-build: the images come from `./pd build` and scripts/vllm-cpu-image.sh (offline wheel caches).
    _run([*argv, "up", "-d", "--no-build", "--wait", "--wait-timeout", str(int(timeout))], arm, timeout + 60)
    return f"http://127.0.0.1:{port}"


def stop(arm: Arm, project: str) -> None:
    print(f"[compare] stopping {arm.name}", flush=True)
    try:
        _run(["docker", "compose", "-p", project, *_files(arm, project), "down", "-v", "--remove-orphans"], arm, 180)
    finally:
        project_file(project).unlink(missing_ok=True)


async def wait_answering(base_url: str, api_key: str | None, timeout: float) -> None:
    """Until a one-token chat completion through the router answers 200: a healthy router is not a serving stack
    (backends still loading, a KV path not yet connected), and GET /v1/models is answered by the router alone."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    last = ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=min(120.0, timeout))) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"{base_url}/v1/models", headers=headers) as response:
                    models = await response.json() if response.status == 200 else None
                    last = f"GET /v1/models: HTTP {response.status}"
                if models:
                    body = {"model": models["data"][0]["id"], "max_tokens": 1,
                            "messages": [{"role": "user", "content": "ready?"}]}
                    async with session.post(f"{base_url}/v1/chat/completions", json=body, headers=headers) as response:
                        text = await response.text()
                        if response.status == 200:
                            return
                        last = f"POST /v1/chat/completions: HTTP {response.status}: {text[:200]}"
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                last = repr(exc)
            await asyncio.sleep(1.0)
    raise StackError(f"{base_url} did not answer a chat completion within {timeout:.0f}s: {last}")
