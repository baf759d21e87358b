"""Shared by the doctor integration tests: run the doctor in-process, find findings, wait for log lines."""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

from doctor.cli import main
from tests.integration.compose_stack import Stack

PROMPT = [{"role": "user", "content": "Explain prefill and decode in one sentence."}]
MODEL = "your-model-id"


def new_id(tag: str) -> str:
    return f"doctor-{tag}-{uuid.uuid4().hex[:10]}"


def doctor(*argv: str) -> tuple[int, dict[str, Any]]:
    """`python -m doctor --json …` in-process → (exit code, JSON document)."""
    out = io.StringIO()
    code = main(["--json", *argv], stdout=out)
    return code, json.loads(out.getvalue())


def diagnose(stack: Stack, home: str, *extra: str) -> tuple[int, dict[str, Any]]:
    return doctor("diagnose", "--project", stack.project, "--home", home, "--router-url", stack.router_url, *extra)


def finding(doc: dict[str, Any], fid: str) -> dict[str, Any]:
    found = [f for f in doc["findings"] if f["id"] == fid]
    assert found, f"no {fid} finding; got {[(f['id'], f['title']) for f in doc['findings']]}"
    return found[0]


def services(f: dict[str, Any]) -> set[str]:
    return {e["service"] for e in f["evidence"]}


def wait_logged(stack: Stack, service: str, event: str, request_id: str | None = None, timeout_s: float = 30) -> None:
    """Docker receives log lines asynchronously: wait until `event` is there (bounded: a hang guard)."""
    found = stack.wait_for_event(service, event, request_id, timeout_s)
    assert found, f"{service} never logged {event} for {request_id} within {timeout_s} s"


def wait_backends_up(stack: Stack, timeout_s: float = 90) -> None:
    """After a service is recreated the router needs a health round to see it again (bounded: hang guard): every
    backend up, and decode's KV address naming the running container (a recreated one keeps its IP but gets a new
    hostname, which the router learns on its next round)."""
    deadline = time.monotonic() + timeout_s
    seen: list[tuple[Any, Any]] = []
    while time.monotonic() < deadline:
        hostname = stack.container("decode").attrs["Config"]["Hostname"]
        try:
            with urllib.request.urlopen(f"{stack.router_url}/health", timeout=5) as response:
                backends = json.load(response).get("backends", [])
            seen = [(b.get("state"), b.get("kv_addr")) for b in backends]
            if backends and all(b.get("state") == "up" for b in backends) and all(
                    b["kv_addr"].rsplit(":", 1)[0] == hostname for b in backends if b.get("kv_addr")):
                return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"router backends not all up (decode's KV host the running container) after {timeout_s} s: {seen}")
