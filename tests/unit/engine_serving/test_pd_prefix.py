"""PD with prefix caching over the real KV socket: a multi-turn session ships only what decode lacks,
the delta transfer decodes as a full one, and float16 KV keeps greedy outputs."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import numpy as np

from stack.engine import kv_wire
from stack.engine.kv_cache import KVCache
from stack.engine.kv_transfer import KVProducer, LayerStream, prompt_hash
from stack.engine.kv_wire import KVHeader, KVTrailer, Reply

from .conftest import EngineHandle, chat, prefill_leg

BS = 16
SYSTEM = "You are a careful coding agent. Tools: read_file, write_file, run_tests. " * 3  # ~220 byte tokens


async def pd_turn(prefill: EngineHandle, decode: EngineHandle, body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """Both legs as the router sends them; the decode leg's JSON answer."""
    first = await prefill.client.post("/v1/chat/completions", json=prefill_leg(body, transfer_id, decode.kv_addr))
    assert first.status == 200, await first.text()
    params = (await first.json())["kv_transfer_params"]
    second = await decode.client.post("/v1/chat/completions", json=body | {"kv_transfer_params": params})
    assert second.status == 200, await second.text()
    return await second.json()


def turn_body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return chat(max_tokens=8, temperature=0, logprobs=True) | {"messages": messages}


def received(decode: EngineHandle) -> float:
    return decode.engine.scheduler.metrics.kv_bytes.value(side="receive")


def token_logprobs(answer: dict[str, Any]) -> np.ndarray:
    return np.array([e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]])


async def test_a_session_ships_only_new_blocks_and_decodes_as_a_full_transfer(engine_client) -> None:
    """Turn k ships no more than its new tokens (+ one block of rounding); outputs equal a full-transfer decode's."""
    prefill = await engine_client("prefill", block_size=BS)
    decode = await engine_client("decode", block_size=BS)  # prefix caching on: keeps the session's blocks
    prefill_full = await engine_client("prefill", block_size=BS)
    decode_full = await engine_client("decode", block_size=BS, prefix_caching=False)  # holds nothing: every transfer is whole
    per_token = decode.engine.model.config.kv_bytes_per_token
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    previous: list[int] = []  # the previous turn's prompt token ids: decode holds at least their full blocks
    for turn in range(4):
        messages.append({"role": "user", "content": f"step {turn}: fix the failing test number {turn * 7}"})
        before, before_full = received(decode), received(decode_full)
        answer = await pd_turn(prefill, decode, turn_body(messages), f"s-{turn}")
        reference = await pd_turn(prefill_full, decode_full, turn_body(messages), f"f-{turn}")
        shipped, shipped_full = received(decode) - before, received(decode_full) - before_full
        prompt = answer["usage"]["prompt_tokens"]
        tokens = (await (await decode.client.post("/tokenize", json={"model": "tiny", "messages": messages})).json())["tokens"]
        assert len(tokens) == prompt

        assert answer["choices"][0]["message"] == reference["choices"][0]["message"], f"turn {turn}"
        np.testing.assert_allclose(token_logprobs(answer), token_logprobs(reference), rtol=0, atol=1e-3)
        assert shipped_full == prompt * per_token  # the whole prompt
        # New this turn: past the common prefix with the last prompt. (The reply in between is held too when it
        # re-tokenizes to the generated ids; the dummy model's random bytes often do not, as invalid UTF-8.)
        common = next((i for i, (a, b) in enumerate(zip(tokens, previous)) if a != b), min(len(tokens), len(previous)))
        new_tokens = prompt - common
        assert shipped <= (new_tokens + BS) * per_token, f"turn {turn}: {shipped} bytes for {new_tokens} new tokens"
        if turn:
            assert shipped < shipped_full / 2 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        previous = tokens
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    assert decode.engine.scheduler.metrics.kv_reused.value() > 0
    consumer = decode.engine.handoff.consumer
    assert consumer is not None and consumer.buffer_used == 0
    assert decode.engine.scheduler.prefix.pinned == 0  # every reused block was unpinned after its copy


