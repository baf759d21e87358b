"""SSE frames (the relay's per-chunk encoding): the same compact JSON as before, and no value a client can send breaks one."""

from __future__ import annotations

import json

from stack.common import sse


def test_a_frame_is_compact_utf8_json_as_json_dumps_wrote_it() -> None:
    """A frame is byte for byte json.dumps(separators=(",", ":"), ensure_ascii=False), event line included."""
    chunk = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "héllo \u2028 世界"}, "logprob": -0.25}],
             "usage": None, "model": "m"}
    expected = json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()
    assert sse.frame(chunk) == b"data: " + expected + b"\n\n"
    assert sse.frame(chunk, event="message_delta") == b"event: message_delta\ndata: " + expected + b"\n\n"
    assert sse.frame(sse.DONE) == b"data: [DONE]\n\n"


def test_values_utf8_cannot_carry_still_make_a_valid_frame() -> None:
    """A lone surrogate (a client's \\ud800 echoed back) or an integer past 64 bits is escaped, not an exception."""
    raw = sse.frame({"text": "\ud800", "seed": 2**70})
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert json.loads(raw[6:].decode()) == {"text": "\ud800", "seed": 2**70}

