"""The disaggregated compose stack end to end: start order, ports, PD through the router, faults."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.compose_stack import Stack, parse_ts
from tests.integration.doctor_helpers import diagnose, finding, services

pytestmark = pytest.mark.integration

PROMPT = [{"role": "user", "content": "Explain prefill and decode in one sentence."}]


def _client(stack: Stack, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0, **kw)


def _router_health(stack: Stack) -> dict[str, Any]:
    with urllib.request.urlopen(f"{stack.router_url}/health", timeout=5) as response:
        return json.load(response)


def _decode_state(stack: Stack) -> str:
    """The router's decode: "up" or "down"; a stopped decode may instead have left the pool (it no longer resolves
    under the discover name, stack/router/replicas.py), which is as down as it gets: "down" too."""
    return next((b["state"] for b in _router_health(stack)["backends"] if b["role"] == "decode"), "down")


def _wait_decode_state(stack: Stack, state: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    seen = _decode_state(stack)
    while seen != state and time.monotonic() < deadline:
        time.sleep(0.5)
        seen = _decode_state(stack)
    return seen


def _first_healthy(stack: Stack, service: str) -> float:
    """When docker first reported the service healthy during `up` (health_status events)."""
    times = [e["timeNano"] / 1e9 for e in stack.events_at_start
             if e.get("Actor", {}).get("Attributes", {}).get("com.docker.compose.service") == service
             and e.get("Action", e.get("status", "")) == "health_status: healthy"]
    assert times, f"no healthy event for {service} during up"
    return min(times)


def _started(stack: Stack, service: str) -> float:
    return parse_ts(stack.inspect_at_start[service]["State"]["StartedAt"]).timestamp()


def _chat_stream(stack: Stack, request_id: str, **kw: Any) -> str:
    kw.setdefault("seed", 5)  # a seeded sample: the random-weight model cannot answer EOS first by chance
    stream = _client(stack).chat.completions.create(
        model="your-model-id", messages=PROMPT, stream=True, extra_headers={"X-Request-ID": request_id}, **kw)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_start_order_decode_then_prefill_then_router(pd_stack: Stack) -> None:
    """decode is healthy before prefill starts, and prefill (and decode) before the router starts."""
    decode_healthy = _first_healthy(pd_stack, "decode")
    prefill_healthy = _first_healthy(pd_stack, "prefill")
    assert decode_healthy <= _started(pd_stack, "prefill")
    assert prefill_healthy <= _started(pd_stack, "router")
    assert decode_healthy <= _started(pd_stack, "router")
    for service in ("decode", "prefill", "router"):
        assert pd_stack.inspect_at_start[service]["State"]["Health"]["Status"] == "healthy"


def test_only_the_router_port_is_published(pd_stack: Stack) -> None:
    """Only the router's 8080 is bound on the host, on loopback (ROUTER_BIND); the engines' HTTP and KV ports are only exposed."""
    router = pd_stack.container("router").attrs
    assert router["HostConfig"]["PortBindings"] == {"8080/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(pd_stack.router_port)}]}
    for service in ("prefill", "decode"):
        attrs = pd_stack.container(service).attrs
        assert not attrs["HostConfig"]["PortBindings"], f"{service} publishes {attrs['HostConfig']['PortBindings']}"
        assert all(not binding for binding in (attrs["NetworkSettings"]["Ports"] or {}).values())
    decode = pd_stack.container("decode").attrs
    assert "9100/tcp" in decode["Config"]["ExposedPorts"]  # the KV port: reachable by prefill only
    models = _client(pd_stack).models.list()
    assert [m.id for m in models.data] == ["your-model-id"]


def test_kv_network_joins_only_prefill_and_decode(pd_stack: Stack) -> None:
    """The KV network holds prefill and decode and nothing else; the router is not on it."""
    members = {name for name in ("decode", "prefill", "router")
               if pd_stack.network("kv") in pd_stack.container(name).attrs["NetworkSettings"]["Networks"]}
    assert members == {"prefill", "decode"}


def test_streamed_chat_goes_through_prefill_then_decode(pd_stack: Stack) -> None:
    """A streamed chat via the openai SDK returns tokens; prefill logs kv_producer and decode kv_consumer for it."""
    request_id = f"it-{uuid.uuid4().hex[:12]}"
    text = _chat_stream(pd_stack, request_id, max_tokens=12, seed=5)
    assert text
    produced = pd_stack.wait_for_event("prefill", "kv_producer.sent", request_id)
    consumed = pd_stack.wait_for_event("decode", "kv_consumer.claimed", request_id)
    assert produced and consumed
    assert produced[0]["transfer_id"] == consumed[0]["transfer_id"]
    assert {e["event"] for e in pd_stack.events("decode", request_id)} >= {"kv_consumer.received", "kv_consumer.claimed"}
    handed = [e for e in pd_stack.events("router", request_id) if e["event"] == "router.prefill_done"]
    assert handed and handed[0]["transfer_id"] == produced[0]["transfer_id"] and handed[0]["decode"]


def test_killing_decode_mid_stream_is_a_clean_error_and_recovers(pd_stack: Stack, tmp_path: Path) -> None:
    """docker kill decode during a stream: the SDK raises an API error, the router marks decode down, then serves again."""
    decode = pd_stack.container("decode")
    try:
        # ignore_eos: the random-weight model may sample EOS within a few tokens; the stream must outlast the kill.
        stream = _client(pd_stack, timeout=60).chat.completions.create(
            model="your-model-id", messages=PROMPT, stream=True, max_tokens=400, extra_body={"ignore_eos": True},
            extra_headers={"X-Request-ID": "it-kill"})
        with pytest.raises(openai.APIError) as raised:
            for index, _chunk in enumerate(stream):
                if index == 2:
                    decode.kill()
        assert raised.value.message
        # Bounds: the router's gRPC health probe notices within a few probe intervals; 30 s only catches a hang.
        assert _wait_decode_state(pd_stack, "down", timeout_s=30) == "down"
        assert any(e["event"] == "router.decode_failed" and e.get("mid_stream") for e in pd_stack.events("router", "it-kill"))
        # The doctor, from the stack's logs alone, names the broken stream and its request.
        (rid,) = pd_stack.request_ids("it-kill")  # the router's own id for the client's X-Request-ID
        code, doc = diagnose(pd_stack, str(tmp_path), "--request-id", rid)
        cut = finding(doc, "choices.stream_without_done")
        assert code == 1 and cut["request_ids"][0] == rid and "it-kill" in cut["request_ids"] and "router" in services(cut)
    finally:
        decode.reload()
        if decode.status != "running":  # the later tests need a decode, whatever happened above
            decode.start()
    pd_stack.wait_healthy("decode")
    assert _wait_decode_state(pd_stack, "up", timeout_s=60) == "up"
    assert _chat_stream(pd_stack, "it-after-kill", max_tokens=8)


def test_cutting_the_kv_network_fails_the_request_cleanly(pd_stack: Stack) -> None:
    """Prefill cut off the KV network: its push fails (kv_producer.connect_failed), the router answers 502, both log it."""
    network = pd_stack.network("kv")
    prefill = pd_stack.container("prefill")
    client = _client(pd_stack, timeout=90)
    prefill.client.networks.get(network).disconnect(prefill)
    try:
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model="your-model-id", messages=PROMPT, max_tokens=8,
                                           extra_headers={"X-Request-ID": "it-kv-cut"})
    finally:
        prefill.client.networks.get(network).connect(prefill, aliases=["prefill"])
    assert raised.value.status_code == 502
    assert "decode_kv_addr" in raised.value.message
    producer = pd_stack.wait_for_event("prefill", "kv_producer.connect_failed", "it-kv-cut")
    assert producer and producer[0]["decode_kv_addr"].endswith(":9100")
    assert any(e["event"] == "router.prefill_failed" for e in pd_stack.events("router", "it-kv-cut"))
    # The decode never got a decode leg for it: the router hands off only after a successful push.
    assert not [e for e in pd_stack.events("decode", "it-kv-cut") if e["event"].startswith("kv_consumer.claimed")]
    assert _chat_stream(pd_stack, "it-after-cut", max_tokens=8)


def test_engines_answer_only_the_router(pd_stack: Stack) -> None:
    """An engine refuses /v1/* without PD_INTERNAL_KEY (401), even with the clients' key; /health stays open; the
    router's own calls carry the key (a request through it works)."""
    script = ("import json, sys, urllib.request, urllib.error\n"
              "def call(path, key=None):\n"
              "    req = urllib.request.Request('http://decode:8000' + path, headers={'Authorization': 'Bearer ' + key} if key else {})\n"
              "    try:\n        return urllib.request.urlopen(req, timeout=5).status\n"
              "    except urllib.error.HTTPError as e:\n        return e.code\n"
              "print(json.dumps([call('/v1/models'), call('/v1/models', sys.argv[1]), call('/v1/models', sys.argv[2]), call('/health')]))\n")
    result = pd_stack.container("router").exec_run(["python", "-c", script, pd_stack.api_key, pd_stack.env["PD_INTERNAL_KEY"]])
    assert json.loads(result.output.decode().strip().splitlines()[-1]) == [401, 401, 200, 200]
    answer = _client(pd_stack).chat.completions.create(model="your-model-id", max_tokens=2,
                                                      messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content is not None
