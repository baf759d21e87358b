"""`./pd scale` on the real compose stack under streaming load (issue 14): 1P1D → 2P1D → 1P2D, no request fails.

The router is never restarted: it finds each replica by DNS (router/settings.toml `discover`: Docker's embedded DNS
answers a service name with every container's address), lets it in once healthy, and lets a removed one finish its
requests. A new decode's KV address is the hostname it reports (its container's short id, which prefill resolves on
the KV network). `./pd doctor check` shows the pools.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import docker
import pytest

from tests.chaos.conftest import Load
from tests.integration.compose_stack import REPO, STACK_VARIABLES, Stack, ensure_image, start_stack, unique_project

pytestmark = pytest.mark.integration

SCALE_S = 300  # `./pd scale` waits up to 300 s for compose and 120 s for the router; this only catches a hang


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    ensure_image()
    stack = start_stack(unique_project("pdt-scale"), env={"HEALTHCHECK_INTERVAL": "2s"})
    try:
        yield stack
    finally:
        stack.stop()


def pd(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    """`./pd ARGS` on this stack, as a user would run it (its env file, not the developer's .env)."""
    env = {k: v for k, v in os.environ.items() if k not in STACK_VARIABLES}
    env.update(PD_ENV_FILE=str(stack.env_file), PD_COMPOSE_FILES=" ".join(stack.files))
    return subprocess.run([str(REPO / "pd"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=SCALE_S)


def router_health(stack: Stack) -> dict[str, Any]:
    with urllib.request.urlopen(f"{stack.router_url}/health", timeout=5) as response:
        return json.load(response)


def replicas(stack: Stack, service: str) -> list[Any]:
    """The service's running containers, by replica number."""
    found = docker.from_env().containers.list(filters={"label": [
        f"com.docker.compose.project={stack.project}", f"com.docker.compose.service={service}"]})
    return sorted(found, key=lambda c: int(c.labels["com.docker.compose.container-number"]))


def shape(pool: dict[str, Any]) -> tuple[str, int, int]:
    return pool["source"], pool["backends"], pool["up"]


def served(container: Any) -> int:
    """Requests an engine container received (its engine.request_received lines)."""
    lines = container.logs().decode(errors="replace").splitlines()
    return sum(1 for line in lines if '"event": "engine.request_received"' in line)


def test_scale_prefill_then_decode_live_without_a_failed_request(stack: Stack) -> None:
    """Streaming clients run the whole time while prefill goes 1 → 2 and then decode 1 → 2 with prefill back to 1:
    every request completes, the router (never restarted) uses each new replica, and GET /health and doctor check
    show the pools."""
    router = stack.container("router")
    started_at = router.attrs["State"]["StartedAt"]
    load = Load(stack, workers=4, bound_s=router_health(stack)["worst_case_s"]["stream_s"], max_tokens=48)
    steps: dict[str, Any] = {}

    def scale() -> None:
        for name, counts in (("2P1D", ("prefill=2", "decode=1")), ("1P2D", ("prefill=1", "decode=2"))):
            t0 = time.monotonic()
            result = pd(stack, "scale", *counts)
            assert result.returncode == 0, f"./pd scale {' '.join(counts)} failed:\n{result.stderr[-3000:]}"
            steps[name] = {"output": result.stdout, "pools": router_health(stack)["pools"], "took_s": time.monotonic() - t0,
                           "prefill": replicas(stack, "prefill"), "decode": replicas(stack, "decode")}
            # Traffic through the new shape before the next change (the load keeps running meanwhile): 12 requests
            # counted from when the router shows the new shape, not from when the scale began (it takes 7-14 s).
            began, deadline = len(load.results), time.monotonic() + 60
            while len(load.results) < began + 12 and time.monotonic() < deadline:
                time.sleep(0.2)
            steps[name]["served"] = [served(c) for c in steps[name]["prefill"] + steps[name]["decode"]]  # before any is removed

    asyncio.run(load.run(scale, settle_s=3))

    failed = [r for r in load.results if r.outcome != "complete"]
    assert not failed, f"{len(failed)} of {len(load.results)} requests failed: {[(r.outcome, r.status, r.detail) for r in failed[:5]]}"
    assert len(load.results) >= 30, f"too little load to prove anything: {load.counts()}"

    two_prefills = steps["2P1D"]
    assert shape(two_prefills["pools"]["prefill"]) == ("dns://prefill:8000", 2, 2)
    assert two_prefills["pools"]["decode"]["backends"] == 1
    assert "prefill: 2 of 2 up (dns://prefill:8000; model 2x " in two_prefills["output"]
    assert two_prefills["served"][1] > 0, "the second prefill replica never got a request"

    two_decodes = steps["1P2D"]
    assert (shape(two_decodes["pools"]["prefill"]), shape(two_decodes["pools"]["decode"])) == (
        ("dns://prefill:8000", 1, 1), ("dns://decode:8000", 2, 2))
    assert [c.id for c in two_decodes["prefill"]] == [two_prefills["prefill"][0].id], "scaling recreated the first prefill"
    new_decode = two_decodes["decode"][1]
    assert two_decodes["served"][2] > 0, "the second decode replica never got a request"
    # Its KV address is the hostname it reports (the container's short id), reached by prefill on the KV network.
    kv = {b["url"]: b.get("kv_addr") for b in router_health(stack)["backends"] if b["role"] == "decode"}
    assert any(addr and addr.startswith(new_decode.id[:12] + ":") for addr in kv.values()), kv

    router.reload()
    assert router.attrs["State"]["StartedAt"] == started_at and router.attrs["RestartCount"] == 0, "the router was restarted"
    assert "DECODE_REPLICAS=2" in stack.env_file.read_text() and "PREFILL_REPLICAS=1" in stack.env_file.read_text()

    env = {**os.environ, "TAOTOKEN_API_KEY": stack.api_key}
    doctor = subprocess.run([sys.executable, "-m", "doctor", "check", "--project", stack.project, "--router-url", stack.router_url,
                             "--no-color"], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert "router pools: prefill 1 of 1 up (dns://prefill:8000); decode 2 of 2 up (dns://decode:8000)" in doctor.stdout, doctor.stdout
    assert "decode-2: healthy" in doctor.stdout, doctor.stdout
    print(f"\nscale: {json.dumps(dict(load.counts()))}, worst {load.worst_s():.1f} s; "
          + ", ".join(f"./pd scale to {name} {step['took_s']:.0f} s" for name, step in steps.items()))


def test_scale_refuses_what_it_cannot_do(stack: Stack) -> None:
    """A wrong role or count is named before anything changes."""
    for args, message in ((("router=2",), "unknown role in 'router=2'"), (("decode=0",), "decode needs a count 1..64, got '0'"),
                          ((), "say how many")):
        result = pd(stack, "scale", *args)
        assert result.returncode != 0 and message in result.stderr, result.stderr
