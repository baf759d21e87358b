"""PD hand-off between real engine processes: the same tokens as a colocated engine, over the KV socket."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import pytest

from stack.common.sse import DONE, read_events
from stack.engine import batched_decode
from stack.engine.server import warm_up

from .conftest import EngineProcess, chat, prefill_leg, write_hf_checkpoint


@dataclass
class Trio:
    both: EngineProcess
    prefill: EngineProcess
    decode: EngineProcess


@pytest.fixture(scope="module", params=["dummy:tiny", "hf-checkpoint"])
def trio(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    tmp = tmp_path_factory.mktemp("trio")
    checkpoint = request.param if request.param.startswith("dummy") else str(write_hf_checkpoint(tmp / "checkpoint"))
    base = {"model": "tiny", "checkpoint": checkpoint, "seed": 0}
    engines = Trio(
        both=EngineProcess(tmp, "both", {**base, "role": "both"}),
        prefill=EngineProcess(tmp, "prefill", {**base, "role": "prefill"}),
        decode=EngineProcess(tmp, "decode", {**base, "role": "decode", "kv_transfer_config": {"kv_port": 0}}),
    )
    try:
        for engine in (engines.both, engines.prefill, engines.decode):
            engine.wait_ready()
        yield engines
    finally:
        for engine in (engines.both, engines.prefill, engines.decode):
            engine.stop()


async def stream_chunks(session: aiohttp.ClientSession, url: str, body: dict[str, Any], request_id: str) -> list[dict[str, Any]]:
    async with session.post(f"{url}/v1/chat/completions", json=body, headers={"X-Request-ID": request_id}) as response:
        assert response.status == 200, await response.text()
        chunks = []
        async for _, data in read_events(response.content):
            if data == DONE:
                break
            chunks.append(json.loads(data))
    return chunks


SAMPLINGS = [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 1234}]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
async def test_pd_pair_streams_the_same_tokens_as_colocated(trio: Trio, sampling: dict[str, Any]) -> None:
    """Prefill → KV socket → decode yields token-for-token the colocated stream (greedy and seeded)."""
    body = chat("hello there w1 w2 w3 hello world", max_tokens=24, stream=True, stream_options={"include_usage": True}, **sampling)
    request_id = f"pd-{uuid.uuid4().hex[:8]}"
    transfer_id = f"t-{request_id}"
    kv_addr = f"127.0.0.1:{trio.decode.kv_port()}"
    async with aiohttp.ClientSession() as session:
        colocated = await stream_chunks(session, trio.both.url, body, f"colo-{request_id}")

        async with session.post(f"{trio.prefill.url}/v1/chat/completions", json=prefill_leg(body, transfer_id, kv_addr),
                                headers={"X-Request-ID": request_id}) as response:
            assert response.status == 200, await response.text()
            prefilled = await response.json()
        params = prefilled["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["transfer_id"] == transfer_id
        disaggregated = await stream_chunks(session, trio.decode.url, body | {"kv_transfer_params": params}, request_id)

    def tokens(chunks: list[dict[str, Any]]) -> list[str]:
        return [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]]

    assert tokens(disaggregated) == tokens(colocated)
    assert disaggregated[-1]["usage"] == colocated[-1]["usage"]
    assert disaggregated[-1]["usage"]["completion_tokens"] > 1
    assert prefilled["usage"]["completion_tokens"] == 1  # the prefill leg computes the first token only
    assert params["num_tokens"] == prefilled["usage"]["prompt_tokens"] == colocated[-1]["usage"]["prompt_tokens"]
    # The article's check: kv_producer lines on prefill, kv_consumer lines on decode, one request id.
    sent = [e for e in trio.prefill.events("kv_producer.sent") if e["transfer_id"] == transfer_id]
    received = trio.decode.wait_event("kv_consumer.received")
    trio.decode.wait_event("kv_consumer.claimed")  # an engine's lines leave at the end of its loop step: wait, not read
    claimed = [e for e in trio.decode.events("kv_consumer.claimed") if e["transfer_id"] == transfer_id]
    assert len(sent) == 1 and sent[0]["request_id"] == request_id and sent[0]["bytes"] > 0
    assert claimed and claimed[0]["request_id"] == request_id
    assert any(e["transfer_id"] == transfer_id and e["bytes"] == sent[0]["bytes"] for e in trio.decode.events("kv_consumer.received")), received
    # The decode engine did not prefill the prompt itself.
    assert not [e for e in trio.decode.events("engine.prefill_done") if e["request_id"] == request_id]


async def test_decode_health_shows_the_buffer_back_at_zero(engine_client) -> None:
    """After claimed hand-offs (streamed and not) decode's /health reports an empty receive buffer and pool."""
    prefill, decode = await engine_client("prefill"), await engine_client("decode")
    await warm_up(decode.client.app)
    for i, stream in enumerate((True, False)):
        body = chat(f"hand-off number {i}", max_tokens=5, stream=stream)
        leg = await (await prefill.client.post("/v1/chat/completions", json=prefill_leg(body, f"t-health-{i}", decode.kv_addr))).json()
        answer = await decode.client.post("/v1/chat/completions", json=body | {"kv_transfer_params": leg["kv_transfer_params"]})
        assert answer.status == 200
        await answer.read()

    response = await decode.client.get("/health")
    body = await response.json()
    assert response.status == 200 and body["kv_port"] == decode.engine.handoff.consumer.port
    assert body["kv_buffer_used"] == 0 and body["kv_held_transfers"] == 0
    assert body["kv_free_blocks"] == body["kv_total_blocks"]


