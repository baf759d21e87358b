"""What real vLLM's PD showed the router, replayed from captured answers (tests/unit/router_pd/fixtures/, each file's
"source" says how it was captured from vLLM 0.32.0 CPU with NixlConnector; tests/vllm/ runs the real thing):

- the prefill's kv_transfer_params (14 keys) reach decode whole;
- EOS at prefill: the one token is `</s>`, finish_reason "stop", and vLLM STILL hands on kv_transfer_params (it keeps
  FINISHED_STOPPED blocks for a remote decode): the prefill's answer is the answer; a decode leg would continue
  past the end;
- cached_tokens: the client sees the prefill's prefix-cache hits, not decode's view;
- a decode leg is never sent once the prefill's KV lease ran out (vLLM would read freed blocks and answer 200).
"""

from __future__ import annotations

import copy
import itertools

import pytest

from stack.common import events
from stack.common.errors import UpstreamError
from stack.router.pd import answer_chunks
from tests.unit.router_pd.fake_engine import vllm_capture
from tests.unit.router_pd.conftest import batches, typed

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Explain the key value cache in one sentence"}], "max_tokens": 6}
PREFILL = vllm_capture("vllm_nixl_prefill")
EOS = vllm_capture("vllm_nixl_prefill_eos")
CACHED = vllm_capture("vllm_nixl_cached")


async def collect(client, body=CHAT, request_id="r1"):
    return [chunk async for batch in batches(client, request_id, "chat", "/v1/chat/completions", *typed({**body, "stream": True})) for chunk in batch]


async def test_the_real_prefill_answer_reaches_decode_whole(fake, pd):
    prefill = await fake("prefill", prefill_answer=PREFILL["answer"])
    decode = await fake("decode", kv_port=None, decode_answer=PREFILL["decode_answer"])
    client = await pd([prefill], [decode], kv_connector="nixl")
    answer = await client.complete("r1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    await collect(client)
    sent = PREFILL["answer"]["kv_transfer_params"]
    assert len(sent) == 14
    assert [leg["kv_transfer_params"] for leg in decode.seen] == [sent, sent]
    assert answer["choices"][0]["message"]["content"] == PREFILL["decode_answer"]["choices"][0]["message"]["content"]
    assert "kv_transfer_params" not in answer


async def test_eos_at_prefill_is_the_finished_answer(fake, pd, logs):
    """Non-streamed and streamed: the prefill's answer comes back (finish_reason stop, 1 token); decode is never sent."""
    prefill = await fake("prefill", prefill_answer=EOS["answer"])
    decode = await fake("decode", kv_port=None)
    client = await pd([prefill], [decode], kv_connector="nixl")
    answer = await client.complete("r1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == 1
    assert "kv_transfer_params" not in answer
    chunks = await collect(client, request_id="r2")
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == EOS["answer"]["usage"]
    assert decode.seen == []
    finished = logs.events(events.ROUTER_PREFILL_FINISHED)
    assert [line["finish_reason"] for line in finished] == ["stop", "stop"]
    assert not logs.events(events.ROUTER_KV_HANDOFF)
    assert all(b.outstanding_tokens == 0 for b in client.fleet.scheduler.backends)  # the decode slot was given back


def test_answer_chunks_of_a_text_completion():
    answer = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
    chunks = answer_chunks(answer)
    assert chunks[0]["object"] == "text_completion" and chunks[0]["choices"][0] == {"index": 0, "logprobs": None, "finish_reason": "stop", "text": ""}
    assert chunks[1] == {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [], "usage": answer["usage"]}


async def test_cached_tokens_are_the_prefills_view(fake, pd):
    """The second of two identical 365-token prompts: the prefill found 256 tokens cached. A decode that counts its
    own view (every token came from the prefill; vLLM before remote_prefill_cached_tokens) must not be what the client
    sees, streamed or not."""
    second = CACHED["second"]
    assert second["prefill"]["kv_transfer_params"]["remote_prefill_cached_tokens"] == 256
    decode_view = copy.deepcopy(second["decode"])
    decode_view["usage"]["prompt_tokens_details"]["cached_tokens"] = 365
    prefill = await fake("prefill", prefill_answer=second["prefill"])
    decode = await fake("decode", kv_port=None, decode_answer=decode_view)
    client = await pd([prefill], [decode], kv_connector="nixl")
    answer = await client.complete("r1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    chunks = await collect(client, {**CHAT, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 256


async def test_cached_tokens_from_the_prefill_usage_without_the_key(fake, pd):
    """vLLM before remote_prefill_cached_tokens: the prefill answer's own usage says what it found cached."""
    prefill_answer = copy.deepcopy(CACHED["second"]["prefill"])
    del prefill_answer["kv_transfer_params"]["remote_prefill_cached_tokens"]
    prefill = await fake("prefill", prefill_answer=prefill_answer)
    decode = await fake("decode", kv_port=None, decode_answer=CACHED["first"]["decode"])
    client = await pd([prefill], [decode], kv_connector="nixl")
    answer = await client.complete("r1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 256


async def test_decode_leg_is_never_sent_after_the_kv_lease(fake, pd, logs):
    """Every clock reading is 31 s after the last one, so each prefill's 30 s lease has run out before its decode leg
    could go: the router re-picks the pair (the other decode, a fresh prefill) and finally names the error; no decode
    ever sees a leg."""
    ticks = itertools.count(step=31.0)
    prefill = await fake("prefill", prefill_answer=PREFILL["answer"])
    decodes = [await fake("decode", kv_port=None), await fake("decode", kv_port=None)]
    client = await pd([prefill], decodes, kv_connector="nixl", max_retries=1, clock=lambda: next(ticks))
    with pytest.raises(UpstreamError, match="KV blocks expired") as caught:
        await client.complete("r1", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert caught.value.code == "kv_expired"
    assert decodes[0].seen == decodes[1].seen == [] and len(prefill.seen) == 2
    expired = logs.events(events.ROUTER_KV_EXPIRED)
    assert len(expired) == 2 and all(line["lease_ms"] == 30000 and line["waited_ms"] >= 30000 for line in expired)
