"""The bounds table and the capability check: limits read right, refusals name the field, no-ops are dropped."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from stack.common.errors import InvalidRequest
from stack.protocol.bounds import BOUNDS, Bound
from stack.protocol.capabilities import CPU_ENGINE, Capabilities, fit
from stack.protocol.parse import parse
from stack.protocol.types import Sampling

# Wire names that land in a differently named Sampling field.
RENAMED = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}


def test_every_bounds_row_lands_in_a_sampling_field() -> None:
    """Each row is read into Sampling (directly or renamed), and every Sampling field has a row."""
    names = {RENAMED.get(b.name, b.name) for b in BOUNDS}
    assert names == {f.name for f in fields(Sampling)}


@pytest.mark.parametrize(("bound", "x", "problem"), [
    (Bound("a", "number", low=0, high=2), 2, None),
    (Bound("a", "number", low=0, high=2), 2.01, "must be between 0 and 2, got 2.01."),
    (Bound("a", "number", low=0, high=1, low_open=True), 0, "must be in (0, 1], got 0."),
    (Bound("a", "number", low=0, high=1, high_open=True), 1, "must be in [0, 1), got 1."),
    (Bound("a", "int", low=1), 0, "must be >= 1, got 0."),
    (Bound("a", "number", low=0, low_open=True), 0, "must be > 0, got 0."),
    (Bound("a", "int", high=5), 6, "must be <= 5, got 6."),
])
def test_bound_check_says_what_is_wrong(bound: Bound, x: float, problem: str | None) -> None:
    """In range is None; out of range is a message with the interval, open ends in OpenAI/maths notation."""
    assert bound.check(x) == problem


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


CPU_REFUSALS = [
    (chat(n=2), "n", "must be 1"),
    (chat(logprobs=True), "logprobs", "is not supported"),
    (chat(logit_bias={"1": 2}), "logit_bias", "is not supported"),
    (chat(presence_penalty=0.5), "presence_penalty", "(only 0)"),
    (chat(repetition_penalty=1.2), "repetition_penalty", "(only 1)"),
    (chat(top_k=5), "top_k", "(only 0 or -1"),
    (chat(min_p=0.1), "min_p", "(only 0)"),
    (chat(min_tokens=1), "min_tokens", "(only 0)"),
    (chat(stop_token_ids=[2]), "stop_token_ids", "use 'stop' strings"),
    (chat(tool_choice="required"), "tool_choice", "never calls tools"),
    (chat(response_format={"type": "json_object"}), "response_format", "other than"),
    (chat(structured_outputs={"regex": "a"}), "structured_outputs", "is not supported"),
    (chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), "messages[0].role", "no tool calling"),
    (chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]}]),
     "messages[0].tool_calls", "no tool calling"),
]


@pytest.mark.parametrize(("body", "param", "words"), CPU_REFUSALS, ids=[r[1] for r in CPU_REFUSALS])
def test_cpu_engine_refuses_what_it_cannot_honour(body: dict[str, Any], param: str, words: str) -> None:
    """Each capability the CPU engine lacks is a 400 unsupported_parameter naming the field."""
    with pytest.raises(InvalidRequest) as info:
        fit(parse("chat", body), CPU_ENGINE)
    assert (info.value.param, info.value.code) == (param, "unsupported_parameter") and words in info.value.message


def test_off_values_need_no_capability_and_tools_are_dropped() -> None:
    """n=1, penalties 0, top_k 0/-1, text format… pass; tool definitions with auto/none are dropped (they have no effect)."""
    body = chat(n=1, presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1, top_k=-1, min_p=0, min_tokens=0, logit_bias={},
                stop_token_ids=[], logprobs=False, response_format={"type": "text"}, tool_choice="auto", parallel_tool_calls=True,
                tools=[{"type": "function", "function": {"name": "f"}}])
    fitted = fit(parse("chat", body), CPU_ENGINE)
    assert fitted.tools == () and fitted.tool_choice is None and fitted.parallel_tool_calls is None
    assert fitted.sampling == parse("chat", body).sampling


def test_a_capable_backend_keeps_what_the_cpu_engine_refuses() -> None:
    """With the flags set (as issue 10's vLLM backends will have), the same request passes unchanged."""
    everything = Capabilities(**{f.name: True for f in fields(Capabilities)})
    req = parse("chat", chat(n=2, logprobs=True, top_k=5, tool_choice="required", tools=[{"function": {"name": "f"}}],
                             structured_outputs={"regex": "a"}))
    assert fit(req, everything) == req
