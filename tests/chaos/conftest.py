"""The chaos tier's stack and load: the real compose stack (tests/chaos/compose.chaos.yaml: tighter router
deadlines), concurrent streaming clients, and what every request ended as.

    outcome          the client saw
    complete         200, a finish_reason and [DONE]
    error_<status>   an HTTP error with a JSON error body (429/503 also with Retry-After)
    error_inband     a 200 stream that ended with an error event (after tokens had been sent)
    connection_lost  the router itself went away (only the router-kill fault allows it)
    truncated        a stream that just stopped, no [DONE], no error: never allowed
    hung             no end within the documented bound (+ slack): never allowed
    cancelled        the client itself hung up (the disconnect storm)
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from tests.integration.compose_stack import DISAGGREGATED, Stack, ensure_image, start_stack, unique_project

FILES = (*DISAGGREGATED, "tests/chaos/compose.chaos.yaml")
MODEL = "your-model-id"
PROMPT = [{"role": "user", "content": "Tell me a long story about prefill and decode."}]


@pytest.fixture(scope="session")
def chaos_stack() -> Iterator[Stack]:
    ensure_image()
    stack = start_stack(unique_project("pdt-chaos"), files=FILES, env={"HEALTHCHECK_INTERVAL": "2s"})
    try:
        yield stack
    finally:
        stack.stop()


def router_health(stack: Stack) -> dict[str, Any]:
    with urllib.request.urlopen(f"{stack.router_url}/health", timeout=5) as response:
        return json.load(response)


def engine_health(stack: Stack, service: str) -> dict[str, Any]:
    """An engine's GET /health from inside its container (engines publish no port; /health needs no key)."""
    script = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5).read().decode())"
    result = stack.container(service).exec_run(["python", "-c", script])
    assert result.exit_code == 0, result.output.decode()[-500:]
    return json.loads(result.output.decode().strip().splitlines()[-1])


def crash(stack: Stack, service: str) -> None:
    """Kill -9 the service's process inside its container, as a crash would (docker-init is PID 1, so the container
    exits and its restart policy applies; `docker kill` would count as a stop by hand)."""
    script = ("import os, signal\nme = os.getpid()\n"
              "for p in os.listdir('/proc'):\n"
              "    if p.isdigit() and int(p) not in (1, me):\n"
              "        try:\n            cmd = open(f'/proc/{p}/cmdline', 'rb').read()\n"
              "        except OSError:\n            continue\n"
              "        if b'stack.' in cmd:\n            os.kill(int(p), signal.SIGKILL)\n")
    stack.container(service).exec_run(["python", "-c", script])


@dataclass
class Result:
    outcome: str
    seconds: float
    status: int | None = None
    detail: str = ""


