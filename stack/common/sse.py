"""Server-sent events: the one place that writes and reads SSE frames (engine, router, bench).

Writing: `stream = await open_stream(request)`, then `await send_event(stream, data)` for each
frame, and `await send_done(stream)` for OpenAI Chat/Completions streams (Anthropic and Responses
streams end with their own terminal event and no `[DONE]`).

Reading: `async for event, data in read_events(response.content)` yields `(event name or None,
data string)` per frame; the caller decides whether `data` is JSON or `[DONE]`.
`read_event_batches` yields the same frames grouped by network read, their data as bytes, for a relay
that forwards what arrived together in one write (and forwards a frame it need not read undecoded).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from aiohttp import StreamReader, web

from stack.common import json_text


DONE = "[DONE]"
DONE_DATA = DONE.encode()  # the same, as read_event_batches yields it


async def open_stream(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Start a 200 `text/event-stream` response; nothing is buffered by proxies in between."""
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            **(headers or {}),
        },
    )
    await response.prepare(request)
    return response


class WriteNow:
    """Writes on an open stream from a plain callback, not a coroutine (pd.DecodeStream.forward_to): where aiohttp's
    own `write` would not wait, which is nearly always. `ready()` first: the client is still there and aiohttp's writer
    would not drain (wait for the client's socket) before this write; then `write(frame)`.

    aiohttp's `StreamWriter.write` is a coroutine that waits only to drain, and to compress (never on an event
    stream: `open_stream` does not enable it). With `drain=False` its one step runs to the end, so it is stepped here
    rather than scheduled; a write declined by `ready()` goes through `await stream.write`, which drains as usual."""

    DRAIN_AFTER = 0x10000  # aiohttp's writer drains once more than this was written since its last drain (its LIMIT)

    def __init__(self, request: web.Request, stream: web.StreamResponse) -> None:
        assert not stream.compression, "an event stream is not compressed"
        self._writer, self._transport = request.writer, request.transport

    def ready(self) -> bool:
        transport = self._transport
        return transport is not None and not transport.is_closing() and self._writer.buffer_size <= self.DRAIN_AFTER

    def write(self, frame: bytes) -> None:
        step = self._writer.write(frame, drain=False)
        try:
            step.send(None)
        except StopIteration:
            return
        step.close()
        raise RuntimeError("aiohttp's stream writer waited in a write that drains nothing")


dumps = json_text.compact  # a frame's data: compact UTF-8 JSON


def frame(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One SSE frame: optional `event:` line, one `data:` line, blank line."""
    payload = data.encode() if isinstance(data, str) else dumps(data)
    return b"".join((b"event: ", event.encode(), b"\ndata: ", payload, b"\n\n")) if event else b"data: " + payload + b"\n\n"


async def send_event(stream: web.StreamResponse, data: dict[str, Any] | str, event: str | None = None) -> None:
    await stream.write(frame(data, event))


async def send_done(stream: web.StreamResponse) -> None:
    """Terminate an OpenAI-style stream with `data: [DONE]` and close it, in one write: a reader that gets [DONE]
    has the body's end with it, so the router can give the connection back to its pool (pd.py)."""
    await stream.write_eof(frame(DONE))


async def read_events(content: StreamReader) -> AsyncIterator[tuple[str | None, str]]:
    """Parse SSE frames from an aiohttp response body as they arrive (see read_event_batches), data as text."""
    async for batch in read_event_batches(content):
        for event, data in batch:
            yield event, data.decode()


async def read_event_batches(content: StreamReader) -> AsyncIterator[list[tuple[str | None, bytes]]]:
    """The frames of an aiohttp response body, as one non-empty list per network read that completed any
    (FrameReader)."""
    reader = FrameReader(content)
    while (batch := await reader.batch()) is not None:
        yield batch


class FrameReader:
    """The frames of a response body as they arrive: `await reader.batch()` is the next non-empty list of frames, those
    of one network read, or None once the body has ended. `content` is anything with aiohttp's `readany()` (b"" at
    the end): aiohttp's StreamReader, or the router's engine_http.Response.

    Each frame is `(event name or None, data bytes)`: the data stays bytes so that a relay can forward a frame it
    does not need to read without decoding it (stack/router/relay.py); it is checked to be UTF-8 all the same.
    Comment lines (`:` heartbeats) are skipped; multi-line `data:` fields are joined with `\\n`
    as the SSE spec says. A final frame without its blank line is still returned.
    Reads whatever bytes have arrived and splits lines itself: one await per network read rather
    than one per line halves the router's per-token relay cost (see benchmarks/router.py). A class rather than an
    async generator: a streamed chunk passes through one coroutine here instead of two generators' frames.
    """

    def __init__(self, content: Any) -> None:
        self._content = content
        self._event: str | None = None
        self._data_lines: list[bytes] = []
        self._pending = b""  # an incomplete last line (possibly a split UTF-8 sequence) waits for more bytes
        self._ended = False

    async def batch(self) -> list[tuple[str | None, bytes]] | None:
        while not self._ended:
            block = await self._content.readany()
            if batch := (self.feed(block) if block else self.end()):
                return batch
        return None

    @property
    def idle(self) -> bool:
        """Between frames: no partial line or frame is held, so the next network read starts a frame."""
        return not self._pending and not self._data_lines and self._event is None

    def feed(self, block: bytes) -> list[tuple[str | None, bytes]]:
        """The frames a network read completed (maybe none), for a caller that reads the body itself."""
        data = self._pending + block if self._pending else block
        complete = data.rfind(b"\n") + 1  # b"\n" never occurs inside a UTF-8 sequence: the complete lines are whole text
        self._pending = data[complete:]
        lines = data[:complete]
        lines.decode("utf-8")  # bytes that are not UTF-8 fail here (UnicodeDecodeError), as when every frame was decoded
        batch: list[tuple[str | None, bytes]] = []
        for line in lines.split(b"\n")[:-1]:
            line = line.rstrip(b"\r")
            if not line:
                if self._data_lines:
                    batch.append((self._event, b"\n".join(self._data_lines)))
                self._event, self._data_lines = None, []
            elif line.startswith(b"data:"):
                self._data_lines.append(line[5:].removeprefix(b" "))
            elif line.startswith(b":"):
                continue
            elif line.startswith(b"event:"):
                self._event = line[6:].decode().strip()
        return batch

    def end(self) -> list[tuple[str | None, bytes]] | None:
        """The body has ended: the frame of a body that ended without its blank line, if any (its last line ended as
        a frame ends); None after that."""
        if self._ended:
            return None
        self._ended = True
        return self.feed(b"\n\n") or None  # feed puts the pending line first