@pytest.mark.parametrize("max_tokens", [1, 9])
async def test_completions_endpoint_hands_off_too(engine_client, max_tokens: int) -> None:
    """/v1/completions legs (non-streamed) give the colocated text, down to a decode leg of one token."""
    colocated = await engine_client("both")
    prefill = await engine_client("prefill", chunked_prefill=True, max_num_batched_tokens=8)  # the prompt spans steps
    decode = await engine_client("decode")
    body = {"model": "tiny", "prompt": "the KV cache moves from prefill to decode", "max_tokens": max_tokens, "temperature": 0}
    expected = await (await colocated.client.post("/v1/completions", json=body)).json()

    leg = body | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": f"c-{max_tokens}",
                                                          "decode_kv_addr": decode.kv_addr}}
    prefilled = await (await prefill.client.post("/v1/completions", json=leg)).json()
    got = await (await decode.client.post("/v1/completions", json=body | {"kv_transfer_params": prefilled["kv_transfer_params"]})).json()

    assert got["choices"] == expected["choices"] and got["usage"] == expected["usage"]
    for engine in (prefill, decode):
        pool = engine.engine.scheduler.pool
        assert pool.reclaimable_blocks == pool.total_blocks
    assert decode.engine.handoff.consumer.buffer_used == 0



async def test_pd_pair_streams_the_same_constrained_json_as_colocated(trio: Trio) -> None:
    """json_schema over engine processes (byte tokenizer and HF tokenizer.json): prefill's first token advances
    decode's grammar matcher, so the streamed JSON equals the colocated one and validates."""
    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}}, "required": ["ok", "n"]}
    body = chat("answer in JSON", max_tokens=60, stream=True, temperature=0, logprobs=True,
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    request_id = f"pdj-{uuid.uuid4().hex[:8]}"
    kv_addr = f"127.0.0.1:{trio.decode.kv_port()}"
    async with aiohttp.ClientSession() as session:
        colocated = await stream_chunks(session, trio.both.url, body, f"colo-{request_id}")
        async with session.post(f"{trio.prefill.url}/v1/chat/completions", json=prefill_leg(body, f"t-{request_id}", kv_addr),
                                headers={"X-Request-ID": request_id}) as response:
            assert response.status == 200, await response.text()
            params = (await response.json())["kv_transfer_params"]
        disaggregated = await stream_chunks(session, trio.decode.url, body | {"kv_transfer_params": params}, request_id)

    def pieces(chunks: list[dict[str, Any]]) -> list[tuple[str, Any]]:
        return [(c["choices"][0]["delta"].get("content", ""), c["choices"][0]["logprobs"]) for c in chunks if c["choices"]]

    assert pieces(disaggregated) == pieces(colocated)
    jsonschema.validate(json.loads("".join(text for text, _ in pieces(colocated))), schema)
    assert colocated[-1]["choices"][0]["finish_reason"] == "stop"


async def test_received_kv_decodes_alike_through_the_kernel_and_numpy(engine_client, monkeypatch) -> None:
    """PD: the KV a prefill pushes is decoded by the compiled kernel (attention numba) as by numpy (attention numpy):
    the same greedy tokens, each token's logprob within 1e-4 (a prompt over many 4-token blocks)."""
    monkeypatch.setattr(batched_decode, "MIN_SEGMENTS", 1)  # the kernel takes this lone sequence too
    prefill = await engine_client("prefill", block_size=4)
    decodes = {arm: await engine_client("decode", block_size=4, attention=arm) for arm in ("numba", "numpy")}
    body = {"model": "tiny", "prompt": "the KV cache moves from prefill to decode, block by block", "max_tokens": 12,
            "temperature": 0, "logprobs": 1}
    got = {}
    for arm, decode in decodes.items():
        leg = body | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": f"k-{arm}",
                                                              "decode_kv_addr": decode.kv_addr}}
        prefilled = await (await prefill.client.post("/v1/completions", json=leg)).json()
        answer = await decode.client.post("/v1/completions", json=body | {"kv_transfer_params": prefilled["kv_transfer_params"]})
        assert answer.status == 200, await answer.text()
        got[arm] = (await answer.json())["choices"][0]["logprobs"]
    assert got["numba"]["tokens"] == got["numpy"]["tokens"] and len(got["numba"]["tokens"]) == 12
    np.testing.assert_allclose(got["numba"]["token_logprobs"], got["numpy"]["token_logprobs"], rtol=0, atol=1e-4)
