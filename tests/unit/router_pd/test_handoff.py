"""Each hand-off kind's legs as the engines receive them (fake engines record every body): what prefill is sent, what
decode is sent, and the request id both carry."""

from __future__ import annotations

import re

import pytest

from stack.common import events
from stack.common.errors import UpstreamError
from stack.router.backends import Backend, Breaker
from stack.router.handoff import Colocated, P2pNccl
from tests.unit.router_pd.fake_engine import VLLM_NIXL_PREFILL_PARAMS, chunk_text
from tests.unit.router_pd.conftest import batches, typed
from tests.unit.router_pd.test_p2pnccl import VLLM_CONSUMER_RE, VLLM_PRODUCER_RE

# A client body with what prefill must not see (min_tokens, stream_options) and what no client may send (kv_transfer_params).
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "min_tokens": 2,
        "stream_options": {"include_usage": False}, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "forged"}}
# vLLM's toy proxy's prefill params (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py), written out here so a
# change to the router's copy shows.
TOY_PROXY_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
                    "remote_host": None, "remote_port": None}


async def collect(client, request_id="r1", body=CHAT):
    return [chunk async for batch in batches(client, request_id, "chat", "/v1/chat/completions", *typed({**body, "stream": True})) for chunk in batch]


def assert_prefill_leg(leg: dict) -> None:
    """vLLM's toy proxy's prefill leg: one token, not streamed, no stream_options; the client's min_tokens 2
    becomes 1 (that one token, which our decode continues from, must not be EOS; vLLM needs min ≤ max)."""
    assert leg["max_tokens"] == 1 and leg["stream"] is False
    assert "stream_options" not in leg and leg["min_tokens"] == 1


def assert_decode_leg(leg: dict) -> None:
    """The client's request as sent, streamed with usage."""
    assert leg["max_tokens"] == 4 and leg["min_tokens"] == 2 and leg["stream"] is True
    assert leg["stream_options"] == {"include_usage": True}


async def test_push_prefill_is_told_where_to_push_and_decode_gets_its_answer(fake, pd, logs):
    """pd-push: prefill gets {do_remote_decode, transfer_id, decode_kv_addr} (the address decode reported), decode gets
    what prefill answered, both under the client's request id; a client's own kv_transfer_params never get through."""
    prefill, decode = await fake("prefill"), await fake("decode", kv_port=7123)
    client = await pd([prefill], [decode])
    assert client.fleet.handoff.kind == "pd-push"
    assert chunk_text(await collect(client)) == "t0 t1 t2 t3 "
    [p_leg], [d_leg], [answer] = prefill.seen, decode.seen, prefill.prefill_answers
    params = p_leg["kv_transfer_params"]
    assert params == {"do_remote_decode": True, "transfer_id": params["transfer_id"], "decode_kv_addr": "127.0.0.1:7123"}
    assert re.fullmatch(r"[0-9a-f]{32}", params["transfer_id"])
    assert_prefill_leg(p_leg)
    assert d_leg["kv_transfer_params"] == answer["kv_transfer_params"] and d_leg["kv_transfer_params"]["transfer_id"] == params["transfer_id"]
    assert_decode_leg(d_leg)
    assert p_leg["headers"]["X-Request-ID"] == d_leg["headers"]["X-Request-ID"] == "r1"
    [done] = logs.events(events.ROUTER_PREFILL_DONE)  # the leg and its hand-off in one line
    assert logs.events(events.ROUTER_KV_HANDOFF) == []
    assert done["transfer_id"] == params["transfer_id"] and done["decode"] == decode.url
    assert done["kv_transfer_params"] == sorted(answer["kv_transfer_params"])


