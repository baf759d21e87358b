"""Long prompts through PD (issue 19): a push that keeps streaming is never cut, a decode that cannot hold the KV
refuses it at the header (503 decode_kv_capacity), and a prefill whose caller left stops between layers."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace

import numpy as np
import pytest

from stack.engine import kv_wire
from stack.engine.checkpoint import DUMMY_CONFIGS, dummy_weights
from stack.engine.kv_transfer import LayerStream, prompt_hash
from stack.engine.kv_wire import KVHeader, KVTrailer, Reply
from stack.engine.model import Model
from stack.engine.tokenizer import dummy_tokenizer
from stack.engine.weights import fingerprint

from .conftest import Logs, chat, prefill_leg, wait_until

LEASE_MS = 300


@pytest.fixture(scope="module")
def tiny4() -> Model:
    """dummy:tiny with 4 layers: a forward that can be stopped halfway."""
    config = replace(DUMMY_CONFIGS["tiny"], n_layers=4)
    weights = dummy_weights(config, 0)
    return Model("dummy:tiny4", config, weights, dummy_tokenizer(), fingerprint(config, weights))


async def test_a_push_still_streaming_outlives_kv_lease_ms(engine_client) -> None:
    """Payload bytes 0.1 s apart for 4x kv_lease_ms: the lease counts from the last byte, so the transfer completes and is claimed."""
    decode = await engine_client("decode", kv={"kv_lease_ms": LEASE_MS})
    model, consumer = decode.engine.model, decode.engine.handoff.consumer
    cfg, n = model.config, 6
    rng = np.random.default_rng(0)
    k = rng.standard_normal((cfg.n_layers, n, cfg.n_kv_heads, cfg.head_dim), dtype=np.float32)
    v = rng.standard_normal((cfg.n_layers, n, cfg.n_kv_heads, cfg.head_dim), dtype=np.float32)
    payload = kv_wire.segments(k, v, n)
    header = KVHeader("t-slow", "slow", model.fingerprint, "float32", cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n,
                      prompt_hash=prompt_hash([1] * n))
    host, port = decode.kv_addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(header.encode())
    assert (await _reply(reader)).ok
    data = b"".join(segment.tobytes() for segment in payload)
    pieces = 12  # 0.1 s apart: 1.2 s, four times kv_lease_ms, each gap a third of it (a slow prefill's layers)
    for i in range(pieces):
        writer.write(data[i * len(data) // pieces : (i + 1) * len(data) // pieces])
        await writer.drain()
        await asyncio.sleep(0.1)
    writer.write(KVTrailer(first_token=1, seed=0, checksums=tuple(kv_wire.checksum(p) for p in payload)).encode())
    await writer.drain()
    ack = await _reply(reader)
    writer.close()

    assert ack.ok, ack.message
    received = await consumer.claim("t-slow", 1000)
    assert np.array_equal(received.k, k)
    received.release()


async def _reply(reader: asyncio.StreamReader) -> Reply:
    prefix = await reader.readexactly(kv_wire.REPLY_PREFIX.size)
    body = await reader.readexactly(kv_wire.REPLY_PREFIX.unpack(prefix)[1])
    return Reply.decode(prefix, lambda n: body[:n])


async def test_a_transfer_the_decode_pool_can_never_hold_is_refused_at_the_header(engine_client, logs: Logs) -> None:
    """Decode's KV pool is smaller than the prompt: no payload moves, the prefill answers 503 decode_kv_capacity naming
    the tokens, the pool's size and the decode's KV address, and its own cache goes back to the pool."""
    decode = await engine_client("decode", kv_cache_bytes=64 * 512)  # 64 tokens of dummy:tiny KV (512 B a token)
    prefill = await engine_client("prefill")
    body = chat(" ".join(f"w{i}" for i in range(100)))
    response = await prefill.client.post("/v1/chat/completions", json=prefill_leg(body, "t-cap", decode.kv_addr))
    error = (await response.json())["error"]

    refused = logs.one("kv_consumer.pool_too_small")
    assert response.status == 503 and error["code"] == "decode_kv_capacity"
    assert refused["num_tokens"] > 64 and refused["pool_tokens"] == 64
    assert all(str(x) in error["message"] for x in (refused["num_tokens"], 64, decode.kv_addr))
    assert logs.one("kv_producer.rejected")["reason"] == "pool_too_small"
    assert not logs.events("kv_consumer.incomplete") and decode.engine.handoff.consumer.buffer_used == 0
    pool = prefill.engine.scheduler.pool
    await wait_until(lambda: pool.reclaimable_blocks == pool.total_blocks)


async def test_a_prefill_whose_caller_left_stops_between_layers(engine_client, tiny4: Model, logs: Logs, monkeypatch) -> None:
    """The router closes the prefill leg's connection during layer 0: the engine logs engine.request_abandoned, stops the
    forward after layer 2 of 4 (engine.prefill_stopped), never finishes the prefill, and frees its KV on both sides."""
    decode = await engine_client("decode", model=tiny4)
    prefill = await engine_client("prefill", model=tiny4)
    reached, resume = threading.Event(), threading.Event()
    layer_done = LayerStream.layer_done

    def held_first_layer(stream: LayerStream, layer: int, cache) -> None:
        layer_done(stream, layer, cache)
        if layer == 0:  # the forward thread waits here until the caller has gone
            reached.set()
            resume.wait(5)

    monkeypatch.setattr(LayerStream, "layer_done", held_first_layer)
    body = json.dumps(prefill_leg(chat("hello " * 50), "t-gone", decode.kv_addr)).encode()
    url = prefill.client.make_url("/v1/chat/completions")
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(f"POST {url.path} HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await wait_until(reached.is_set)
    writer.close()  # the router gives up on the leg: it closes the connection
    await wait_until(lambda: bool(logs.events("engine.request_abandoned")))
    resume.set()

    await wait_until(lambda: bool(logs.events("engine.prefill_stopped")))
    stopped = logs.one("engine.prefill_stopped")
    assert stopped["layers_done"] == 2 and stopped["computed_tokens"] == 0
    assert logs.one("engine.request_abandoned")["pd_leg"] == "prefill"
    pool, consumer = prefill.engine.scheduler.pool, decode.engine.handoff.consumer
    await wait_until(lambda: pool.reclaimable_blocks == pool.total_blocks and consumer.buffer_used == 0)
    assert not logs.events("engine.prefill_done") and not logs.events("kv_producer.sent")
    ok = await prefill.client.post("/v1/chat/completions", json=prefill_leg(chat(), "t-next", decode.kv_addr))
    assert ok.status == 200  # the engine serves the next leg at once
