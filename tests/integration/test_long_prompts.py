"""Agent-sized prompts through PD on the default stack (dummy:small, 64k window; issue 19).

A 14k-token and a 60k-token coding-agent prompt complete through prefill → KV push → decode,
streamed and not; a 10,000-message request the client gives up on stops on the engines, so the
next one-message request answers as if alone; a prompt over the window is a 400 before any compute.

Duration: the cold 60k-token prefill dominates (about 30 TFLOP of causal attention on dummy:small:
minutes on two cores); its streamed twin reuses both engines' prefix caches, so it costs the KV
path, not a second prefill.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from stack.engine.tokenizer import dummy_tokenizer
from tests.integration.compose_stack import Stack, start_stack, unique_project
from tests.unit.engine_core.agent_prompt import long_prompt

pytestmark = pytest.mark.integration

LONG_TIMEOUT_S = 3600  # the cold 60k prefill on a loaded 2-core box; a hang guard, not an expectation


@pytest.fixture(scope="module")
def default_stack(app_image: None) -> Iterator[Stack]:
    """The disaggregated stack on the configs' own checkpoint (dummy:small), as `./pd up` runs it."""
    stack = start_stack(unique_project("pdt-long"), env={"PD_CHECKPOINT": None})
    try:
        yield stack
    finally:
        stack.stop()


def _client(stack: Stack, timeout: float = LONG_TIMEOUT_S) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0, timeout=timeout)


def _ask(stack: Stack, messages: list[dict[str, Any]], stream: bool, request_id: str) -> tuple[str, int]:
    """(answer text, prompt tokens) of one chat request through the router."""
    kwargs: dict[str, Any] = {"model": "your-model-id", "messages": messages, "max_tokens": 8, "seed": 5,
                              "extra_headers": {"X-Request-ID": request_id}}
    if not stream:
        answer = _client(stack).chat.completions.create(**kwargs)
        assert answer.choices[0].finish_reason in ("stop", "length")
        return answer.choices[0].message.content or "", answer.usage.prompt_tokens
    chunks = list(_client(stack).chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    usage = next(c.usage for c in chunks if c.usage)
    assert any(c.choices and c.choices[0].finish_reason in ("stop", "length") for c in chunks)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), usage.prompt_tokens


def _pushed_tokens(stack: Stack, request_id: str) -> int:
    """Tokens of KV the prefill pushed to decode for this request (kv_producer.sent): the request went through PD."""
    sent = [e for e in stack.events("prefill", request_id) if e["event"] == "kv_producer.sent"]
    assert sent, f"no KV push for {request_id}: {[e['event'] for e in stack.events('prefill', request_id)]}"
    return sent[-1]["num_tokens"]


@pytest.mark.parametrize("tokens", [14_000, 60_000], ids=["14k", "60k"])
def test_an_agent_sized_prompt_completes_through_pd_streamed_and_not(default_stack: Stack, tokens: int) -> None:
    """The prompt is counted as a real BPE counts it, prefilled, pushed layer by layer while computed (no fixed
    cut-off on the push), and decoded; the streamed twin (prefix-cached) takes the same path."""
    prompt = long_prompt(tokens, dummy_tokenizer())
    messages = [{"role": "system", "content": prompt}, {"role": "user", "content": "Summarise the tools above."}]
    for stream in (False, True):
        rid = f"long-{tokens}-{'stream' if stream else 'whole'}-{uuid.uuid4().hex[:6]}"
        _, prompt_tokens = _ask(default_stack, messages, stream, rid)
        assert abs(prompt_tokens - tokens) < tokens * 0.02, prompt_tokens  # ~4 characters a token: as built
        assert _pushed_tokens(default_stack, rid) == prompt_tokens


def test_a_prompt_over_the_window_is_refused_before_any_compute(default_stack: Stack) -> None:
    """70k tokens against the 65,536-token window: 400 context_length_exceeded naming both counts, in seconds."""
    prompt = long_prompt(70_000, dummy_tokenizer())
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        _client(default_stack, timeout=120).chat.completions.create(
            model="your-model-id", messages=[{"role": "user", "content": prompt}], max_tokens=8)
    assert refused.value.code == "context_length_exceeded" and "65536" in refused.value.message
    assert time.monotonic() - started < 60  # tokenizing 280 kB is well under a second; a prefill would be minutes


def _lone_request_s(stack: Stack) -> float:
    started = time.monotonic()
    _ask(stack, [{"role": "user", "content": "Say hi."}], False, f"lone-{uuid.uuid4().hex[:6]}")
    return time.monotonic() - started


def test_a_request_given_up_on_stops_so_the_next_one_answers_as_if_alone(default_stack: Stack) -> None:
    """10,000 one-word messages (~30k tokens, inside the window): the client gives up after 10 s, the router closes
    its legs, the prefill stops (between chunks, or between layers of one) and frees its KV without finishing; a
    one-message request then answers about as fast as one alone. Before: it queued behind the whole abandoned prefill
    (61 s, then 504)."""
    alone_s = _lone_request_s(default_stack)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "ok"} for i in range(10_000)]
    rid = f"many-{uuid.uuid4().hex[:6]}"
    with pytest.raises(openai.APITimeoutError):
        _client(default_stack, timeout=10).chat.completions.create(
            model="your-model-id", messages=messages, max_tokens=8, extra_headers={"X-Request-ID": rid})
    assert default_stack.wait_for_event("prefill", "engine.request_abandoned", request_id=rid, timeout_s=120)
    after_s = _lone_request_s(default_stack)
    # Generous: the abandoned prefill may finish the layer of the 2,048-token chunk it is in (seconds on a loaded
    # 2-core box), against the minutes of the whole prefill it used to finish first.
    assert after_s < 3 * alone_s + 45, (alone_s, after_s)
    freed = default_stack.wait_for_event("prefill", "engine.request_cancelled", request_id=rid, timeout_s=60)
    assert freed and not [e for e in default_stack.events("prefill", rid) if e["event"] == "engine.prefill_done"]
