"""The shared SSE framing, JSON log lines with redaction, and gRPC health."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

from aiohttp import web

from stack.common import events
from stack.common import health_probe
from stack.common.health import NOT_SERVING, SERVING, TIMEOUT, UNREACHABLE, probe_async, start_health_server
from stack.common.health_probe import probe
from stack.common.logging import log_event, register_secret, request_context, setup_logging
from stack.common.sse import DONE, open_stream, read_events, send_done, send_event


async def test_sse_round_trip(aiohttp_client) -> None:
    """Frames written by the one SSE helper parse back to the same events, ending with [DONE]."""

    async def handler(request: web.Request) -> web.StreamResponse:
        stream = await open_stream(request)
        await send_event(stream, {"choices": [{"delta": {"content": "ä\nb"}}]})
        await send_event(stream, {"type": "message_stop"}, event="message_stop")
        await send_done(stream)
        return stream

    app = web.Application()
    app.router.add_get("/s", handler)
    client = await aiohttp_client(app)
    response = await client.get("/s")
    assert response.headers["Content-Type"].startswith("text/event-stream")
    frames = [frame async for frame in read_events(response.content)]
    assert frames == [
        (None, '{"choices":[{"delta":{"content":"ä\\nb"}}]}'),
        ("message_stop", '{"type":"message_stop"}'),
        (None, DONE),
    ]


def test_log_lines_are_flat_json_with_request_id_and_no_secrets() -> None:
    """A log_event line is one flat JSON object carrying service, event, request_id; keys are redacted."""
    sink = io.StringIO()
    setup_logging("router", sink=sink)
    register_secret("pd-test-secret-value")
    with request_context(request_id="req-1"):
        log_event(events.AUTH_REJECTED, "got pd-test-secret-value from Bearer abc.def", reason="unknown", header="Bearer sk-abcdef123456")
    line = json.loads(sink.getvalue().strip())
    assert line["service"] == "router"
    assert line["event"] == "auth.rejected"
    assert line["request_id"] == "req-1"
    assert line["reason"] == "unknown"
    assert "pd-test-secret-value" not in sink.getvalue() and "abc.def" not in sink.getvalue()
    assert "sk-abcdef123456" not in sink.getvalue()
    assert line["msg"] == "got [REDACTED] from Bearer [REDACTED]"


def test_stdlib_and_exception_lines_share_the_shape_and_levels_filter_both_paths() -> None:
    """aiohttp/asyncio (stdlib) lines and logged exceptions come out as the same flat JSON with the request id;
    below the configured level, neither log_event nor stdlib lines are written."""
    sink = io.StringIO()
    setup_logging("router", level="WARNING", sink=sink)
    with request_context("req-9"):
        logging.getLogger("aiohttp.server").error("Error handling request from %s", "10.0.0.1")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("asyncio").exception("Task exception was never retrieved")
        log_event(events.AUTH_ACCEPTED, "dropped: below WARNING", "DEBUG", key_name="default", header="authorization")
        log_event(events.SERVICE_STOPPING, "dropped: below WARNING")
        logging.getLogger("grpc").info("dropped: below WARNING")
    lines = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert [(line["level"], line["event"], line["request_id"], line["service"]) for line in lines] == [
        ("ERROR", "log", "req-9", "router"), ("ERROR", "log", "req-9", "router")]
    assert lines[0]["msg"] == "Error handling request from 10.0.0.1" and lines[0]["logger"] == "aiohttp.server"
    assert lines[1]["exc"] == "RuntimeError: boom"
    assert all(line["ts"].endswith("Z") for line in lines)


def test_a_line_is_the_bytes_json_dumps_gave_for_the_whole_line() -> None:
    """The writer quotes a line's own keys and encodes only the fields, yet writes exactly what one json.dumps of the
    whole line (its keys in order, UTF-8 kept) wrote; its time is the clock's, to the millisecond."""
    sink = io.StringIO()
    at = datetime(2026, 11, 29, 20, 31, 55, 123999, tzinfo=timezone.utc)
    setup_logging("rou\"ter", sink=sink, clock=lambda: at)
    with request_context('req "1" é', client_request_id="client\n2"):
        log_event(events.ROUTER_SCHEDULED, 'prefill → decode "d"', prefill="http://p:1", decode="http://d:2", policy="load",
                  mode="disaggregated", attempt=1, prefill_attempt=2, queue_ms=0.25)
    log_event(events.SERVICE_STOPPING, "no fields, no client id")
    expected = [
        {"ts": "2026-11-29T20:31:55.123Z", "level": "INFO", "service": 'rou"ter', "event": "router.scheduled", "request_id": 'req "1" é',
         "msg": 'prefill → decode "d"', "prefill": "http://p:1", "decode": "http://d:2", "policy": "load", "mode": "disaggregated",
         "attempt": 1, "prefill_attempt": 2, "queue_ms": 0.25, "client_request_id": "client\n2"},
        {"ts": "2026-11-29T20:31:55.123Z", "level": "INFO", "service": 'rou"ter', "event": "service.stopping", "request_id": "-",
         "msg": "no fields, no client id"},
    ]
    assert sink.getvalue() == "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in expected)