async def test_float16_kv_on_the_wire_keeps_greedy_outputs(engine_client) -> None:
    """kv_dtype=float16: half the bytes on the wire; greedy tokens equal the float32 colocated run, logprobs close."""
    both = await engine_client("both", block_size=BS, prefix_caching=False)
    prefill = await engine_client("prefill", block_size=BS, kv_dtype="float16")
    decode = await engine_client("decode", block_size=BS, kv_dtype="float16")
    body = turn_body([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "summarise the plan"}]) | {"max_tokens": 16}
    colocated = await (await both.client.post("/v1/chat/completions", json=body)).json()
    answer = await pd_turn(prefill, decode, body, "t-f16")

    assert answer["choices"][0]["message"] == colocated["choices"][0]["message"]
    diff = np.abs(token_logprobs(answer) - token_logprobs(colocated)).max()
    assert diff < 0.05, f"float16 KV moved a token logprob by {diff}"
    prompt = answer["usage"]["prompt_tokens"]
    assert received(decode) == prompt * decode.engine.model.config.kv_bytes_per_token // 2


async def test_a_prefill_without_prefix_caching_ships_everything_to_a_caching_decode(engine_client) -> None:
    """No block hashes in the header: decode reuses nothing, even for a prompt it has seen."""
    prefill = await engine_client("prefill", block_size=BS, prefix_caching=False)
    decode = await engine_client("decode", block_size=BS)
    body = turn_body([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "again"}])
    sizes = []
    for i in range(2):
        before = received(decode)
        prompt = (await pd_turn(prefill, decode, body, f"t-{i}"))["usage"]["prompt_tokens"]
        sizes.append(received(decode) - before)
    assert sizes == [prompt * decode.engine.model.config.kv_bytes_per_token] * 2
    assert decode.engine.scheduler.metrics.kv_reused.value() == 0 and decode.engine.scheduler.prefix.blocks  # it holds them, unasked


async def test_each_layer_goes_on_the_wire_before_the_next_is_computed(tiny) -> None:
    """The push sends layer 0 as soon as it is done: a receiver reads all of it while layer 1 does not exist yet."""
    cfg, n = tiny.config, 40
    cache = KVCache(cfg, n)
    cache.k[...] = np.random.default_rng(1).standard_normal(cache.k.shape, dtype=np.float32)
    cache.v[...] = -cache.k
    cache.set_length(n)
    header = KVHeader("t-stream", "stream", tiny.fingerprint, "float16", cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n, prompt_hash([1] * n))
    segment = n * cfg.n_kv_heads * cfg.head_dim * 2  # float16 bytes of one layer's K (or V)
    layer_zero: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    stream = LayerStream()

    async def receive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (length,) = struct.unpack("!I", (await reader.readexactly(kv_wire.PREAMBLE.size))[6:])
        await reader.readexactly(length)
        writer.write(Reply(True, "accepted", "send", {"reused_blocks": 0}).encode())
        layer_zero.set_result(await reader.readexactly(2 * segment))  # layer 0's K and V, before anything else exists
        rest = await reader.readexactly(2 * segment * (cfg.n_layers - 1))
        (trailer_length,) = struct.unpack("!I", await reader.readexactly(4))
        trailer = KVTrailer.decode(await reader.readexactly(trailer_length), cfg.n_layers)
        got = layer_zero.result() + rest
        sums = [kv_wire.checksum(np.frombuffer(got[i * segment : (i + 1) * segment], np.uint8)) for i in range(2 * cfg.n_layers)]
        ok = sums == list(trailer.checksums) and trailer.first_token == 7
        writer.write(Reply(ok, "stored" if ok else "checksum_mismatch", "done").encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(receive, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    push = asyncio.ensure_future(KVProducer(io_timeout_s=5).push(header, stream, f"127.0.0.1:{port}"))
    stream.layer_done(0, cache)
    sent = await asyncio.wait_for(layer_zero, 10)  # 10 s: a hang guard only
    assert np.array_equal(np.frombuffer(sent[:segment], np.float16), cache.k[0].astype(np.float16).reshape(-1))
    for layer in range(1, cfg.n_layers):
        stream.layer_done(layer, cache)
    stream.finish(KVTrailer(first_token=7, seed=0))
    result = await asyncio.wait_for(push, 10)
    assert result.bytes == header.payload_bytes(0) and result.reused_blocks == 0
    server.close()
    await server.wait_closed()
