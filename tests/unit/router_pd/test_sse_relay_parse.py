"""The SSE reader the relay depends on yields the same frames however the bytes are split on the wire."""

from __future__ import annotations


import pytest

from stack.common.sse import read_event_batches, read_events

WIRE = ('event: delta\r\ndata: {"a": "é€"}\r\n\r\n: heartbeat\n\ndata: line one\ndata: line two\n\n'
        'data: {"b": 2}\n\ndata: [DONE]\n\ndata: tail-without-blank-line').encode()
EXPECTED = [("delta", '{"a": "é€"}'), (None, "line one\nline two"), (None, '{"b": 2}'), (None, "[DONE]"), (None, "tail-without-blank-line")]


class Wire:
    """A response body whose bytes arrive in the given network reads."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def readany(self) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""


async def parse(pieces: list[bytes]) -> list[tuple[str | None, str]]:
    return [frame async for frame in read_events(Wire(pieces))]  # type: ignore[arg-type]


async def test_frames_survive_every_split_point():
    """Splitting the byte stream anywhere (inside CRLF, inside a UTF-8 character) changes nothing."""
    assert await parse([WIRE]) == EXPECTED
    for cut in range(1, len(WIRE)):
        assert await parse([WIRE[:cut], WIRE[cut:]]) == EXPECTED, f"split at byte {cut}"
    assert await parse([bytes([b]) for b in WIRE]) == EXPECTED


async def test_a_paced_stream_one_frame_a_read_gives_the_same_frames():
    """A paced engine's reads hold one whole frame each: the same frames, whatever the frame (an event line, CRLF,
    several data lines, a comment, a space kept after `data: `)."""
    ends = [i + 2 for i in range(len(WIRE)) if WIRE[i:i + 2] == b"\n\n"]
    pieces = [WIRE[a:b] for a, b in zip([0, *ends], [*ends, len(WIRE)])]
    assert b"".join(pieces) == WIRE and b'data: {"b": 2}\n\n' in pieces
    assert await parse(pieces) == EXPECTED
    assert await parse([b"data:  two spaces\n\n", b"data: next\n\n"]) == [(None, " two spaces"), (None, "next")]
    assert await parse([b"data: a\r\n\n"]) == [(None, "a")]


async def test_the_relay_reads_data_as_bytes_and_still_refuses_what_is_not_utf8():
    """The batches the relay reads carry each frame's data as the bytes that came (undecoded, so a token chunk can be
    forwarded as it is), and bytes that are not UTF-8 still fail the read, as when every frame was decoded."""
    batches = [batch async for batch in read_event_batches(Wire([WIRE]))]  # type: ignore[arg-type]
    assert [frame for batch in batches for frame in batch] == [(event, data.encode()) for event, data in EXPECTED]
    with pytest.raises(UnicodeDecodeError):
        [batch async for batch in read_event_batches(Wire([b'data: {"a": "\xff"}\n\n']))]  # type: ignore[arg-type]