@dataclass
class Load:
    """Concurrent streaming clients against the router until stopped; every request's Result."""

    stack: Stack
    workers: int
    bound_s: float  # the documented worst case: a request taking longer is `hung`
    max_tokens: int = 200
    hang_up_after_first: bool = False  # the disconnect storm
    results: list[Result] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def counts(self) -> Counter[str]:
        return Counter(r.outcome for r in self.results)

    def worst_s(self) -> float:
        return max((r.seconds for r in self.results), default=0.0)

    async def run(self, fault: Any, settle_s: float = 0.0) -> None:
        """Start the workers, wait for the first completions, run `fault()` (sync, in a thread), then stop new
        requests after `settle_s` and wait for every request in flight to end."""
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            tasks = [asyncio.create_task(self._worker(session)) for _ in range(self.workers)]
            deadline = time.monotonic() + 60
            while not self.results and time.monotonic() < deadline:  # requests are in flight by now
                await asyncio.sleep(0.1)
            await asyncio.to_thread(fault)
            await asyncio.sleep(settle_s)
            self._stop.set()
            await asyncio.gather(*tasks)

    async def _worker(self, session: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            result = await self.one(session)
            self.results.append(result)
            if result.outcome != "complete":
                await asyncio.sleep(0.2)  # a client backing off, as the SDKs do

    async def one(self, session: aiohttp.ClientSession) -> Result:
        body = {"model": MODEL, "messages": PROMPT, "stream": True, "max_tokens": self.max_tokens, "ignore_eos": True}
        # Each request is its own conversation (a fresh x-session-id), as many independent clients are: the router's
        # cache_aware policy would otherwise keep one repeated prompt on one backend of each pool.
        headers = {"Authorization": f"Bearer {self.stack.api_key}", "x-session-id": uuid.uuid4().hex}
        started = time.monotonic()

        def result(outcome: str, status: int | None = None, detail: str = "") -> Result:
            return Result(outcome, time.monotonic() - started, status, detail)

        try:
            async with asyncio.timeout(self.bound_s + 15):  # slack: a loaded 2-core host
                async with session.post(f"{self.stack.router_url}/v1/chat/completions", json=body, headers=headers) as response:
                    if response.status != 200:
                        text = await response.text()
                        error = json.loads(text).get("error") if text.startswith("{") else None
                        if not isinstance(error, dict) or not error.get("message"):
                            return result("unexplained_status", response.status, text[:300])
                        if response.status in (429, 503) and "Retry-After" not in response.headers:
                            return result("no_retry_after", response.status, text[:300])
                        return result(f"error_{response.status}", response.status, error["message"][:200])
                    done = finished = False
                    async for line in response.content:
                        if not line.startswith(b"data: "):
                            continue
                        payload = line[6:].strip()
                        if payload == b"[DONE]":
                            done = True
                            break
                        chunk = json.loads(payload)
                        if "error" in chunk:
                            return result("error_inband", 200, str(chunk["error"])[:200])
                        if self.hang_up_after_first:
                            return result("cancelled", 200)  # leaving the block closes the connection
                        choices = chunk.get("choices") or []
                        finished = finished or bool(choices and choices[0].get("finish_reason"))
                    return result("complete" if done and finished else "truncated", 200)
        except TimeoutError:
            return result("hung")
        except (aiohttp.ClientError, ConnectionError) as exc:
            return result("connection_lost", None, type(exc).__name__)


def wait_healed(stack: Stack, timeout_s: float) -> float:
    """Seconds until the router sees every backend up with a closed (or half-open) circuit and a request succeeds."""
    started = time.monotonic()
    deadline = started + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            health = router_health(stack)
            last = [(b["role"], b["state"], b["breaker"]) for b in health["backends"]]
            if all(b["state"] == "up" and b["breaker"] != "open" for b in health["backends"]):
                if asyncio.run(_one_good(stack)):
                    return time.monotonic() - started
        except (OSError, ValueError):
            last = "router not answering"
        time.sleep(0.5)
    raise AssertionError(f"the stack did not heal by itself within {timeout_s} s: {last}")


async def _one_good(stack: Stack) -> bool:
    async with aiohttp.ClientSession() as session:
        result = await Load(stack, 1, bound_s=60, max_tokens=4).one(session)
    return result.outcome == "complete"


def wait_no_stranded_kv(stack: Stack, timeout_s: float) -> dict[str, Any]:
    """Both engines idle with every KV block free, decode holding no received KV; else AssertionError naming what."""
    deadline = time.monotonic() + timeout_s
    while True:
        prefill, decode = engine_health(stack, "prefill"), engine_health(stack, "decode")
        seen = {"prefill": {k: prefill.get(k) for k in ("running", "waiting", "kv_free_blocks", "kv_total_blocks")},
                "decode": {k: decode.get(k) for k in ("running", "waiting", "kv_free_blocks", "kv_total_blocks",
                                                      "kv_buffer_used", "kv_held_transfers")}}
        clean = all(h["running"] == 0 and h["waiting"] == 0 and h["kv_free_blocks"] == h["kv_total_blocks"] for h in (prefill, decode)) \
            and decode.get("kv_buffer_used", 0) == 0 and decode.get("kv_held_transfers", 0) == 0
        if clean:
            return seen
        assert time.monotonic() < deadline, f"KV still held {timeout_s} s after the fault: {seen}"
        time.sleep(1)
