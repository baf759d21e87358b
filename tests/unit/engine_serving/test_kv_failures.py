"""Every KV hand-off failure, produced for real on loopback, with its message and log event on each side."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np

from stack.engine import kv_wire
from stack.engine.kv_transfer import _in_own_thread, prompt_hash
from stack.engine.kv_wire import KVHeader, KVTrailer, Reply
from stack.engine.model import Model

from .conftest import EngineHandle, Logs, chat, free_port, prefill_leg, wait_until

LONG_PROMPT = " ".join(f"w{i}" for i in range(100))  # a few hundred tokens: ~200 * 512 B of KV on dummy:tiny


async def push(prefill: EngineHandle, body: dict, transfer_id: str, kv_addr: str) -> tuple[int, dict]:
    response = await prefill.client.post("/v1/chat/completions", json=prefill_leg(body, transfer_id, kv_addr))
    return response.status, await response.json()


async def test_fingerprint_mismatch_is_rejected_on_both_sides(engine_client, tiny_other_seed: Model, logs: Logs) -> None:
    """Prefill and decode on different weights: decode refuses the KV, prefill answers 502 naming both fingerprints."""
    decode = await engine_client("decode")
    prefill = await engine_client("prefill", model=tiny_other_seed)
    status, body = await push(prefill, chat(), "t-fp", decode.kv_addr)

    local, remote = decode.engine.model.fingerprint, tiny_other_seed.fingerprint
    assert status == 502 and body["error"]["code"] == "kv_fingerprint_mismatch"
    assert local in body["error"]["message"] and remote in body["error"]["message"]
    consumer_line = logs.one("kv_consumer.fingerprint_mismatch")
    assert (consumer_line["local"], consumer_line["remote"]) == (local, remote)
    producer_line = logs.one("kv_producer.rejected")
    assert producer_line["reason"] == "fingerprint_mismatch" and producer_line["transfer_id"] == "t-fp"
    assert decode.engine.handoff.consumer.buffer_used == 0
    pool = prefill.engine.scheduler.pool  # the refusal stops the prefill; the step after frees its cache
    await wait_until(lambda: pool.reclaimable_blocks == pool.total_blocks)


async def test_transfer_larger_than_kv_buffer_size_names_both_numbers(engine_client, logs: Logs) -> None:
    """A prompt whose KV exceeds the decode's kv_buffer_size fails with 503 decode_kv_capacity, both sizes and decode's address."""
    decode = await engine_client("decode", kv={"kv_buffer_size": "4e3"})
    prefill = await engine_client("prefill")
    status, body = await push(prefill, chat(LONG_PROMPT), "t-big", decode.kv_addr)

    consumer_line = logs.one("kv_consumer.buffer_full")
    size = consumer_line["bytes"]
    assert size > 4000 and consumer_line["kv_buffer_size"] == 4000 and consumer_line["buffer_used"] == 0
    assert status == 503 and body["error"]["code"] == "decode_kv_capacity"
    message = body["error"]["message"]
    assert str(size) in message and "kv_buffer_size=4000" in message and decode.kv_addr in message
    assert f"({consumer_line['num_tokens']} tokens)" in message
    producer_line = logs.one("kv_producer.rejected")
    assert producer_line["reason"] == "buffer_full" and producer_line["bytes"] == size and producer_line["kv_buffer_size"] == 4000


def raw_transfer(kv_addr: str, model: Model, corrupt: bool, transfer_id: str = "t-raw") -> tuple[Reply, Reply | None]:
    """A hand-made producer (wire v2): a correct header, the payload (one flipped word if `corrupt`), the trailer."""
    cfg, n = model.config, 5
    rng = np.random.default_rng(0)
    k = rng.standard_normal((cfg.n_layers, n, cfg.n_kv_heads, cfg.head_dim), dtype=np.float32)
    v = rng.standard_normal((cfg.n_layers, n, cfg.n_kv_heads, cfg.head_dim), dtype=np.float32)
    payload = kv_wire.segments(k, v, n)
    header = KVHeader(transfer_id, "raw-client", model.fingerprint, "float32", cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n,
                      prompt_hash=prompt_hash([1] * n))
    trailer = KVTrailer(first_token=1, seed=0, checksums=tuple(kv_wire.checksum(p) for p in payload))
    if corrupt:
        payload[3] = payload[3].copy()
        payload[3].reshape(-1)[7] += 1.0
    host, port = kv_addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        reader = sock.makefile("rb")
        sock.sendall(header.encode())
        first = Reply.decode(reader.read(kv_wire.REPLY_PREFIX.size), reader.read)
        if not first.ok:
            return first, None
        for segment in payload:
            sock.sendall(segment.tobytes())
        sock.sendall(trailer.encode())
        return first, Reply.decode(reader.read(kv_wire.REPLY_PREFIX.size), reader.read)


async def test_corrupted_payload_fails_the_checksum_and_is_dropped(engine_client, logs: Logs) -> None:
    """A payload that does not match the header's checksums is refused in the ack and frees its buffer."""
    decode = await engine_client("decode")
    accepted, ack = await asyncio.to_thread(raw_transfer, decode.kv_addr, decode.engine.model, True)

    assert accepted.ok and ack is not None and not ack.ok and ack.code == "checksum_mismatch"
    assert "layer 1 V" in ack.message  # segments go K0 V0 K1 V1: the flipped word sits in segment 3
    line = logs.one("kv_consumer.checksum_mismatch")
    assert line["transfer_id"] == "t-raw" and line["expected"] != line["actual"]
    consumer = decode.engine.handoff.consumer
    assert consumer.buffer_used == 0 and consumer.held_transfers == 0