async def test_nixl_prefill_gets_the_toy_proxy_params_and_decode_gets_its_answer_whole(fake, pd, logs):
    """nixl: prefill gets vLLM's toy-proxy params (no transfer id, no address); all 14 keys of vLLM's answer, the six newer
    ones included, reach decode unchanged, streamed and not; decode's KV address is never asked for."""
    prefill, decode = await fake("prefill", nixl=True), await fake("decode", kv_port=None)  # vLLM's /health names no port
    client = await pd([prefill], [decode], kv_connector="nixl")
    assert client.fleet.handoff.kind == "nixl"
    await collect(client)
    answer = await client.complete("r2", "chat", "/v1/chat/completions", *typed(dict(CHAT, stream=True)))
    assert "kv_transfer_params" not in answer  # clients never learn PD exists
    for p_leg in prefill.seen:
        assert p_leg["kv_transfer_params"] == TOY_PROXY_PARAMS
        assert_prefill_leg(p_leg)
    assert len(VLLM_NIXL_PREFILL_PARAMS) == 14
    assert {"dcp_size", "pp_size", "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode",
            "remote_prefill_cached_tokens"} <= set(VLLM_NIXL_PREFILL_PARAMS)
    assert [leg["kv_transfer_params"] for leg in decode.seen] == [VLLM_NIXL_PREFILL_PARAMS] * 2
    assert_decode_leg(decode.seen[0])
    assert decode.seen[1]["stream"] is False and "stream_options" not in decode.seen[1]
    assert [leg["headers"]["X-Request-ID"] for leg in prefill.seen + decode.seen] == ["r1", "r2", "r1", "r2"]
    assert logs.events(events.BACKEND_KV_ADDR) == [] and client.health_snapshot()["kv_connector"] == "nixl"


async def test_colocated_sends_one_ordinary_request(fake, pd, logs):
    """Same endpoints for prefill and decode: one request per client request, no kv_transfer_params, the client's
    id; whatever kv_connector says."""
    both = await fake("both")
    client = await pd([both], [both], kv_connector="nixl")
    assert client.fleet.handoff.kind == "colocated" and client.fleet.mode == "colocated"
    assert chunk_text(await collect(client)) == "t0 t1 t2 t3 "
    assert (await client.complete("r2", "chat", "/v1/chat/completions", *typed(dict(CHAT, stream=True))))["choices"][0]["message"]["content"] == "xxxx"
    assert len(both.seen) == 2 and all("kv_transfer_params" not in leg for leg in both.seen)
    assert_decode_leg(both.seen[0])
    assert [leg["headers"]["X-Request-ID"] for leg in both.seen] == ["r1", "r2"]
    assert [e["mode"] for e in logs.events(events.ROUTER_SCHEDULED)] == ["colocated", "colocated"]
    assert logs.events(events.ROUTER_PREFILL_DONE) == [] and logs.events(events.BACKEND_KV_ADDR) == []


def test_p2pnccl_route_is_the_request_id_and_no_params():
    """p2pnccl: both legs carry one id naming both registered zmq addresses (as vLLM parses it) and no kv_transfer_params."""
    def registered(role: str, host: str, zmq_address: str) -> Backend:
        url = f"http://{host}:8000"
        return Backend(url, role, 1, f"{url}/health", Breaker(url, 3, 1.0), "http", kv_addr=zmq_address)  # type: ignore[arg-type]

    handoff = P2pNccl()
    prefill, decode = registered("prefill", "10.0.1.2", "10.0.1.2:21001"), registered("decode", "10.0.1.3", "10.0.1.3:22001")
    route = handoff.route("client-id", prefill, decode)
    assert route.prefill_params is None and route.transfer_id == route.request_id
    assert re.search(VLLM_PRODUCER_RE, route.request_id).groups() == ("10.0.1.3", "22001")  # type: ignore[union-attr]
    assert re.search(VLLM_CONSUMER_RE, route.request_id).groups() == ("10.0.1.2", "21001")  # type: ignore[union-attr]
    assert handoff.decode_params(route, {"choices": [], "kv_transfer_params": {"anything": 1}}) is None
    assert handoff.route("client-id", prefill, decode).request_id != route.request_id  # unique per attempt
    colocated = Colocated().route("client-id", decode, decode)
    assert (colocated.request_id, colocated.prefill_params) == ("client-id", None)


@pytest.mark.parametrize("kind", ["pd-push", "nixl"])
async def test_prefill_answering_without_kv_transfer_params_is_a_clean_502(fake, pd, logs, kind):
    """A prefill engine that is not a KV producer answers without kv_transfer_params: 502 saying so, decode never called."""
    prefill, decode = await fake("prefill", nixl=kind == "nixl", kv_producer=False), await fake("decode")
    client = await pd([prefill], [decode], kv_connector=kind)
    with pytest.raises(UpstreamError, match=r"returned no kv_transfer_params \(is it running as a KV producer\?\)") as caught:
        await client.complete("r3", "chat", "/v1/chat/completions", *typed(dict(CHAT, stream=True)))
    assert caught.value.status == 502 and decode.seen == []
    [failed] = logs.events(events.ROUTER_PREFILL_FAILED)
    assert failed["level"] == "ERROR" and failed["retried"] is False and "no kv_transfer_params" in failed["error"]
    assert all(b.in_flight == 0 for b in client.fleet.scheduler.backends)
