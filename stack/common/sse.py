"""Server-sent events: the one place that writes and reads SSE frames (engine, router, bench).

Writing: `stream = await open_stream(request)`, then `await send_event(stream, data)` for each
frame, and `await send_done(stream)` for OpenAI Chat/Completions streams (Anthropic and Responses
streams end with their own terminal event and no `[DONE]`).

Reading: `async for event, data in read_events(response.content)` yields `(event name or None,
data string)` per frame; the caller decides whether `data` is JSON or `[DONE]`.
`read_event_batches` yields the same frames grouped by network read, for a relay that forwards
what arrived together in one write.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import StreamReader, web


DONE = "[DONE]"


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


_COMPACT = json.JSONEncoder(default=str, separators=(",", ":"), ensure_ascii=False)
_ASCII = json.JSONEncoder(default=str, separators=(",", ":"))


def _dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON; a lone surrogate (a client's \\ud800 echoed back) cannot be UTF-8, so that frame is
    written with ASCII escapes instead of failing. (orjson measured no different here: docs/router-performance.md.)"""
    try:
        return _COMPACT.encode(value).encode()
    except UnicodeEncodeError:
        return _ASCII.encode(value).encode()


def frame(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One SSE frame: optional `event:` line, one `data:` line, blank line."""
    payload = data.encode() if isinstance(data, str) else _dumps(data)
    return b"".join((b"event: ", event.encode(), b"\ndata: ", payload, b"\n\n")) if event else b"data: " + payload + b"\n\n"


async def send_event(stream: web.StreamResponse, data: dict[str, Any] | str, event: str | None = None) -> None:
    await stream.write(frame(data, event))


async def send_done(stream: web.StreamResponse) -> None:
    """Terminate an OpenAI-style stream with `data: [DONE]` and close it."""
    await stream.write(frame(DONE))
    await stream.write_eof()


async def read_events(content: StreamReader) -> AsyncIterator[tuple[str | None, str]]:
    """Parse SSE frames from an aiohttp response body as they arrive (see read_event_batches)."""
    async for batch in read_event_batches(content):
        for item in batch:
            yield item


async def read_event_batches(content: StreamReader) -> AsyncIterator[list[tuple[str | None, str]]]:
    """The frames of an aiohttp response body, as one non-empty list per network read that completed any.

    Comment lines (`:` heartbeats) are skipped; multi-line `data:` fields are joined with `\\n`
    as the SSE spec says. A final frame without its blank line is still yielded.
    Reads whatever bytes have arrived and splits lines itself: one await per network read rather
    than one per line halves the router's per-token relay cost (see benchmarks/router.py).
    """
    event: str | None = None
    data_lines: list[str] = []
    pending = b""  # an incomplete last line (possibly a split UTF-8 sequence) waits for more bytes
    async for block in content.iter_any():
        data = pending + block if pending else block
        complete = data.rfind(b"\n") + 1  # b"\n" never occurs inside a UTF-8 sequence: the complete lines decode at once
        pending = data[complete:]
        batch: list[tuple[str | None, str]] = []
        for line in data[:complete].decode("utf-8").split("\n")[:-1]:
            line = line.rstrip("\r")
            if not line:
                if data_lines:
                    batch.append((event, "\n".join(data_lines)))
                event, data_lines = None, []
            elif line.startswith("data:"):
                data_lines.append(line[5:].removeprefix(" "))
            elif line.startswith(":"):
                continue
            elif line.startswith("event:"):
                event = line[6:].strip()
        if batch:
            yield batch
    line = pending.decode("utf-8").rstrip("\r")
    if line.startswith("data:"):
        data_lines.append(line[5:].removeprefix(" "))
    elif line.startswith("event:"):
        event = line[6:].strip()
    if data_lines:
        yield [(event, "\n".join(data_lines))]