def test_the_default_clock_writes_utc_to_the_millisecond() -> None:
    """Without a given clock, `ts` is now in UTC as `YYYY-MM-DDTHH:MM:SS.mmmZ`, within the calls' bounds."""
    sink = io.StringIO()
    setup_logging("router", sink=sink)
    before = datetime.now(timezone.utc)
    log_event(events.SERVICE_STOPPING, "now")
    after = datetime.now(timezone.utc)
    ts = json.loads(sink.getvalue())["ts"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", ts), ts
    assert before - timedelta(milliseconds=1) <= datetime.fromisoformat(ts.replace("Z", "+00:00")) <= after  # ts is cut to the ms


class _FlushCountingSink(io.StringIO):
    flushes = 0

    def flush(self) -> None:
        self.flushes += 1


async def test_lines_of_one_loop_step_leave_in_one_flush() -> None:
    """On the event loop, the lines written in one step are flushed once, at the end of that step (not one
    syscall per line); outside a loop every line is flushed at once."""
    sink = _FlushCountingSink()
    setup_logging("router", sink=sink)
    for i in range(3):
        log_event(events.SERVICE_STOPPING, f"line {i}")
    assert sink.flushes == 0 and len(sink.getvalue().splitlines()) == 3
    await asyncio.sleep(0)
    assert sink.flushes == 1
    await asyncio.to_thread(log_event, events.SERVICE_STOPPING, "from a worker thread")
    assert sink.flushes == 2
    log_event(events.SERVICE_STOPPING, "on the loop: its flush is pending")
    worker = threading.Thread(target=log_event, args=(events.SERVICE_STOPPING, "a thread does not wait for the loop's flush"))
    worker.start()
    worker.join()  # the loop is held meanwhile: only the thread itself can have flushed
    assert sink.flushes == 3 and len(sink.getvalue().splitlines()) == 6


_UNBUFFERED_SERVICE = """
import asyncio, os
from stack.common import events
from stack.common.logging import log_event, setup_logging
setup_logging("router")
log_event(events.SERVICE_STOPPING, "off the loop")
async def main():
    for i in range(3):
        log_event(events.SERVICE_STOPPING, f"step {i}")
    os.write(1, b"MARK\\n")  # straight to the descriptor, during the step
    await asyncio.sleep(0)
    log_event(events.SERVICE_STOPPING, "the last line, flushed before exit")
asyncio.run(main())
"""


def test_stdout_lines_leave_once_a_step_under_pythonunbuffered() -> None:
    """The image sets PYTHONUNBUFFERED, which makes sys.stdout write each line through (one syscall a line, to the
    container's log pipe). A service's log lines still leave once a step: the lines of a step arrive after a byte
    written straight to the descriptor during that step; a line off the loop leaves at once; none is lost at exit."""
    done = subprocess.run([sys.executable, "-c", _UNBUFFERED_SERVICE], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[3], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr
    out = [line if line == "MARK" else json.loads(line)["msg"] for line in done.stdout.splitlines()]
    assert out == ["off the loop", "MARK", "step 0", "step 1", "step 2", "the last line, flushed before exit"]


async def test_health_not_serving_until_set() -> None:
    """A fresh health server says NOT_SERVING; after set_serving it says SERVING; a dead port is UNREACHABLE."""
    health = await start_health_server(0, "127.0.0.1")
    try:
        assert await probe_async(f"127.0.0.1:{health.port}") == NOT_SERVING
        await health.set_serving()
        assert await probe_async(f"127.0.0.1:{health.port}") == SERVING
    finally:
        await health.stop()
    assert probe("127.0.0.1:1", timeout=0.5) == UNREACHABLE


async def test_health_probe_tells_a_timeout_from_a_refusal(silent_address) -> None:
    """A listener that never answers is TIMEOUT (maybe just busy), not UNREACHABLE (nothing there): the router
    treats the two differently. The stdlib probe says the same."""
    assert await probe_async(silent_address, 0.3) == TIMEOUT
    assert await probe_async("127.0.0.1:1", 0.3) == UNREACHABLE
    assert await asyncio.to_thread(probe, silent_address, 0.3) == TIMEOUT


async def test_stdlib_probe_agrees_with_grpcio_and_exits_0_only_when_serving(capsys) -> None:
    """The compose health check (HTTP/2 by hand, no grpcio) reads a real grpcio health server as grpcio does: cold,
    warm, and gone; its exit code is 0 only for SERVING."""
    health = await start_health_server(0, "127.0.0.1")
    address = f"127.0.0.1:{health.port}"
    try:
        assert await asyncio.to_thread(probe, address) == await probe_async(address) == NOT_SERVING
        assert await asyncio.to_thread(health_probe.main, [address]) == 1
        await health.set_serving()
        assert await asyncio.to_thread(probe, address) == await probe_async(address) == SERVING
        assert await asyncio.to_thread(health_probe.main, [address]) == 0
    finally:
        await health.stop()
    assert probe(address, 0.5) == UNREACHABLE
    assert capsys.readouterr().out.split() == [NOT_SERVING, SERVING]
