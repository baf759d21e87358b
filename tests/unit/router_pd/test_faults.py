"""Faults that need precise timing, against fake engines (fake_engine.py says why): every request ends
with a complete answer or an explicit error, never a hang or a silent truncation."""

from __future__ import annotations

import asyncio
import time

import pytest

from stack.common import events
from stack.common.errors import InvalidRequest, Overloaded, RateLimited, UpstreamError, UpstreamTimeout
from tests.unit.router_pd.conftest import batches, backend, relay_app, until, wait_for_state, typed
from tests.unit.router_pd.fake_engine import Faults, chunk_text

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def collect(client, request_id="r1", body=CHAT):
    return [chunk async for batch in batches(client, request_id, "chat", "/v1/chat/completions", *typed(dict(body))) for chunk in batch]


async def test_prefill_error_retries_on_the_other_prefill(fake, pd, logs):
    """A prefill that drops the connection before answering is retried on another prefill; the client sees success."""
    broken = await fake("prefill", faults=Faults(drop_before_answer=1))
    healthy = await fake("prefill")
    decode = await fake("decode")
    client = await pd([broken, healthy], [decode], policy="round_robin")
    chunks = await collect(client)
    assert chunk_text(chunks) == "t0 t1 t2 t3 "
    failed = logs.events(events.ROUTER_PREFILL_FAILED)
    assert [f["prefill"] for f in failed] == [broken.url] and failed[0]["retried"] is True and failed[0]["request_id"] == "r1"
    assert len(healthy.seen) == 1
    # Each prefill attempt has its own transfer id; decode got the successful one.
    assert decode.seen[0]["kv_transfer_params"]["transfer_id"] == healthy.seen[0]["kv_transfer_params"]["transfer_id"]


async def test_decode_500_before_first_chunk_retries_with_a_new_pair(fake, pd, logs):
    """A decode failing before its first chunk is retried on another decode with a fresh prefill leg."""
    prefill = await fake("prefill")
    bad = await fake("decode", faults=Faults(http_500=1))
    good = await fake("decode")
    client = await pd([prefill], [bad, good], policy="round_robin")
    chunks = await collect(client)
    assert chunk_text(chunks) == "t0 t1 t2 t3 "
    transfer_ids = [leg["kv_transfer_params"]["transfer_id"] for leg in prefill.seen]
    assert len(transfer_ids) == 2 and transfer_ids[0] != transfer_ids[1]
    assert [leg["kv_transfer_params"]["transfer_id"] for leg in bad.seen + good.seen] == transfer_ids
    failed = logs.events(events.ROUTER_DECODE_FAILED)
    assert failed[0]["mid_stream"] is False and failed[0]["retried"] is True
    assert "CUDA out of memory (fake)" in logs.events(events.ROUTER_UPSTREAM_ERROR)[0]["body"]


