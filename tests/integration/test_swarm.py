"""The stack on a real single-node Docker Swarm (issue 14): deploy, scale, a task killed and replaced, a rolling model
update, all under streaming load with no failed request.

The test creates the swarm (`docker swarm init --advertise-addr 127.0.0.1`) and leaves it afterwards with everything
it made; on an engine that is already in a swarm it did not create it skips rather than touch it. It drives the
stack as a user does: node labels, then `./pd swarm deploy | scale | update | rm` with its own env file.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.chaos.conftest import Load
from tests.integration.compose_stack import REPO, STACK_VARIABLES, ensure_image, free_port, unique_project, write_env_file

pytestmark = pytest.mark.integration

STEP_S = 400  # one ./pd swarm step (its own waits are 180 s for the router); this only catches a hang


@dataclass
class SwarmStack:
    name: str
    env_file: Path
    router_url: str
    api_key: str

    def service(self, role: str) -> str:
        return f"{self.name}_{role}"

    def containers(self, role: str) -> list[Any]:
        return docker.from_env().containers.list(filters={"label": f"com.docker.swarm.service.name={self.service(role)}"})

    def logs(self, role: str) -> str:
        """Every task's log of the service, the stopped ones too (Swarm keeps their containers: task history)."""
        found = docker.from_env().containers.list(all=True, filters={"label": f"com.docker.swarm.service.name={self.service(role)}"})
        return "".join(c.logs().decode(errors="replace") for c in found)


