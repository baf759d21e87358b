"""The vLLM-CPU overlay as a user starts it: compose.yaml + compose.vllm-cpu.yaml, real vLLM engines over NIXL.

Builds the image offline (scripts/vllm-cpu-image.sh, a no-op when its inputs are unchanged), starts the stack
with the commands `./pd up --vllm-cpu` runs (own project name, own ROUTER_PORT), sends chat requests with the
official openai SDK, streamed and not, and proves the PD path from vLLM's own evidence: the router's prefill
leg answered with kv_transfer_params, decode's `KV Transfer metrics: Num successful transfers=N` lines
(vllm-project/vllm#42703) add up to every request, decode's `vllm:nixl_xfer_time_seconds` histogram counts a
read per request, and both engines count the requests on /metrics.
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from collections.abc import Iterator

import openai
import pytest

from stack.engine.tokenizer import dummy_tokenizer
from tests.integration.compose_stack import REPO, Stack, ensure_image, start_stack, unique_project
from tests.unit.engine_core.agent_prompt import long_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_overlay]  # opt-in: pyproject.toml says why

FILES = ("compose.yaml", "compose.vllm-cpu.yaml")
TRANSFERS = re.compile(r"KV Transfer metrics: Num successful transfers=(\d+)")
# One request through vLLM on a loaded 2-core host: TTFT seconds, not ms (../shared/reference/vllm_cpu.md).
REQUEST_TIMEOUT_S = 120
TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository",
                                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                        "required": ["path"]}}}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    ensure_image()  # the router's image
    subprocess.run([str(REPO / "scripts" / "vllm-cpu-image.sh")], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    running = start_stack(unique_project("pdt-vllmcpu"), FILES)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0,
                       timeout=REQUEST_TIMEOUT_S) as sdk:
        yield sdk


def _metric(stack: Stack, service: str, name: str) -> float:
    """Sum of a counter on the engine's own /metrics (read inside the container: engines publish no port)."""
    probe = ("import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/metrics', timeout=10)"
             ".read().decode())")
    code, out = stack.container(service).exec_run(["/opt/vllm/bin/python", "-c", probe])
    assert code == 0, out.decode(errors="replace")[-500:]
    return sum(float(line.rsplit(" ", 1)[1]) for line in out.decode().splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _transfers(stack: Stack) -> int:
    return sum(int(n) for n in TRANSFERS.findall(stack.logs("decode")))


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not seen within {timeout_s} s"
        time.sleep(1)


def test_chat_streamed_and_not_goes_prefill_nixl_decode(stack: Stack, client: openai.OpenAI) -> None:
    """Two non-streamed and two streamed chats complete through the router; each went prefill → KV over NIXL →
    decode, by the router's legs and by vLLM's own counters and transfer log."""
    before = _transfers(stack)
    ids = []
    for stream in (False, True, False, True):
        rid = f"ovl-{uuid.uuid4().hex[:12]}"
        ids.append(rid)
        messages = [{"role": "user", "content": "explain the key value cache in one sentence"}]
        if stream:
            chunks = list(client.chat.completions.create(model="your-model-id", messages=messages, max_tokens=8,
                                                         stream=True, extra_headers={"X-Request-ID": rid}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert finish and finish[-1] in ("length", "stop"), chunks[-3:]
        else:
            answer = client.chat.completions.create(model="your-model-id", messages=messages, max_tokens=8,
                                                    extra_headers={"X-Request-ID": rid})
            text = answer.choices[0].message.content or ""
            assert answer.choices[0].finish_reason in ("length", "stop")
            assert answer.usage.completion_tokens >= 1 and answer.usage.prompt_tokens > 5
        assert text, f"{rid}: no text"
        # The router's view: a prefill leg that returned vLLM's kv_transfer_params, handed on to decode, answered 200.
        handed = stack.wait_for_event("router", "router.prefill_done", rid, timeout_s=10)
        assert handed and "remote_engine_id" in handed[0]["kv_transfer_params"], (rid, handed)
        done = stack.wait_for_event("router", "router.request_done", rid, timeout_s=10)
        assert [d["status"] for d in done] == [200], (rid, done)
    # vLLM's view: decode logs its NIXL transfers (every 10 s, so wait for the line), one per request at least.
    _wait_for(lambda: _transfers(stack) - before >= len(ids), 60, f"{len(ids)} KV transfers in decode's log")
    # Both engines served every request (prefill its 1-token legs, decode the answers), and decode's NIXL reads
    # (its transfer-time histogram) count one per request.
    for service in ("prefill", "decode"):
        assert _metric(stack, service, "vllm:request_success_total") >= len(ids), service
    assert _metric(stack, "decode", "vllm:nixl_xfer_time_seconds_count") >= len(ids)


def test_a_request_with_tools_is_served(stack: Stack, client: openai.OpenAI) -> None:
    """Agents send their tool list on every request: the overlay starts vLLM with tool calling on (a stock `vllm
    serve` answers such a request 400, '"auto" tool choice requires --enable-auto-tool-choice'), so it reaches
    decode through the PD path like any other chat."""
    rid = f"ovl-tools-{uuid.uuid4().hex[:8]}"
    answer = client.chat.completions.create(model="your-model-id", max_tokens=8, tools=[TOOL], tool_choice="auto",
                                            messages=[{"role": "user", "content": "open the README"}],
                                            extra_headers={"X-Request-ID": rid})
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")
    done = stack.wait_for_event("router", "router.request_done", rid, timeout_s=10)
    assert [d["status"] for d in done] == [200], (rid, done)
    assert stack.wait_for_event("router", "router.prefill_done", rid, timeout_s=10), rid


def test_an_agent_sized_request_is_served(stack: Stack, client: openai.OpenAI) -> None:
    """A Claude-Code-sized request (~30k tokens of system prompt, tool list and history, with tools) goes through the
    overlay's PD path: both engines take a 65,536-token context. With the 2,048 the overlay used to set, vLLM refused
    every agent request for its length."""
    rid = f"ovl-agent-{uuid.uuid4().hex[:8]}"
    history = long_prompt(30_000, dummy_tokenizer())
    answer = client.chat.completions.create(model="your-model-id", max_tokens=8, tools=[TOOL],
                                            messages=[{"role": "system", "content": history},
                                                      {"role": "user", "content": "open the README"}],
                                            extra_headers={"X-Request-ID": rid})
    assert answer.usage is not None and answer.usage.prompt_tokens > 25_000, answer.usage
    done = stack.wait_for_event("router", "router.request_done", rid, timeout_s=10)
    assert [d["status"] for d in done] == [200], (rid, done)
    handed = stack.wait_for_event("router", "router.prefill_done", rid, timeout_s=10)
    assert handed and "remote_engine_id" in handed[0]["kv_transfer_params"], (rid, handed)
