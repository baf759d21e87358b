"""The PD flow over real engine processes on loopback: KV really moves from prefill to decode."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import aiohttp
import pytest

from stack.common import events
from stack.common.errors import InvalidRequest, Overloaded, UpstreamError
from stack.common.health import SERVING, probe_async
from tests.unit.router_pd.conftest import batches, INTERNAL_KEY, REPO, free_port, relay_app, router_settings, wait_for_state, typed
from tests.unit.router_pd.fake_engine import chunk_text

MODEL = "your-model-id"


def chat(content: str = "Explain prefill and decode.", max_tokens: int = 12, **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, "seed": 7, **extra}


async def wait_for_event(engine, name: str, request_id: str, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [e for e in engine.events(name) if e.get("request_id") == request_id]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no {name} for {request_id} in {engine.role} log within {timeout_s}s"
        await asyncio.sleep(0.1)


async def test_pd_output_matches_colocated(engines, pd, logs):
    """Disaggregated (prefill → KV → decode) gives the same text and usage as one colocated engine, streamed and not."""
    prefill, decode, both = await engines("prefill", "decode", "both")
    disaggregated, colocated = await pd([prefill], [decode]), await pd([both], [both])
    assert (disaggregated.fleet.mode, colocated.fleet.mode) == ("disaggregated", "colocated")
    pd_chunks = [c async for batch in batches(disaggregated, "pd-1", "chat", "/v1/chat/completions", *typed(chat())) for c in batch]
    co_chunks = [c async for batch in batches(colocated, "co-1", "chat", "/v1/chat/completions", *typed(chat())) for c in batch]
    assert chunk_text(pd_chunks) == chunk_text(co_chunks) and len(chunk_text(pd_chunks)) > 0
    assert pd_chunks[-1]["usage"] == co_chunks[-1]["usage"] and pd_chunks[-1]["usage"]["completion_tokens"] == 12
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "seed": 3}
    pd_answer = await disaggregated.complete("pd-2", "completions", "/v1/completions", *typed(dict(body)))
    co_answer = await colocated.complete("co-2", "completions", "/v1/completions", *typed(dict(body)))
    assert pd_answer["choices"][0]["text"] == co_answer["choices"][0]["text"] and "kv_transfer_params" not in pd_answer
    # The KV really moved, under the router's transfer id, and the request id reached both engines.
    sent = await wait_for_event(prefill, events.KV_PRODUCER_SENT, "pd-1")
    claimed = await wait_for_event(decode, events.KV_CONSUMER_CLAIMED, "pd-1")
    assert sent["transfer_id"] == claimed["transfer_id"] == logs.events(events.ROUTER_PREFILL_DONE)[0]["transfer_id"]
    assert disaggregated.backend_model == MODEL


async def test_load_aware_spreads_over_two_decodes(engines, pd, logs):
    """1P2D: concurrent requests land on both decodes, and never more than max_concurrent per decode at once."""
    prefill, d1, d2 = await engines("prefill", "decode", "decode")
    client = await pd([prefill], [d1, d2], max_concurrent=1)
    peak = {d1.url: 0, d2.url: 0}

    async def one(i: int) -> str:
        chunks = []
        async for batch in batches(client, f"x-{i}", "chat", "/v1/chat/completions", *typed(chat(max_tokens=6))):
            for b in client.fleet.scheduler.backends:
                peak[b.url] = max(peak.get(b.url, 0), b.in_flight)
            chunks += batch
        return chunk_text(chunks)

    texts = await asyncio.gather(*(one(i) for i in range(6)))
    assert len(set(texts)) == 1  # same prompt and seed: same answer whichever decode served it
    decodes = [e["decode"] for e in logs.events(events.ROUTER_SCHEDULED)]
    assert decodes.count(d1.url) >= 1 and decodes.count(d2.url) >= 1
    assert peak[d1.url] == 1 and peak[d2.url] == 1


async def test_killed_prefill_is_retried_on_the_other(engines, pd, logs):
    """2P1D with one prefill process killed: the request is retried on the live prefill and succeeds."""
    dead, alive, decode = await engines("prefill", "prefill", "decode")
    # Slow health checks: the router still thinks the dead prefill is up, so the request really hits it.
    client = await pd([dead, alive], [decode], policy="round_robin", health_interval_ms=60_000)
    expected = chunk_text([c async for batch in batches(client, "warm", "chat", "/v1/chat/completions", *typed(chat())) for c in batch])
    dead.kill()
    texts = [chunk_text([c async for batch in batches(client, f"k{i}", "chat", "/v1/chat/completions", *typed(chat())) for c in batch]) for i in range(2)]
    assert texts == [expected, expected]
    failed = logs.events(events.ROUTER_PREFILL_FAILED)
    assert len(failed) == 1 and failed[0]["prefill"] == dead.url and failed[0]["retried"] is True
    assert "cannot connect" in failed[0]["error"]


async def test_only_prefill_killed_gives_clean_errors(engines, pd):
    """1P1D with the prefill killed: 502 naming the prefill while the router still thinks it is up; 503 naming the role once health sees it."""
    prefill, decode = await engines("prefill", "decode")
    unaware = await pd([prefill], [decode], health_interval_ms=60_000)
    watching = await pd([prefill], [decode], health_interval_ms=100)
    prefill.kill()
    with pytest.raises(UpstreamError, match="cannot connect to the prefill engine") as refused:
        await asyncio.wait_for(unaware.complete("dead-1", "chat", "/v1/chat/completions", *typed(chat())), 10)
    assert refused.value.status == 502
    await wait_for_state(watching, prefill.url, "down")
    with pytest.raises(Overloaded, match="no prefill backend is available") as caught:
        await watching.complete("dead-2", "chat", "/v1/chat/completions", *typed(chat()))
    assert caught.value.status == 503 and "Retry-After" in caught.value.headers


async def test_decode_killed_mid_stream_gives_in_band_error(engines, pd, aiohttp_client, logs):
    """A decode process killed mid-stream: the client got the first chunks, then an in-band error, then the stream closed."""
    prefill, decode = await engines("prefill", "decode", checkpoint="dummy:small")
    client = await pd([prefill], [decode])
    http = await aiohttp_client(relay_app(client))
    response = await http.post("/v1/chat/completions", json={**chat(max_tokens=400), "stream": True}, headers={"X-Request-ID": "kill-d"})
    assert response.status == 200
    frames = [await response.content.readuntil(b"\n\n") for _ in range(3)]
    decode.kill()
    rest = (await asyncio.wait_for(response.content.read(), 15)).decode()
    assert all(f.startswith(b'data: {"id"') for f in frames)
    assert '"error"' in rest and "[DONE]" not in rest and response.content.at_eof()
    failed = logs.events(events.ROUTER_DECODE_FAILED)
    assert failed[-1]["mid_stream"] is True and failed[-1]["request_id"] == "kill-d"


async def test_client_disconnect_cancels_the_decode(engines, pd, aiohttp_client, logs):
    """A client that goes away mid-stream makes the router close the decode leg; the engine cancels and frees the KV."""
    prefill, decode = await engines("prefill", "decode", checkpoint="dummy:small")
    client = await pd([prefill], [decode])
    http = await aiohttp_client(relay_app(client))
    response = await http.post("/v1/chat/completions", json={**chat(max_tokens=400), "stream": True}, headers={"X-Request-ID": "gone"})
    await response.content.readuntil(b"\n\n")
    response.close()
    cancelled = await wait_for_event(decode, events.ENGINE_REQUEST_CANCELLED, "gone", timeout_s=15)
    assert cancelled["kv_blocks_freed"] > 0
    assert [e["request_id"] for e in logs.events(events.ROUTER_CLIENT_DISCONNECTED)] == ["gone"]
    assert all(b.in_flight == 0 for b in client.fleet.scheduler.backends)


async def test_engine_rejection_keeps_status_and_message(engines, pd, logs):
    """An engine's 400 reaches the caller as a 400 with the engine's message, logged, and is not retried."""
    prefill, decode = await engines("prefill", "decode")
    client = await pd([prefill], [decode])
    with pytest.raises(InvalidRequest) as caught:
        await client.complete("bad-n", "chat", "/v1/chat/completions", *typed(chat(n=3)))
    assert caught.value.status == 400 and "n" in caught.value.message
    assert len(logs.events(events.ROUTER_PREFILL_FAILED)) == 1 and logs.events(events.ROUTER_UPSTREAM_ERROR)[0]["status"] == 400


async def test_router_process_cancels_a_non_streamed_request_whose_client_left(engines, tmp_path):
    """Through `python -m stack.router` itself: a non-streamed client that hangs up cancels the decode leg (KV freed)."""
    prefill, decode = await engines("prefill", "decode", checkpoint="dummy:small")
    port, health_port = free_port(), free_port()
    settings = router_settings(tmp_path, "router", prefill, decode, "your-model-id",
                               server=f"port = {port}\nhealth_port = {health_port}")
    log = tmp_path / "router.log"
    router = subprocess.Popen([sys.executable, "-m", "stack.router", "--config", str(settings)], cwd=REPO,
                              env={**os.environ, "PD_TEST_KEY": "k" * 32, "PD_INTERNAL_KEY": INTERNAL_KEY}, stdout=log.open("wb"),
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30  # upper bound: router start on a busy 2-core box
        while await probe_async(f"127.0.0.1:{health_port}", 1.0) != SERVING:
            assert router.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            await asyncio.sleep(0.2)
        body = {"model": "your-model-id", "max_tokens": 1500, "ignore_eos": True, "messages": [{"role": "user", "content": "Tell me everything."}]}
        async with aiohttp.ClientSession() as session:
            request = session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                                   headers={"Authorization": "Bearer " + "k" * 32, "X-Request-ID": "hangup"})
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(request, 2.0)  # the client gives up long before 1500 tokens
        # The router names the request itself (a client's X-Request-ID is only client_request_id): find its id.
        received = [json.loads(line) for line in log.read_text().splitlines() if '"router.scheduled"' in line]
        assert len(received) == 1, log.read_text()[-2000:]
        cancelled = await wait_for_event(decode, events.ENGINE_REQUEST_CANCELLED, received[0]["request_id"], timeout_s=15)
        assert cancelled["kv_blocks_freed"] > 0
    finally:
        router.terminate()
        router.wait(15)
    done = [line for line in log.read_text().splitlines() if '"router.request_done"' in line and '"hangup"' in line]
    assert done and '"status": 499' in done[0]
