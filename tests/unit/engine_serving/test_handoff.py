"""The engine's hand-off seam frees the KV receive buffer on every path: success, refusal, cancel.

In-process prefill and decode engines over the real KV socket on loopback; each test reads the
decode's receive buffer (`buffer_used`, `held_transfers`) and both KV pools afterwards.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from stack.engine import kv_wire, protocol, server
from stack.engine.kv_transfer import prompt_hash
from stack.engine.kv_wire import KVHeader, KVTrailer

from .conftest import EngineHandle, chat, prefill_leg, wait_until


def assert_all_free(*engines: EngineHandle) -> None:
    for engine in engines:
        pool = engine.engine.scheduler.pool
        assert pool.reclaimable_blocks == pool.total_blocks, f"{engine.engine.config.role} pool"
        consumer = engine.engine.handoff.consumer
        if consumer is not None:
            assert consumer.buffer_used == 0 and consumer.held_transfers == 0, "receive buffer"


async def prefilled(prefill: EngineHandle, decode: EngineHandle, body: dict, transfer_id: str) -> dict:
    """Run the prefill leg of `body`; returns the kv_transfer_params for the decode leg (the KV is held on decode)."""
    response = await prefill.client.post("/v1/chat/completions", json=prefill_leg(body, transfer_id, decode.kv_addr))
    assert response.status == 200, await response.text()
    params = (await response.json())["kv_transfer_params"]
    assert decode.engine.handoff.consumer.held_transfers == 1
    return params


async def test_a_streamed_decode_leg_releases_the_buffer_and_both_pools(engine_client) -> None:
    """Success: after a streamed decode leg the receive buffer and both KV pools are back to empty."""
    prefill, decode = await engine_client("prefill"), await engine_client("decode")
    body = chat("all of it comes back", max_tokens=6, temperature=0)
    params = await prefilled(prefill, decode, body, "t-ok")
    response = await decode.client.post("/v1/chat/completions", json=body | {"stream": True, "kv_transfer_params": params})

    assert response.status == 200 and (await response.text()).endswith("data: [DONE]\n\n")
    assert_all_free(prefill, decode)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_a_decode_leg_for_a_prompt_of_another_length_is_refused_and_released(engine_client, policy: str) -> None:
    """Validation failure (token count differs): the KV is released; `fail` answers 400, `recompute` prefills here."""
    prefill = await engine_client("prefill")
    decode = await engine_client("decode", kv={"kv_load_failure_policy": policy})
    params = await prefilled(prefill, decode, chat("short", max_tokens=3), "t-len")
    response = await decode.client.post("/v1/chat/completions", json=chat("a rather longer prompt", max_tokens=3, kv_transfer_params=params))

    if policy == "fail":
        assert response.status == 400 and (await response.json())["error"]["code"] == "kv_prompt_mismatch"
    else:
        assert response.status == 200 and (await response.json())["usage"]["completion_tokens"] == 3
    assert_all_free(prefill, decode)


async def test_a_decode_leg_that_can_never_fit_the_pool_releases_the_claimed_kv(engine_client) -> None:
    """Refused by the scheduler after the claim (kv_cache_too_small): the receive buffer still empties."""
    prefill = await engine_client("prefill")
    decode = await engine_client("decode", kv_cache_bytes=64 * 512, block_size=16)  # 64 tokens of KV on dummy:tiny
    params = await prefilled(prefill, decode, chat(max_tokens=200), "t-huge")
    response = await decode.client.post("/v1/chat/completions", json=chat(max_tokens=200, kv_transfer_params=params))

    assert response.status == 400 and (await response.json())["error"]["code"] == "kv_cache_too_small"
    assert_all_free(prefill, decode)


async def test_a_decode_leg_cancelled_while_queued_for_kv_blocks_releases_its_kv(engine_client, monkeypatch) -> None:
    """Cancel after the claim, while the sequence waits for pool room: the claimed KV leaves the buffer."""
    prefill = await engine_client("prefill")
    decode = await engine_client("decode", kv_cache_bytes=300 * 512, block_size=16)  # room for one 200-token request
    scheduler, consumer = decode.engine.scheduler, decode.engine.handoff.consumer
    entered, gate = threading.Event(), threading.Event()
    execute = scheduler._execute

    def held(work):
        entered.set()
        gate.wait(10)  # 10 s: a hang guard only
        return execute(work)

    monkeypatch.setattr(scheduler, "_execute", held)
    body = chat(max_tokens=200, temperature=0)
    occupying = asyncio.ensure_future(decode.client.post("/v1/chat/completions", json=body))  # takes the pool
    await asyncio.to_thread(entered.wait, 10)
    params = await prefilled(prefill, decode, body, "t-queued")
    waiting = asyncio.ensure_future(decode.client.post("/v1/chat/completions", json=body | {"kv_transfer_params": params}))
    await wait_until(lambda: len(scheduler.waiting) == 1 and consumer.held_transfers == 0)  # claimed, queued
    assert consumer.buffer_used > 0  # the queued sequence still reads the receive arrays

    waiting.cancel()  # the router gives up
    await wait_until(lambda: scheduler.waiting[0].cancelled)  # the handler noticed
    gate.set()
    assert (await occupying).status == 200
    await wait_until(lambda: not scheduler.waiting and consumer.buffer_used == 0)
    assert_all_free(prefill, decode)


async def test_a_claim_cancelled_as_its_kv_arrives_strands_nothing(engine_client) -> None:
    """KV delivered in the same loop turn its claim is cancelled is either returned by the claim or released."""
    decode = await engine_client("decode")
    consumer, model = decode.engine.handoff.consumer, decode.engine.model
    cfg, n = model.config, 4
    claim = asyncio.ensure_future(consumer.claim("t-race", 5000))
    await wait_until(lambda: "t-race" in consumer._waiters)

    k = np.zeros((cfg.n_layers, n, cfg.n_kv_heads, cfg.head_dim), np.float32)
    payload = kv_wire.segments(k, k, n)
    header = KVHeader("t-race", "race", model.fingerprint, "float32", cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n,
                      prompt_hash=prompt_hash([1] * n))
    trailer = KVTrailer(first_token=1, seed=0, checksums=tuple(kv_wire.checksum(p) for p in payload))
    reply, reservation = consumer.admit(header, "test")
    assert reply.ok and reservation is not None
    arrays = consumer.receive_arrays(reservation)
    consumer.complete(reservation, trailer, "test", 0.001, [kv_wire.checksum(p) for p in kv_wire.segments(arrays.k, arrays.v, n)])
    claim.cancel()  # before the claim has run again
    try:
        (await claim).release()  # Python 3.11's wait_for hands over what arrived; the caller releases it
    except asyncio.CancelledError:
        pass  # 3.12+: the claim itself released it
    assert consumer.buffer_used == 0 and consumer.held_transfers == 0


async def test_a_prefill_leg_cancelled_as_its_prefill_finishes_gives_the_cache_back(engine_client, monkeypatch) -> None:
    """The caller goes away in the loop turn the prefill finished (the router crashed): nobody reads the result, yet
    the prefill pool gets its blocks back (otherwise they stay held for the engine's lifetime: the chaos tier's router
    crash found it, 4 blocks stranded)."""
    prefill, decode = await engine_client("prefill"), await engine_client("decode")
    engine = prefill.engine
    scheduler, leg = engine.scheduler, None
    run_prefill = scheduler.prefill

    async def finished_then_caller_gone(*args, **kwargs):
        done = await run_prefill(*args, **kwargs)
        leg.cancel()  # before the leg has run again: it sees CancelledError, not the result
        return done

    monkeypatch.setattr(scheduler, "prefill", finished_then_caller_gone)
    body = prefill_leg(chat("the caller leaves right now", temperature=0), "t-gone", decode.kv_addr)
    req = protocol.parse_request("chat", body, model_id=engine.config.model, tokenizer=engine.model.tokenizer,
                                 max_model_len=engine.max_model_len)
    leg = asyncio.ensure_future(engine.handoff.prefill("gone", req))
    with pytest.raises(asyncio.CancelledError):
        await leg
    await wait_until(lambda: decode.engine.handoff.consumer.buffer_used == 0)  # the push was cut off or its lease ends
    assert_all_free(prefill)


async def test_a_decode_leg_whose_caller_leaves_as_it_is_queued_stops(engine_client, monkeypatch) -> None:
    """The handler is cancelled in the loop turn the decode leg queued its sequence: the sequence nobody reads is
    cancelled, not decoded to max_tokens, and both pools and the receive buffer come back."""
    prefill, decode = await engine_client("prefill"), await engine_client("decode")
    engine = decode.engine
    body = chat("nobody reads this one", max_tokens=200, temperature=0)
    params = await prefilled(prefill, decode, body, "t-orphan")
    req = protocol.parse_request("chat", body | {"kv_transfer_params": params}, model_id=engine.config.model,
                                 tokenizer=engine.model.tokenizer, max_model_len=engine.max_model_len)
    queued, handler = [], None
    run_decode = engine.handoff.decode

    async def queued_then_caller_gone(*args):
        queued.append(await run_decode(*args))
        handler.cancel()  # aiohttp cancels the handler: the client closed its connection
        return queued[0]

    monkeypatch.setattr(engine.handoff, "decode", queued_then_caller_gone)
    connected = SimpleNamespace(transport=SimpleNamespace(is_closing=lambda: False))
    handler = asyncio.ensure_future(server._unless_client_gone(connected, engine.handoff.decode("orphan", req),
                                                               orphan=engine.scheduler.cancel))
    with pytest.raises(asyncio.CancelledError):
        await handler
    await wait_until(lambda: queued[0].finished)
    assert len(queued[0].output) < 200, "the orphaned sequence decoded to max_tokens"
    assert_all_free(prefill, decode)
