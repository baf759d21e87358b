"""The legs' bodies: what `json.dumps` of the hand-off's dict writes, byte for byte, with the bulk encoded once."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest

from stack.common import json_text
from stack.protocol.parse import parse
from stack.router.deadlines import budgets
from stack.router.job import Job
from stack.router.scheduler import SchedulerConfig

TOOL = {"type": "function", "function": {"name": "Read", "description": "Reads a file «verbatim»",
                                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
CHAT = {"model": "m", "messages": [{"role": "system", "content": "You are a coding agent. ✓ \"quoted\" \\ back"},
                                    {"role": "user", "content": "hi"}],
        "tools": [TOOL], "max_tokens": 9, "min_tokens": 2, "temperature": 0.0}
AGENT = CHAT | {"messages": [{"role": "system", "content": "You are a coding agent. ✓ " * 200}, {"role": "user", "content": "hi"}]}  # spliced


def job(kind: str, body: dict[str, Any], stream: bool) -> Job:
    return Job.make("r1", kind, "/v1/x", parse(kind, body), body, {}, stream, 16, partial(budgets, SchedulerConfig(), window=None))


@pytest.mark.parametrize(("kind", "body"), [("chat", CHAT), ("chat", AGENT), ("completion", {"model": "m", "prompt": "once upon ✓", "max_tokens": 3})])
@pytest.mark.parametrize("stream", [False, True])
def test_each_leg_body_is_the_json_of_its_dict(kind: str, body: dict[str, Any], stream: bool) -> None:
    """The prefill leg (one token, not streamed, min_tokens 1, no stream_options) and the decode leg (usage asked for
    on a stream), each with the hand-off's params, as json.dumps writes them (ASCII escapes, ", " and ": ")."""
    params = {"do_remote_decode": True, "transfer_id": "t1"}
    body = body | ({"stream": True, "stream_options": {"include_usage": False}} if stream else {"stream": False})
    leg = job(kind, body | {"kv_transfer_params": {"steer": "me"}}, stream)  # a client's own params never go on
    prefill = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")} | {"stream": False, "max_tokens": 1}
    if "min_tokens" in body:
        prefill["min_tokens"] = 1
    decode = body | ({"stream_options": {"include_usage": True}} if stream else {})

    assert leg.prefill_body(params) == json.dumps(prefill | {"kv_transfer_params": params}).encode()
    assert leg.decode_body(None) == json.dumps(decode).encode()
    assert json.loads(leg.decode_body(params))["kv_transfer_params"] == params


def test_the_bulk_is_encoded_once_for_every_leg_and_retry(monkeypatch) -> None:
    encoded: list[Any] = []
    dumps = json_text.dumps
    monkeypatch.setattr(json_text, "dumps", lambda value: encoded.append(value) or dumps(value))
    leg = job("chat", AGENT, stream=False)
    for _ in range(3):  # prefill, decode, and one retry's prefill
        leg.prefill_body(None), leg.decode_body(None)
    assert sum(value is AGENT["messages"] for value in encoded) == 1 and sum(value is AGENT["tools"] for value in encoded) == 1


def test_a_short_request_is_encoded_whole_a_leg() -> None:
    """Splicing pays only for a large body: a one-line request's legs are one encoding each, nothing kept."""
    leg = job("chat", CHAT, stream=False)
    assert leg.shared_json == {}
    assert job("chat", AGENT, stream=False).shared_json.keys() == {"messages", "tools"}