async def test_decode_times_out_and_fails_under_policy_fail(engine_client, logs: Logs) -> None:
    """No KV within kv_transfer_timeout_ms: 504 naming the setting, kv_consumer.timeout then kv_consumer.failed."""
    decode = await engine_client("decode", kv={"kv_transfer_timeout_ms": 300, "kv_load_failure_policy": "fail"})
    body = chat(max_tokens=4, kv_transfer_params={"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "t-never"})
    response = await decode.client.post("/v1/chat/completions", json=body)

    error = (await response.json())["error"]
    assert response.status == 504 and error["code"] == "kv_transfer_timeout"
    assert "kv_transfer_timeout_ms=300" in error["message"]
    timeout = logs.one("kv_consumer.timeout")
    assert timeout["kv_transfer_timeout_ms"] == 300 and 300 <= timeout["waited_ms"] < 5000  # upper bound: hang guard
    assert logs.one("kv_consumer.failed")["reason"] == "timeout"
    ok = await decode.client.post("/v1/chat/completions", json=chat(max_tokens=2))
    assert ok.status == 200  # and the engine keeps serving


async def test_decode_times_out_and_recomputes_under_policy_recompute(engine_client, logs: Logs) -> None:
    """Policy recompute: after the timeout decode prefills itself and answers what a colocated engine would."""
    decode = await engine_client("decode", kv={"kv_transfer_timeout_ms": 200, "kv_load_failure_policy": "recompute"})
    body = chat(max_tokens=8, temperature=0)
    expected = await (await decode.client.post("/v1/chat/completions", json=body)).json()
    response = await decode.client.post("/v1/chat/completions", json=body | {"kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "t-lost"}})

    assert response.status == 200
    got = await response.json()
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]
    assert logs.one("kv_consumer.timeout")["transfer_id"] == "t-lost"
    recompute = logs.one("kv_consumer.recompute")
    assert recompute["reason"] == "timeout" and recompute["prompt_tokens"] == got["usage"]["prompt_tokens"]


async def test_unreachable_decode_is_a_connect_failure_naming_the_address(engine_client, logs: Logs) -> None:
    """Nothing listens at decode_kv_addr: prefill answers 502 kv_connect_failed naming the address, and stops the prefill
    (its cache is freed by the next step)."""
    prefill = await engine_client("prefill")
    dead = f"127.0.0.1:{free_port()}"
    status, body = await push(prefill, chat(), "t-dead", dead)

    assert status == 502 and body["error"]["code"] == "kv_connect_failed"
    assert dead in body["error"]["message"] and "refused" in body["error"]["message"].lower()
    line = logs.one("kv_producer.connect_failed")
    assert line["decode_kv_addr"] == dead and "Refused" in line["error"]
    pool = prefill.engine.scheduler.pool
    await wait_until(lambda: pool.reclaimable_blocks == pool.total_blocks)


async def test_unclaimed_kv_is_freed_when_its_lease_expires(engine_client, logs: Logs) -> None:
    """KV pushed but never claimed leaves the receive buffer after kv_lease_ms; the buffer returns to 0."""
    decode = await engine_client("decode", kv={"kv_lease_ms": 300, "kv_transfer_timeout_ms": 200})
    prefill = await engine_client("prefill")
    status, body = await push(prefill, chat(), "t-orphan", decode.kv_addr)
    assert status == 200
    consumer = decode.engine.handoff.consumer
    held = body["kv_transfer_params"]["num_tokens"] * decode.engine.model.config.kv_bytes_per_token
    assert consumer.buffer_used == held and consumer.held_transfers == 1

    await wait_until(lambda: consumer.held_transfers == 0)
    assert consumer.buffer_used == 0
    line = logs.one("kv_consumer.lease_expired")
    assert line["transfer_id"] == "t-orphan" and line["bytes"] == held and line["lease_ms"] == 300
    late = await decode.client.post("/v1/chat/completions", json=chat(kv_transfer_params=body["kv_transfer_params"]))
    assert late.status == 504  # the KV is gone: the default policy fails


async def test_decode_leg_with_another_prompt_is_refused(engine_client, logs: Logs) -> None:
    """A decode leg whose prompt differs from the prefilled one is refused (400) and the KV freed."""
    decode = await engine_client("decode")
    prefill = await engine_client("prefill")
    status, body = await push(prefill, chat("hello there"), "t-swap", decode.kv_addr)
    assert status == 200
    response = await decode.client.post("/v1/chat/completions", json=chat("something else", kv_transfer_params=body["kv_transfer_params"]))

    assert response.status == 400 and (await response.json())["error"]["code"] == "kv_prompt_mismatch"
    assert logs.one("kv_consumer.prompt_mismatch")["transfer_id"] == "t-swap"
    assert decode.engine.handoff.consumer.buffer_used == 0


async def test_kv_arriving_after_its_claim_gave_up_is_refused(engine_client, logs: Logs) -> None:
    """A push for a transfer whose decode request already timed out is refused instead of held for the lease."""
    decode = await engine_client("decode", kv={"kv_transfer_timeout_ms": 100})
    prefill = await engine_client("prefill")
    leg = chat(kv_transfer_params={"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "t-late"})
    assert (await decode.client.post("/v1/chat/completions", json=leg)).status == 504
    status, body = await push(prefill, chat(), "t-late", decode.kv_addr)

    assert status == 502 and body["error"]["code"] == "kv_claim_expired"
    assert logs.one("kv_consumer.protocol_error")["code"] == "claim_expired"
    assert decode.engine.handoff.consumer.buffer_used == 0


async def test_garbage_on_the_kv_port_is_a_protocol_error(engine_client, logs: Logs) -> None:
    """Bytes that are not a KV transfer get a bad_header reply and the listener keeps working."""
    decode = await engine_client("decode")

    def send_garbage() -> Reply:
        host, port = decode.kv_addr.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
            reader = sock.makefile("rb")
            return Reply.decode(reader.read(kv_wire.REPLY_PREFIX.size), reader.read)

    reply = await asyncio.to_thread(send_garbage)
    assert not reply.ok and reply.code == "bad_header" and "magic" in reply.message
    assert logs.one("kv_consumer.protocol_error")["code"] == "bad_header"
    accepted, ack = await asyncio.to_thread(raw_transfer, decode.kv_addr, decode.engine.model, False)
    assert accepted.ok and ack is not None and ack.ok


async def test_pd_legs_sent_to_the_wrong_role_are_refused(engine_client) -> None:
    """A decode leg to a prefill engine, or a prefill leg to a decode engine, is a 400 naming the role."""
    prefill = await engine_client("prefill")
    decode = await engine_client("decode")
    to_prefill = await prefill.client.post("/v1/chat/completions", json=chat(kv_transfer_params={
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "t-x"}))
    to_decode = await decode.client.post("/v1/chat/completions", json=prefill_leg(chat(), "t-y", decode.kv_addr))

    assert to_prefill.status == 400 and (await to_prefill.json())["error"]["code"] == "kv_not_a_consumer"
    assert to_decode.status == 400 and (await to_decode.json())["error"]["code"] == "kv_not_a_producer"
    assert "role prefill" in (await to_prefill.json())["error"]["message"]


async def test_receive_arrays_are_recycled_within_the_buffer_budget(engine_client) -> None:
    """A second transfer lands in the first one's (released) arrays; idle arrays never push memory past kv_buffer_size."""
    decode = await engine_client("decode", kv={"kv_buffer_size": 100_000})
    consumer = decode.engine.handoff.consumer
    first_ack = (await asyncio.to_thread(raw_transfer, decode.kv_addr, decode.engine.model, False, "t-a"))[1]
    first = await consumer.claim("t-a", 1000)
    arrays = first.reservation.arrays
    first.release()
    second_ack = (await asyncio.to_thread(raw_transfer, decode.kv_addr, decode.engine.model, False, "t-b"))[1]
    second = await consumer.claim("t-b", 1000)

    assert first_ack.ok and second_ack.ok and second.reservation.arrays is arrays
    assert consumer.buffer_used + sum(a.nbytes for a in consumer._idle) <= 100_000
    second.release()
    assert consumer.buffer_used == 0


async def test_a_producer_that_stalls_mid_payload_loses_its_reservation(engine_client, logs: Logs) -> None:
    """A connection that stops sending mid-payload is cut after kv_lease_ms of silence; its bytes leave the buffer."""
    decode = await engine_client("decode", kv={"kv_lease_ms": 200})
    model, consumer = decode.engine.model, decode.engine.handoff.consumer
    cfg, n = model.config, 4
    segment_bytes = n * cfg.n_kv_heads * cfg.head_dim * 4
    header = KVHeader("t-stall", "stalled", model.fingerprint, "float32", cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n, prompt_hash="-")
    host, port = decode.kv_addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(header.encode())
    await reader.readexactly(kv_wire.REPLY_PREFIX.size)  # accepted: the reservation is made
    writer.write(b"\0" * segment_bytes)  # one segment, then silence
    await writer.drain()
    await wait_until(lambda: consumer.buffer_used > 0)

    await wait_until(lambda: consumer.buffer_used == 0)
    stalled = logs.one("kv_consumer.stalled")
    assert stalled["transfer_id"] == "t-stall" and stalled["idle_ms"] >= 200 and stalled["received"] == segment_bytes
    line = logs.one("kv_consumer.incomplete")
    assert line["transfer_id"] == "t-stall" and line["received"] == segment_bytes and line["bytes"] == header.payload_bytes(0)
    writer.close()


async def test_a_second_push_under_a_held_transfer_id_is_refused(engine_client, logs: Logs) -> None:
    """Two prefill legs with one transfer id: the second is refused (502 kv_duplicate_transfer), the first stays claimable."""
    decode = await engine_client("decode")
    prefill = await engine_client("prefill")
    first_status, first = await push(prefill, chat(), "t-dup", decode.kv_addr)
    second_status, second = await push(prefill, chat(), "t-dup", decode.kv_addr)

    assert first_status == 200 and second_status == 502 and second["error"]["code"] == "kv_duplicate_transfer"
    assert logs.one("kv_consumer.protocol_error")["code"] == "duplicate_transfer"
    claimed = await decode.client.post("/v1/chat/completions", json=chat(kv_transfer_params=first["kv_transfer_params"], max_tokens=3))
    assert claimed.status == 200 and decode.engine.handoff.consumer.buffer_used == 0


async def test_a_decode_leg_whose_client_leaves_while_waiting_stops_waiting(engine_client) -> None:
    """A client that disconnects while its KV is awaited releases the wait; KV arriving later is refused, not held."""
    decode = await engine_client("decode", kv={"kv_transfer_timeout_ms": 10_000})
    consumer = decode.engine.handoff.consumer
    leg = chat(kv_transfer_params={"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "t-gone"})
    waiting = asyncio.ensure_future(decode.client.post("/v1/chat/completions", json=leg))
    await wait_until(lambda: "t-gone" in consumer._waiters)
    waiting.cancel()  # the router (client) goes away

    await wait_until(lambda: "t-gone" not in consumer._waiters)  # long before the 10 s timeout
    prefill = await engine_client("prefill")
    status, body = await push(prefill, chat(), "t-gone", decode.kv_addr)
    assert status == 502 and body["error"]["code"] == "kv_claim_expired"
    assert consumer.buffer_used == 0 and consumer.held_transfers == 0


def test_a_push_that_ends_after_its_loop_closed_ends_quietly() -> None:
    """A push thread that finishes after its engine's event loop closed (the engine stopped while a transfer was in
    flight) has nobody to tell: it ends without an exception in the thread (it used to raise "Event loop is
    closed" there, which pytest and the interpreter print as an unhandled thread exception)."""
    release, finished = threading.Event(), threading.Event()
    failures: list[BaseException] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: failures.append(args.exc_value)  # type: ignore[assignment]

    def slow_push() -> str:
        release.wait(10)
        finished.set()
        return "pushed"

    async def start() -> None:
        _in_own_thread(slow_push)

    try:
        asyncio.run(start())  # the loop is closed when run returns; the push is still going
        release.set()
        assert finished.wait(10)
        for thread in [t for t in threading.enumerate() if t.name == "kv-push"]:
            thread.join(10)
    finally:
        threading.excepthook = hook
    assert failures == []