def pd(stack: SwarmStack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in STACK_VARIABLES}
    env["PD_ENV_FILE"] = str(stack.env_file)
    result = subprocess.run([str(REPO / "pd"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=STEP_S)
    assert result.returncode == 0, f"./pd {' '.join(args)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def docker_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check, timeout=120)


def remove_when_free(kind: str, name: str, deadline: float) -> None:
    """`docker <kind> rm NAME` until it is gone: a volume or network stays in use until its containers are gone."""
    while docker_cli(kind, "rm", name, check=False).returncode != 0 and time.monotonic() < deadline:
        gone = docker_cli(kind, "inspect", name, check=False).stderr.lower()
        if "no such" in gone or "not found" in gone:  # volumes say the one, networks the other
            break
        time.sleep(1)


def health(stack: SwarmStack) -> dict[str, Any]:
    with urllib.request.urlopen(f"{stack.router_url}/health", timeout=5) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def swarm() -> Iterator[None]:
    """A one-node swarm made for this test, left (with everything in it) afterwards."""
    state = docker_cli("info", "--format", "{{.Swarm.LocalNodeState}}").stdout.strip()
    if state != "inactive":
        pytest.skip(f"this Docker engine is already a swarm member ({state}) that this test did not create: not touching it")
    ensure_image()
    # `swarm init` makes the docker_gwbridge network (it joins swarm containers to the host) and `swarm leave` keeps
    # it: remove it afterwards, unless it was there before this test.
    had_gwbridge = docker_cli("network", "inspect", "docker_gwbridge", check=False).returncode == 0
    docker_cli("swarm", "init", "--advertise-addr", "127.0.0.1")
    try:
        yield
    finally:
        docker_cli("swarm", "leave", "--force", check=False)
        if not had_gwbridge:
            remove_when_free("network", "docker_gwbridge", time.monotonic() + 60)


@pytest.fixture(scope="module")
def stack(swarm: None) -> Iterator[SwarmStack]:
    name = unique_project("pdt-swarm")
    port = free_port()
    values = {"PD_STACK": name, "ROUTER_PORT": str(port), "TAOTOKEN_API_KEY": f"sk-test-{secrets.token_hex(16)}",
              "PD_INTERNAL_KEY": secrets.token_hex(16), "PD_CHECKPOINT": "dummy:tiny", "HEALTHCHECK_INTERVAL": "2s"}
    stack = SwarmStack(name, write_env_file(values), f"http://127.0.0.1:{port}", values["TAOTOKEN_API_KEY"])
    # README "Outgrowing one machine": each node says which roles it may run (here one node runs both).
    node = docker_cli("info", "--format", "{{.Swarm.NodeID}}").stdout.strip()
    docker_cli("node", "update", "--label-add", "pd.prefill=true", "--label-add", "pd.decode=true", node)
    try:
        pd(stack, "swarm", "deploy")
        yield stack
    finally:
        subprocess.run([str(REPO / "pd"), "swarm", "rm"], cwd=REPO, env={**os.environ, "PD_ENV_FILE": str(stack.env_file)},
                       capture_output=True, timeout=STEP_S)
        deadline = time.monotonic() + 60
        for volume in (f"{name}_checkpoints", f"{name}_router-data"):
            remove_when_free("volume", volume, deadline)
        stack.env_file.unlink(missing_ok=True)


def test_swarm_deploy_scale_kill_and_model_update_without_a_failed_request(stack: SwarmStack) -> None:
    """Streaming clients run while prefill goes to 2 tasks, one prefill task is killed (Swarm replaces it) and the model
    rolls to a new version (PD_SEED=1: another fingerprint): every request completes, no KV ever crosses versions."""
    before = health(stack)
    assert {role: (p["backends"], p["up"]) for role, p in before["pools"].items()} == {"prefill": (1, 1), "decode": (1, 1)}
    old_model = set(before["pools"]["decode"]["models"])
    router = stack.containers("router")[0]
    env = router.attrs["Config"]["Env"]
    assert "TAOTOKEN_API_KEY_FILE=/run/secrets/pd_api_key" in env and not any(e.startswith("TAOTOKEN_API_KEY=") for e in env)

    load = Load(stack, workers=4, bound_s=before["worst_case_s"]["stream_s"], max_tokens=32)  # type: ignore[arg-type]
    seen: dict[str, Any] = {}

    def steps() -> None:
        t0 = time.monotonic()
        pd(stack, "swarm", "scale", "prefill=2")
        seen["scale_s"] = time.monotonic() - t0
        seen["scaled"] = health(stack)["pools"]
        victim = stack.containers("prefill")[0]
        victim.kill()  # `docker kill`: Swarm's restart policy replaces the task
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ids = {c.id for c in stack.containers("prefill")}
            pools = health(stack)["pools"]["prefill"]
            if len(ids) == 2 and victim.id not in ids and pools["backends"] == pools["up"] == 2:
                break
            time.sleep(0.5)
        seen["replaced"] = ({c.id for c in stack.containers("prefill")}, health(stack)["pools"]["prefill"])
        seen["replace_s"] = time.monotonic() - t0 - seen["scale_s"]
        t1 = time.monotonic()
        seen["update"] = pd(stack, "swarm", "update", "--env", "PD_SEED=1").stdout
        seen["update_s"] = time.monotonic() - t1
        seen["updated"] = health(stack)["pools"]

    asyncio.run(load.run(steps, settle_s=3))

    failed = [r for r in load.results if r.outcome != "complete"]
    assert not failed, f"{len(failed)} of {len(load.results)} requests failed: {[(r.outcome, r.status, r.detail) for r in failed[:5]]}"
    assert len(load.results) >= 30, f"too little load to prove anything: {load.counts()}"
    assert (seen["scaled"]["prefill"]["backends"], seen["scaled"]["prefill"]["up"]) == (2, 2)
    ids, prefills = seen["replaced"]
    assert len(ids) == 2 and (prefills["backends"], prefills["up"]) == (2, 2), f"the killed task was not replaced: {seen['replaced']}"
    updated = seen["updated"]
    new_model = set(updated["decode"]["models"])
    assert len(new_model) == 1 and new_model != old_model and set(updated["prefill"]["models"]) == new_model, updated
    assert "PD_SEED=1" in stack.env_file.read_text()
    # The fingerprint check never fired: no decode was ever handed KV of another model version.
    assert '"kv_consumer.fingerprint_mismatch"' not in stack.logs("decode")
    assert stack.api_key not in stack.logs("router")
    print(f"\nswarm: {json.dumps(dict(load.counts()))}, worst {load.worst_s():.1f} s; scale {seen['scale_s']:.0f} s, "
          f"kill → replaced {seen['replace_s']:.0f} s, model update {seen['update_s']:.0f} s")
