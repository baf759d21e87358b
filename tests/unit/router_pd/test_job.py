"""The legs' bodies: the hand-off's dict as JSON, every value and key order as the client sent them."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest

from stack.protocol.parse import parse
from stack.router.deadlines import budgets
from stack.router.job import Job
from stack.router.scheduler import SchedulerConfig

TOOL = {"type": "function", "function": {"name": "Read", "description": "Reads a file «verbatim»",
                                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
CHAT = {"model": "m", "messages": [{"role": "system", "content": "You are a coding agent. ✓ \"quoted\" \\ back"},
                                    {"role": "user", "content": "hi"}],
        "tools": [TOOL], "max_tokens": 9, "min_tokens": 2, "temperature": 0.0}
AGENT = CHAT | {"messages": [{"role": "system", "content": "You are a coding agent. ✓ " * 200}, {"role": "user", "content": "hi"}]}


def job(kind: str, body: dict[str, Any], stream: bool) -> Job:
    return Job.make("r1", kind, "/v1/x", parse(kind, body), body, {}, stream, 16, partial(budgets, SchedulerConfig(), window=None))


def read(leg_body: bytes) -> list[tuple[str, Any]]:
    """A leg's body as it reads back: its items in order (a dict compares equal in any order)."""
    return list(json.loads(leg_body).items())


@pytest.mark.parametrize(("kind", "body"), [("chat", CHAT), ("chat", AGENT), ("completion", {"model": "m", "prompt": "once upon ✓", "max_tokens": 3})])
@pytest.mark.parametrize("stream", [False, True])
def test_each_leg_body_is_the_json_of_its_dict(kind: str, body: dict[str, Any], stream: bool) -> None:
    """The prefill leg (one token, not streamed, min_tokens 1, no stream_options) and the decode leg (usage asked for
    on a stream), each with the hand-off's params, read back as those dicts, keys in the same order."""
    params = {"do_remote_decode": True, "transfer_id": "t1"}
    body = body | ({"stream": True, "stream_options": {"include_usage": False}} if stream else {"stream": False})
    leg = job(kind, body | {"kv_transfer_params": {"steer": "me"}}, stream)  # a client's own params never go on
    prefill = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")} | {"stream": False, "max_tokens": 1}
    if "min_tokens" in body:
        prefill["min_tokens"] = 1
    decode = body | ({"stream_options": {"include_usage": True}} if stream else {})

    assert read(leg.prefill_body(params)) == list((prefill | {"kv_transfer_params": params}).items())
    assert read(leg.decode_body(None)) == list(decode.items())
    assert json.loads(leg.decode_body(params))["kv_transfer_params"] == params


def test_the_legs_carry_the_clients_values_exactly() -> None:
    """What a JSON round trip could bend reaches the engines as sent: an integer past 64 bits in a tool schema, a
    float's shortest digits, text beyond ASCII and outside the BMP (as UTF-8), quotes and backslashes."""
    tool = {"type": "function", "function": {"name": "Pick", "description": "«any» 🚀 \"q\" \\ end",
                                             "parameters": {"type": "integer", "maximum": 2**70, "multipleOf": 0.1}}}
    body = CHAT | {"tools": [tool]}
    leg = job("chat", body, stream=False)
    for sent in (leg.prefill_body(None), leg.decode_body(None)):
        sent.decode("utf-8")  # UTF-8 throughout
        assert json.loads(sent)["tools"] == [tool] and "🚀".encode() in sent
