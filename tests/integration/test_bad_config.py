"""A bad .env or engine config stops `up` with a message that names the problem."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import docker
import pytest

from tests.integration.compose_stack import (
    REPO, STACK_VARIABLES, StackError, compose_run, stack_env, start_stack, unique_project, write_env_file,
)

pytestmark = pytest.mark.integration


def test_missing_key_stops_compose_with_copy_env_example_hint(app_image: None) -> None:
    """Without TAOTOKEN_API_KEY, `docker compose up` refuses and says to copy .env.example."""
    with pytest.raises(StackError) as raised:
        start_stack(unique_project("pdt-nokey"), env={"TAOTOKEN_API_KEY": None})
    assert "TAOTOKEN_API_KEY" in str(raised.value)
    assert "copy .env.example to .env" in str(raised.value)


def test_router_port_not_a_number_is_named(app_image: None) -> None:
    """ROUTER_PORT=abc: compose rejects the port, and ./pd up names the variable before starting anything."""
    env_file = write_env_file(stack_env(unique_project("pdt-port"), {"ROUTER_PORT": "abc"}))
    try:
        raw = compose_run(["compose.yaml"], env_file, ["up", "--detach", "--no-build"], check=False)
        assert raw.returncode != 0
        assert "invalid hostPort: abc" in raw.stderr
        env = {k: v for k, v in os.environ.items() if k != "ROUTER_PORT"} | {"PD_ENV_FILE": str(env_file)}
        pd = subprocess.run([str(REPO / "pd"), "up"], cwd=REPO, env=env, capture_output=True, text=True,
                            stdin=subprocess.DEVNULL)
        assert pd.returncode == 2
        assert "ROUTER_PORT must be a port number 1..65535, got abc" in pd.stderr
    finally:
        env_file.unlink(missing_ok=True)


def test_router_port_held_by_another_program_is_named_before_anything_starts(app_image: None) -> None:
    """ROUTER_PORT taken by another program: ./pd up stops at once with one line naming the variable and the port,
    instead of failing in compose's output after the engines started; no container is created."""
    project = unique_project("pdt-busy")
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env_file = write_env_file(stack_env(project, {"ROUTER_PORT": str(port)}))
        try:
            env = {k: v for k, v in os.environ.items() if k not in STACK_VARIABLES} | {"PD_ENV_FILE": str(env_file)}
            pd = subprocess.run([str(REPO / "pd"), "up"], cwd=REPO, env=env, capture_output=True, text=True,
                                stdin=subprocess.DEVNULL)
        finally:
            env_file.unlink(missing_ok=True)
    assert pd.returncode == 2, pd.stderr
    assert f"error: ROUTER_PORT {port} is already in use on this machine (by another program)" in pd.stderr
    assert "Traceback" not in pd.stderr
    assert not docker.from_env().containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"})


def test_bad_kv_port_in_engine_config_fails_up_naming_the_key(app_image: None, tmp_path: Path) -> None:
    """A decode config.json with "kv_port": "abc" stops decode (exit 2) and `up` with file, key and problem."""
    config = json.loads((REPO / "decode" / "config.json").read_text())
    config["kv_transfer_config"]["kv_port"] = "abc"
    (tmp_path / "config.json").write_text(json.dumps(config))
    tmp_path.chmod(0o755)  # the engine runs as an unprivileged user
    (tmp_path / "config.json").chmod(0o644)
    files = ("compose.yaml", "tests/integration/fixtures/decode_config_dir.yaml")
    with pytest.raises(StackError) as raised:
        start_stack(unique_project("pdt-badkv"), files=files, env={"PD_TEST_DECODE_CONFIG_DIR": str(tmp_path)})
    message = str(raised.value)
    # restart: unless-stopped (issue 12) starts it again and again, so `up --wait` may see it exited or restarting.
    assert "decode" in message and ("exited (2)" in message or "unhealthy" in message or "restarting" in message)
    assert "/config/config.json: kv_transfer_config.kv_port" in message
