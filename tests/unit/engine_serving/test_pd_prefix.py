"""PD with prefix caching over the real KV socket: a multi-turn session ships only what decode lacks,
the delta transfer decodes as a full one, and float16 KV keeps greedy outputs."""

from __future__ import annotations

from typing import Any

import numpy as np

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
