"""Serialisation: the normalised body parses back to the same request, for random valid requests."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from stack.protocol.bounds import Bound, bounds_for
from stack.protocol.parse import parse
from stack.protocol.serialise import to_body
from stack.protocol.types import Kind


def _value(rng: random.Random, bound: Bound) -> Any:
    """A random in-range value for one bounds row, in any of the wire spellings the parser accepts."""
    low = bound.low if bound.low is not None else -1000
    high = bound.high if bound.high is not None else low + 1000
    if bound.value == "int":
        return rng.randint(int(low) + bound.low_open, int(high) - bound.high_open)
    if bound.value == "number":
        whole = math.floor(high)  # an integer spelling (JSON 1 for 1.0), when one is in range
        return whole if rng.random() < 0.3 and bound.check(whole) is None else rng.uniform(low, high)
    if bound.value == "bool":
        return rng.random() < 0.5
    if bound.value == "strings":
        items = [rng.choice("abc") * rng.randint(1, 3) for _ in range(rng.randint(1, bound.max_items or 3))]
        return items[0] if len(items) == 1 and rng.random() < 0.5 else items
    if bound.value == "token_ids":
        return [rng.randint(0, 300) for _ in range(rng.randint(0, 3))]
    return {str(rng.randint(0, 300)): rng.choice([rng.uniform(low, high), rng.randint(int(low), int(high))]) for _ in range(rng.randint(0, 3))}


def _messages(rng: random.Random) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": rng.choice(["system", "developer"]), "content": "be brief"}]
    messages.append({"role": "user", "content": rng.choice(["hi", [{"type": "text", "text": "h"}, {"type": "input_text", "text": "i"}]]),
                     **({"name": "ann"} if rng.random() < 0.3 else {})})
    if rng.random() < 0.5:
        call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
        messages += [{"role": "assistant", "content": rng.choice([None, "calling"]), "tool_calls": [call]},
                     {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    return messages


def _body(rng: random.Random, kind: Kind) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "stream": rng.random() < 0.5}
    if kind == "chat":
        body["messages"] = _messages(rng)
        if rng.random() < 0.5:
            body["tools"] = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
            body["tool_choice"] = rng.choice(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}])
            body["parallel_tool_calls"] = rng.random() < 0.5
    else:
        body["prompt"] = rng.choice(["once upon", [1, 2, 3], ["once"], [[4, 5]]])
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": rng.random() < 0.5}
    for bound in bounds_for(kind):
        if rng.random() < 0.6:
            body[bound.name] = _value(rng, bound)
    if "min_tokens" in body and body.get("max_completion_tokens", body.get("max_tokens")) is not None:
        body["min_tokens"] = min(body["min_tokens"], body.get("max_completion_tokens") or body["max_tokens"])
    if kind == "chat" and body.get("top_logprobs") and not body.get("logprobs"):
        body["logprobs"] = True
    formats = [None, {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "s", "schema": {}, "strict": True}}]
    if fmt := rng.choice(formats):
        body["response_format"] = fmt
    if rng.random() < 0.3:
        body["structured_outputs"] = rng.choice([{"json": {"type": "object"}}, {"regex": "a+"}, {"choice": ["y", "n"]}, {"grammar": "root ::= 'a'"}])
    if rng.random() < 0.3:
        body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": "t1", "decode_kv_addr": "d:9100"}
    return body


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("seed", range(150))
def test_parse_of_serialise_is_identity(kind: Kind, seed: int) -> None:
    """For a random valid request r: parse(to_body(r)) == r, and the normalised body is a fixed point."""
    request = parse(kind, _body(random.Random(seed), kind))
    body = to_body(request)
    assert parse(kind, body) == request
    assert to_body(parse(kind, body)) == body


def test_body_is_normalised() -> None:
    """One spelling per field: max_completion_tokens → max_tokens, a stop string → a list, text parts → a string."""
    request = parse("chat", {"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                             "max_completion_tokens": 5, "max_tokens": 9, "stop": "x", "logprobs": True, "top_p": 1, "user": "u"})
    assert to_body(request) == {"model": "m", "messages": [{"role": "system", "content": "ab"}], "stream": False, "max_tokens": 5,
                                "top_p": 1.0, "stop": ["x"], "logprobs": True, "top_logprobs": 0}