async def test_engine_400_is_passed_on_without_retry(fake, pd, logs):
    """An engine's 4xx keeps its status and message and is retried nowhere (the request itself is bad)."""
    prefill = await fake("prefill", faults=Faults(http_400=5))
    other = await fake("prefill")
    decode = await fake("decode")
    client = await pd([prefill, other], [decode], policy="round_robin")
    with pytest.raises(InvalidRequest, match="'n' > 1 is not supported") as caught:
        await client.complete("r400", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert caught.value.status == 400
    assert (len(prefill.seen), len(other.seen), len(decode.seen)) == (1, 0, 0)
    assert logs.events(events.ROUTER_UPSTREAM_ERROR)[0]["status"] == 400
    assert prefill.url in [b["url"] for b in client.health_snapshot()["backends"] if b["breaker"] == "closed"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_refusing_what_prefill_accepted_is_a_502_not_the_clients_400(fake, pd, stream):
    """Prefill and decode run the same parser, so a decode's 4xx after the prefill leg succeeded means the engines
    disagree (max_model_len, tokenizer): the client gets a 502 naming the decode and what to compare, never a 400."""
    prefill, decode = await fake("prefill"), await fake("decode", faults=Faults(http_400=1))
    client = await pd([prefill], [decode])
    with pytest.raises(UpstreamError) as caught:
        await client.complete("r400d", "chat", "/v1/chat/completions", *typed(dict(CHAT, stream=stream)))
    assert caught.value.status == 502 and caught.value.code == "decode_rejected_after_prefill"
    assert decode.url in caught.value.message and "'n' > 1 is not supported" in caught.value.message
    assert "max_model_len" in caught.value.message


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completion_budget_past_the_shared_window_is_the_clients_400(fake, pd, stream):
    """Only decode checks prompt + max_tokens against the window (the prefill leg asks one token). With both engines'
    windows the same, decode's refusal is the client's 400 naming max_tokens, as one engine would have answered."""
    prefill, decode = await fake("prefill", max_model_len=512), await fake("decode", max_model_len=512)
    client = await pd([prefill], [decode])
    with pytest.raises(InvalidRequest, match="maximum context length is 512 tokens") as caught:
        await client.complete("rlen", "chat", "/v1/chat/completions", *typed(dict(CHAT, max_tokens=510, stream=stream)))
    assert caught.value.status == 400 and caught.value.param == "max_tokens"
    assert (len(prefill.seen), len(decode.seen)) == (1, 1)


async def test_a_decode_window_smaller_than_prefills_is_a_502_naming_both(fake, pd):
    """The same refusal from a decode whose window is smaller than its prefill's is the deployment's fault."""
    prefill, decode = await fake("prefill", max_model_len=512), await fake("decode", max_model_len=64)
    client = await pd([prefill], [decode])
    with pytest.raises(UpstreamError) as caught:
        await client.complete("rlen2", "chat", "/v1/chat/completions", *typed(dict(CHAT, max_tokens=100)))
    assert caught.value.status == 502 and caught.value.code == "decode_rejected_after_prefill"
    assert "decode's max_model_len 64 is not prefill's 512" in caught.value.message


async def test_a_window_is_asked_again_when_its_engine_comes_back(fake, pd):
    """A decode restarted with a smaller window (down, then up again) is asked for it before it takes requests: the
    same refusal that was the client's 400 is then the deployment's 502."""
    prefill, decode = await fake("prefill", max_model_len=512), await fake("decode", max_model_len=512)
    client = await pd([prefill], [decode])
    with pytest.raises(InvalidRequest):
        await client.complete("rwin1", "chat", "/v1/chat/completions", *typed(dict(CHAT, max_tokens=510)))
    await decode.set_health(False)
    await wait_for_state(client, decode.url, "down")
    decode.max_model_len = 256
    await decode.set_health(True)
    await wait_for_state(client, decode.url, "up")
    with pytest.raises(UpstreamError, match="decode's max_model_len 256 is not prefill's 512"):
        await client.complete("rwin2", "chat", "/v1/chat/completions", *typed(dict(CHAT, max_tokens=300)))


async def test_an_engine_without_tool_calling_is_named_not_the_clients_request(fake, pd, logs):
    """vLLM started without tool calling refuses tools with tool_choice "auto" (every agent turn): the client's 400 names
    the field and says the engine lacks tool calling (its request is valid), nothing is retried, and tool_choice "none"
    is served by the same engines."""
    prefill, other = await fake("prefill", faults=Faults(no_tool_parser=True)), await fake("prefill", faults=Faults(no_tool_parser=True))
    decode = await fake("decode", faults=Faults(no_tool_parser=True))
    client = await pd([prefill, other], [decode], policy="round_robin")
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(InvalidRequest) as caught:
        await client.complete("rtools", "chat", "/v1/chat/completions", *typed(dict(CHAT, tools=tools)))
    err = caught.value
    assert (err.status, err.param, err.code) == (400, "tool_choice", "unsupported_parameter")
    assert "prefill engine runs without tool calling" in err.message and 'tool_choice "none"' in err.message
    assert (len(prefill.seen), len(other.seen), len(decode.seen)) == (1, 0, 0)
    assert "--enable-auto-tool-choice" in logs.events(events.ROUTER_UPSTREAM_ERROR)[0]["body"]
    answer = await client.complete("rnone", "chat", "/v1/chat/completions", *typed(dict(CHAT, tools=tools, tool_choice="none")))
    assert answer["choices"][0]["message"]["content"]


async def test_a_colocated_engines_400_stays_the_clients(fake, pd):
    """Without a prefill leg the one engine's 400 is about the request itself: passed on as it is."""
    both = await fake("both", faults=Faults(http_400=1))
    client = await pd([both], [both])
    with pytest.raises(InvalidRequest, match="'n' > 1 is not supported"):
        await client.complete("r400c", "chat", "/v1/chat/completions", *typed(dict(CHAT)))


async def test_decode_dying_mid_stream_is_an_error_after_the_first_chunk(fake, pd, logs):
    """A decode dying after 2 chunks: the caller got those chunks, then an UpstreamError (not a short success)."""
    prefill = await fake("prefill")
    decode = await fake("decode", tokens=6, faults=Faults(die_after_chunks=2))
    client = await pd([prefill], [decode])
    got = []
    with pytest.raises(UpstreamError, match="broke the connection"):
        async for batch in batches(client, "rmid", "chat", "/v1/chat/completions", *typed(dict(CHAT))):
            got += batch
    assert chunk_text(got) == "t0 t1 "
    failed = logs.events(events.ROUTER_DECODE_FAILED)
    assert failed[-1]["mid_stream"] is True and failed[-1]["request_id"] == "rmid"
    assert backend(client, decode.url).in_flight == 0  # the slot came back


async def test_a_burst_is_relayed_in_fewer_batches_than_chunks(fake, pd):
    """Chunks that arrive in one network read come out as one batch (one write to the client), complete and in order."""
    client = await pd([await fake("prefill")], [await fake("decode", tokens=6, faults=Faults(burst=True))])
    read = [batch async for batch in batches(client, "rb", "chat", "/v1/chat/completions", *typed(dict(CHAT)))]
    chunks = [chunk for batch in read for chunk in batch]
    assert chunk_text(chunks) == "t0 t1 t2 t3 t4 t5 " and chunks[-1]["usage"]["completion_tokens"] == 6
    assert len(read) < 7  # 6 token chunks + the usage chunk, written at once, read in fewer pieces than one per chunk


async def test_a_stream_read_to_its_end_gives_its_decode_connection_back(fake, pd):
    """A decode stream read to its end ([DONE] and the body's end, written together) leaves its connection in the pool:
    the next request's leg comes on the same one (a stream given up on closes it: test_stalled_decode_hits_the_idle_timeout,
    test_pd_engines' client disconnect)."""
    decode = await fake("decode")
    client = await pd([await fake("prefill")], [decode])
    assert chunk_text(await collect(client, "first")) == chunk_text(await collect(client, "second")) == "t0 t1 t2 t3 "
    assert len(decode.peers) == 2 and decode.peers[0] == decode.peers[1]


async def test_in_band_error_in_a_burst_comes_after_the_good_chunks(fake, pd, logs):
    """An engine's in-band error frame arriving together with good chunks: the caller gets those chunks first, then the error."""
    decode = await fake("decode", tokens=6, faults=Faults(burst=True, error_after_chunks=2))
    client = await pd([await fake("prefill")], [decode])
    got = []
    with pytest.raises(UpstreamError, match="decode step failed"):
        async for batch in batches(client, "rbe", "chat", "/v1/chat/completions", *typed(dict(CHAT))):
            got += batch
    assert chunk_text(got) == "t0 t1 "
    assert logs.events(events.ROUTER_DECODE_FAILED)[-1]["mid_stream"] is True


async def test_stream_without_done_is_an_error_not_success(fake, pd):
    """A decode stream that ends without finish_reason/[DONE] raises instead of passing as complete."""
    client = await pd([await fake("prefill")], [await fake("decode", faults=Faults(no_done=True))])
    with pytest.raises(UpstreamError, match="ended early"):
        await collect(client)


async def test_stalled_decode_hits_the_idle_timeout(fake, pd):
    """A decode that stops sending mid-stream is cut off after idle_timeout_ms with a timeout error."""
    client = await pd([await fake("prefill")], [await fake("decode", faults=Faults(stall_after_chunks=1))], idle_timeout_ms=300)
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout):
        await collect(client)
    # Lower bound: the idle timeout really waited; upper bound (5 s) catches a hang.
    assert 0.25 <= time.monotonic() - started < 5.0


async def test_single_prefill_failing_gives_a_clean_5xx(fake, pd, logs):
    """With one prefill that fails, the client gets a clean 502 (retries only go to other prefills), and decode is never called."""
    prefill = await fake("prefill", faults=Faults(http_500=10))
    decode = await fake("decode")
    client = await pd([prefill], [decode], max_retries=2)
    with pytest.raises(UpstreamError, match=r"prefill engine failed \(HTTP 500\): CUDA out of memory"):
        await client.complete("r5", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert len(prefill.seen) == 1 and decode.seen == []
    assert all(b.in_flight == 0 for b in client.fleet.scheduler.backends)


async def test_full_queue_gets_429_then_503_with_retry_after(fake, pd):
    """All slots busy: up to queue_size requests wait, the next gets 429; a waiter past queue_timeout_ms gets 503."""
    decode = await fake("decode", faults=Faults(delay_s=1.0))
    client = await pd([await fake("prefill")], [decode], max_concurrent=1, queue_size=1, queue_timeout_ms=300)
    busy = asyncio.create_task(client.complete("a", "chat", "/v1/chat/completions", *typed(dict(CHAT))))
    await until(lambda: len(decode.seen) == 1, "holding the decode slot")
    queued = asyncio.create_task(client.complete("b", "chat", "/v1/chat/completions", *typed(dict(CHAT))))
    await until(lambda: client.fleet.scheduler.queue_depth == 1, "queued")
    with pytest.raises(RateLimited) as full:
        await client.complete("c", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert full.value.status == 429 and full.value.headers["Retry-After"] == "1"
    with pytest.raises(Overloaded) as timed_out:
        await queued
    assert timed_out.value.status == 503 and "Retry-After" in timed_out.value.headers
    assert (await busy)["choices"][0]["message"]["content"] == "xxxx"


async def test_breaker_opens_then_recovers(fake, pd, logs):
    """Repeated decode failures open its circuit (503 naming decode, no upstream call); after the cool-down a success closes it."""
    prefill = await fake("prefill")
    decode = await fake("decode", faults=Faults(http_500=2))
    now = [0.0]
    client = await pd([prefill], [decode], breaker_failures=2, breaker_cooldown_ms=300, max_retries=0, clock=lambda: now[0])
    for _ in range(2):
        with pytest.raises(UpstreamError):
            await client.complete("rb", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    calls = len(decode.seen)
    with pytest.raises(Overloaded, match="no decode backend is available .*circuit open"):
        await client.complete("rb", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert len(decode.seen) == calls  # rejected without touching the engine
    now[0] += 0.3  # the cool-down has passed
    assert (await client.complete("rb", "chat", "/v1/chat/completions", *typed(dict(CHAT))))["usage"]["completion_tokens"] == 4
    states = [e["state"] for e in logs.events(events.BACKEND_CIRCUIT)]
    assert states == ["open", "half_open", "closed"]


@pytest.mark.parametrize("health_check", ["grpc", "http"])
async def test_health_monitor_takes_a_backend_out_and_back(fake, pd, logs, health_check):
    """A decode whose health turns bad gets no requests until it is good again: gRPC NOT_SERVING for our engines,
    GET /health 503 for vLLM engines (health_check = "http", which serve no gRPC)."""
    prefill = await fake("prefill")
    first, second = await fake("decode"), await fake("decode")
    client = await pd([prefill], [first, second], health_check=health_check, health_interval_ms=50)
    await first.set_health(False)
    await wait_for_state(client, first.url, "down")
    for i in range(3):
        await client.complete(f"h{i}", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert len(first.seen) == 0 and len(second.seen) == 3
    await first.set_health(True)
    await wait_for_state(client, first.url, "up")
    down = [e for e in logs.events(events.BACKEND_HEALTH) if e["backend"] == first.url]
    assert [e["state"] for e in down] == ["down", "up"] and f"{health_check} health" in down[0]["reason"]


async def test_health_probe_timeouts_take_a_backend_out_only_after_several_in_a_row(fake, pd, logs, silent_address):
    """A decode whose health endpoint stops answering keeps serving through health_timeouts_to_down - 1 missed
    probes (one slow answer on a busy host is not a dead engine), and is taken out when the misses go on."""
    prefill, decode = await fake("prefill"), await fake("decode")
    decode.health_addr = silent_address
    client = await pd([prefill], [decode], health_interval_ms=100, health_timeouts_to_down=3)
    # start() has run one probe round: one timeout, still up, so the request is served.
    assert backend(client, decode.url).up and backend(client, decode.url).probe_timeouts == 1
    assert (await client.complete("t1", "chat", "/v1/chat/completions", *typed(dict(CHAT))))["usage"]["completion_tokens"] == 4
    await wait_for_state(client, decode.url, "down")
    [down] = [e for e in logs.events(events.BACKEND_HEALTH) if e["backend"] == decode.url]
    assert down["state"] == "down" and down["reason"] == f"grpc health TIMEOUT x3 at {silent_address}"


async def test_in_band_error_and_closed_stream_through_an_app(fake, pd, aiohttp_client):
    """Through an HTTP front: a mid-stream decode death reaches the client as an in-band error event, then the stream closes."""
    client = await pd([await fake("prefill")], [await fake("decode", tokens=6, faults=Faults(die_after_chunks=2))])
    http = await aiohttp_client(relay_app(client))
    response = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status == 200
    text = await asyncio.wait_for(response.text(), 5)
    frames = [f for f in text.split("\n\n") if f]
    assert len(frames) == 3 and '"error"' in frames[-1] and "[DONE]" not in text


async def test_metrics_show_latencies_counters_and_backend_state(fake, pd):
    """After a streamed PD request, /metrics text has TTFT/ITL/prefill histograms, per-backend counters and health gauges."""
    prefill, decode = await fake("prefill"), await fake("decode")
    client = await pd([prefill], [decode])
    await collect(client)
    client.metrics.observe_request("chat", 200, 0.05)
    text, content_type = client.metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    assert 'pd_router_ttft_seconds_count{mode="disaggregated"} 1' in text
    assert "pd_router_itl_seconds_count 3" in text  # 4 token chunks → 3 gaps
    assert "pd_router_prefill_seconds_count 1" in text and "pd_router_kv_handoff_seconds_count 1" in text
    assert f'pd_router_backend_requests_total{{backend="{decode.url}",outcome="ok",role="decode"}} 1' in text
    assert f'pd_router_backend_up{{backend="{prefill.url}",role="prefill"}} 1' in text
    assert 'pd_router_requests_total{api="chat",status="200"} 1' in text and "pd_router_queue_depth 0" in text


async def test_decode_silent_before_first_chunk_times_out(fake, pd):
    """A decode that never starts streaming fails after kv_transfer_timeout_ms + first_token_timeout_ms, not never."""
    client = await pd([await fake("prefill")], [await fake("decode", faults=Faults(delay_s=30))],
                      kv_transfer_timeout_ms=100, first_token_timeout_ms=200, max_retries=0)
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout, match="before the first chunk"):
        await collect(client)
    # Lower bound: the whole first-chunk budget (0.3 s) was granted; upper bound (5 s) catches a hang.
    assert 0.28 <= time.monotonic() - started < 5.0
