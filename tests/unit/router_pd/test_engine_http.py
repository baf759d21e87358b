"""The engine legs' HTTP client (stack/router/engine_http.py) against a raw HTTP/1.1 server on loopback: what it
sends, keep-alive, an abandoned answer closing its connection, timeouts, and each failure's type."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from stack.router.engine_http import HIGH_WATER, BadAnswer, ConnectFailed, Disconnected, EngineHTTP, Timeout

Handler = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
TIMEOUT = Timeout(connect_s=2.0, total_s=10.0)


class RawServer:
    """One handler per request; counts connections and records each request's head and body, and when a
    connection's client hung up."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.hung_up = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                await self.handler(head, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.hung_up.set()
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[tuple[RawServer, str]]]]:
    servers: list[RawServer] = []

    async def start(handler: Handler) -> tuple[RawServer, str]:
        server = RawServer(handler)
        servers.append(server)
        return server, await server.start()

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def client() -> AsyncIterator[EngineHTTP]:
    engines = EngineHTTP({"Authorization": "Bearer internal"})
    yield engines
    await engines.close()


def json_answer(body: bytes, status: int = 200) -> bytes:
    return (f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body)


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def answer_ok(_head: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(json_answer(b'{"ok": true}'))
    await writer.drain()


async def test_a_leg_sends_its_headers_and_body_and_reuses_the_connection(serve, client) -> None:
    server, url = await serve(answer_ok)
    for n in range(3):
        response = await client.post(url + "/v1/chat/completions", b'{"n": %d}' % n, {"X-Request-ID": f"r{n}"}, TIMEOUT)
        assert (response.status, await response.read()) == (200, b'{"ok": true}')
        assert response.headers["content-type"] == "application/json"
    assert server.connections == 1  # each answer read to its end put the connection back
    head, body = server.requests[2]
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/chat/completions HTTP/1.1"
    assert f"Host: {url.removeprefix('http://')}" in lines
    assert {"Authorization: Bearer internal", "X-Request-ID: r2", "Content-Length: 8"} <= set(lines)
    assert body == b'{"n": 2}'


async def test_a_chunked_stream_arrives_as_it_is_written(serve, client) -> None:
    release = asyncio.Event()

    async def stream(_head: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + chunk(b"data: 1\n\n"))
        await writer.drain()
        await release.wait()
        writer.write(chunk(b"data: 2\n\n") + b"0\r\n\r\n")
        await writer.drain()

    server, url = await serve(stream)
    response = await client.post(url + "/s", b"{}", {}, TIMEOUT)
    reads = aiter(response.content.iter_any())
    assert await anext(reads) == b"data: 1\n\n"  # before the engine wrote the rest
    release.set()
    assert [data async for data in reads] == [b"data: 2\n\n"]
    response.close()  # ended: the connection stays pooled
    await (await client.post(url + "/s2", b"{}", {}, TIMEOUT)).read()
    assert server.connections == 1


async def test_closing_an_unfinished_answer_closes_the_connection(serve, client) -> None:
    async def endless(_head: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:  # until the client hangs up
            writer.write(chunk(b"data: x\n\n"))
            await writer.drain()
            await asyncio.sleep(0.01)

    server, url = await serve(endless)
    response = await client.post(url + "/s", b"{}", {}, TIMEOUT)
    assert await anext(aiter(response.content.iter_any()))
    response.close()
    await asyncio.wait_for(server.hung_up.wait(), 5)  # the engine sees the disconnect: it stops the request


async def test_a_cancelled_leg_closes_its_connection(serve, client) -> None:
    async def silent(_head: bytes, reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        await reader.read()  # answers nothing; returns when the client hangs up

    server, url = await serve(silent)
    leg = asyncio.create_task(client.post(url + "/s", b"{}", {}, TIMEOUT))
    while not server.requests:
        await asyncio.sleep(0.005)
    leg.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leg
    await asyncio.wait_for(server.hung_up.wait(), 5)


async def test_silence_longer_than_read_s_times_out_and_closes(serve, client) -> None:
    async def stalls(_head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()

    server, url = await serve(stalls)
    response = await client.post(url + "/s", b"{}", {}, Timeout(connect_s=2.0, read_s=0.2))
    reads = aiter(response.content.iter_any())
    assert await anext(reads) == b"data: 1\n\n"
    async with asyncio.timeout(5):  # the test's own bound, far above the leg's
        with pytest.raises(TimeoutError, match="silent for 0.2 s"):
            await anext(reads)
    await asyncio.wait_for(server.hung_up.wait(), 5)


async def test_the_total_deadline_covers_the_body(serve, client) -> None:
    async def trickles(_head: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:  # never silent for long, never done
            writer.write(chunk(b"data: x\n\n"))
            await writer.drain()
            await asyncio.sleep(0.02)

    _server, url = await serve(trickles)
    response = await client.post(url + "/s", b"{}", {}, Timeout(connect_s=2.0, total_s=0.3, read_s=0.2))
    async with asyncio.timeout(5):
        with pytest.raises(TimeoutError, match="did not end within"):
            await response.read()


async def test_a_pooled_connection_the_engine_closed_is_replaced_once(serve, client) -> None:
    async def answer_then_close(_head: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(json_answer(b"{}"))  # keep-alive by HTTP/1.1's default, then closed as an idle engine does
        await writer.drain()
        writer.close()

    server, url = await serve(answer_then_close)
    assert (await client.post(url + "/a", b"{}", {}, TIMEOUT)).status == 200
    await asyncio.wait_for(server.hung_up.wait(), 5)
    response = await client.post(url + "/b", b"{}", {}, TIMEOUT)
    assert (response.status, await response.read()) == (200, b"{}")
    assert server.connections == 2 and len(server.requests) == 2


async def test_a_request_that_meets_an_idle_close_is_sent_again_on_a_fresh_connection(serve, client) -> None:
    served: dict[int, int] = {}

    async def idle_close_race(_head: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served[id(writer)] = served.get(id(writer), 0) + 1
        if served[id(writer)] == 2:  # the engine's idle close crossed the client's next request on the wire
            writer.transport.abort()
            return
        writer.write(json_answer(b"{}"))
        await writer.drain()

    server, url = await serve(idle_close_race)
    assert (await client.post(url + "/a", b"{}", {}, TIMEOUT)).status == 200
    response = await client.post(url + "/b", b"{}", {}, TIMEOUT)
    assert (response.status, await response.read()) == (200, b"{}")
    assert server.connections == 2


async def test_failures_have_their_types(serve, client, unused_tcp_port) -> None:
    with pytest.raises(ConnectFailed, match="cannot connect"):
        await client.post(f"http://127.0.0.1:{unused_tcp_port}/x", b"{}", {}, TIMEOUT)

    async def hang_up(_head: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    _server, url = await serve(hang_up)
    with pytest.raises(Disconnected, match="before answering") as before:
        await client.post(url + "/x", b"{}", {}, TIMEOUT)
    assert before.value.mid_body is False

    async def half(_head: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial")
        await writer.drain()
        writer.transport.abort()

    _server, url = await serve(half)
    response = await client.post(url + "/x", b"{}", {}, TIMEOUT)
    with pytest.raises(Disconnected, match="mid-answer") as mid:
        await response.read()
    assert mid.value.mid_body is True

    async def garbage(_head: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()

    _server, url = await serve(garbage)
    with pytest.raises(BadAnswer):
        await client.post(url + "/x", b"{}", {}, TIMEOUT)


async def test_a_body_larger_than_the_high_water_mark_arrives_whole(serve, client) -> None:
    big = b"x" * (3 * HIGH_WATER + 17)

    async def large(_head: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(json_answer(big))
        await writer.drain()

    _server, url = await serve(large)
    response = await client.post(url + "/x", b"{}", {}, TIMEOUT)
    async with asyncio.timeout(5):  # nobody reads: the client stops reading the socket past the mark
        while not response._connection.paused:
            await asyncio.sleep(0.005)
    assert await response.read() == big


async def test_a_header_value_with_a_line_break_is_refused_before_sending(serve, client) -> None:
    server, url = await serve(answer_ok)
    with pytest.raises(ValueError, match="line break"):
        await client.post(url + "/x", b"{}", {"X-Request-ID": "a\r\nX-Injected: 1"}, TIMEOUT)
    assert server.requests == []


async def test_an_answer_ending_past_the_high_water_mark_leaves_its_connection_reading(serve, client) -> None:
    async def large(_head: bytes, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(json_answer(b"y" * (HIGH_WATER + 100)))  # crosses the mark in the read that ends it
        await writer.drain()

    server, url = await serve(large)
    first = await client.post(url + "/a", b"{}", {}, TIMEOUT)
    async with asyncio.timeout(5):
        while not first._done:  # all of it arrived while nobody read
            await asyncio.sleep(0.005)
        assert len(await first.read()) == HIGH_WATER + 100
        second = await client.post(url + "/b", b"{}", {}, TIMEOUT)  # the pooled connection: it must read again
        assert len(await second.read()) == HIGH_WATER + 100
    assert server.connections == 1


async def test_the_first_bytes_may_take_first_s_then_read_s_bounds_each_silence(serve, client) -> None:
    async def slow_first_chunk(_head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.4)  # the engine's side of the test: longer than read_s, within first_s
        writer.write(chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()  # then silent until the client hangs up

    server, url = await serve(slow_first_chunk)
    response = await client.post(url + "/s", b"{}", {}, Timeout(connect_s=2.0, read_s=0.2, first_s=1.0))
    reads = aiter(response.content.iter_any())
    async with asyncio.timeout(5):
        assert await anext(reads) == b"data: 1\n\n"
        with pytest.raises(TimeoutError, match="silent for 0.2 s"):
            await anext(reads)
        await server.hung_up.wait()
