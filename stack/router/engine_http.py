"""The router's HTTP/1.1 client for its engine legs: keep-alive connections per engine, httptools' parser.

A leg (upstream.py) is one POST to an engine the router already knows, answered by JSON or by an SSE stream.
aiohttp's ClientSession, which the router keeps for health checks, KV discovery and /tokenize, does far more per
call than a leg needs (a URL parsed, header multidicts merged, tracing hooks, a cookie jar, timer contexts,
auto-decompression), and in a profile under load its client legs were the router's largest share of CPU
(docs/router-performance.md). Here a leg is one header block joined from strings, one write, and httptools
parsing the answer: MagicStack's binding of llhttp, the parser of Node.js, which uvicorn also uses; it decodes
chunked bodies in C.

What it keeps of what the legs relied on:
- **Timeouts** (`Timeout`): connect, a total deadline for the whole exchange (body included), and the longest
  silence while the answer is awaited (`read_s`; not counted while the reader itself is behind), and a longer one
  allowed before the body's first bytes (`first_s`: a stream's first chunk waits for the prompt's KV).
- **Abandoned work stops**: an answer not read to its end is never pooled: `Response.close()` (or a cancelled,
  failed or timed-out call) closes the connection, so the engine sees the disconnect and cancels the request.
- **Keep-alive**: an answer read to its end gives its connection back to its engine's idle list, dropped after
  `keepalive_s` idle (or when the engine closes it). A request on a reused connection that the engine had closed
  meanwhile (it answered nothing) is sent again once on a fresh connection, as HTTP clients do for stale pools.
- **Typed failures** that upstream.exception_failure maps: `ConnectFailed` (nothing listens: the engine is down),
  `Disconnected` (closed or reset before the answer's end; `mid_body` after the status line), `BadAnswer`
  (not HTTP the parser accepts), `TimeoutError`.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

# Bytes held unread before the engine's socket stops being read: a slow client slows its own stream only.
HIGH_WATER = 1 << 20


class ConnectFailed(ConnectionError):
    """No connection to the engine: refused, unresolvable or unreachable."""


class Disconnected(ConnectionError):
    """The engine closed or reset the connection before its answer's end."""

    def __init__(self, message: str, *, mid_body: bool) -> None:
        super().__init__(message)
        self.mid_body = mid_body  # after the status line: the engine stopped a stream, it is not necessarily gone


class BadAnswer(ValueError):
    """Bytes that are not an HTTP/1.1 answer."""


@dataclass(frozen=True)
class Timeout:
    connect_s: float
    total_s: float | None = None  # the whole exchange, body included
    read_s: float | None = None  # the longest silence from the engine while its answer is awaited
    first_s: float | None = None  # the longest before the body's first bytes, when longer than read_s


@dataclass(frozen=True)
class _Origin:
    key: tuple[str, int, bool]  # host, port, TLS
    host_header: bytes  # "Host: …\r\n" and the client's fixed headers


class Response:
    """An engine's answer: status and headers once `EngineHTTP.post` returns, the body as it arrives.

    `content.readany()` answers whatever bytes have arrived at each wake-up, b"" at the end, and `iter_any()` yields
    them (aiohttp's StreamReader shape, which sse.FrameReader reads); `read()` the whole body.

    `forward`, when a relay sets it, is offered each network read that arrives while the reader waits with nothing
    unread: True means it sent the bytes on itself, there and then, and the reader is not woken for them (a streamed
    token goes from this connection's read to the client's socket without a task step; pd.DecodeStream.forward_to).
    Anything it declines is queued for `readany` as usual, so order is kept: nothing is offered while bytes wait."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.status = 0
        self.headers: dict[str, str] = {}
        self.content = self
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = False  # the body's end arrived
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.forward: Callable[[bytes], bool] | None = None

    # --- fed by the connection ---
    def _feed(self, data: bytes) -> None:
        if self.forward is not None and not self._chunks and self._waiter is not None and not self._waiter.done() \
                and self.forward(data):
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._connection.pause()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if not self._done and self._error is None:
            self._done, self._error = error is None, error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # --- read by the leg ---
    async def readany(self) -> bytes:
        """Whatever bytes have arrived, waiting for some; b"" once the body has ended."""
        while not self._chunks and not self._done and self._error is None:
            self._waiter = self._connection.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._chunks:
            data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
            self._chunks.clear()
            self._buffered = 0
            if not self._done:  # an ended answer's connection is already back in its pool, maybe serving another
                self._connection.resume()
            return data
        if self._error is not None:
            raise self._error
        return b""

    async def iter_any(self) -> AsyncIterator[bytes]:
        while data := await self.readany():
            yield data

    async def read(self) -> bytes:
        parts = [data async for data in self.iter_any()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def text(self) -> str:
        return (await self.read()).decode("utf-8", "replace")

    def close(self) -> None:
        """Done with this answer: a connection whose answer ended is already back in its pool; any other is closed
        (the engine sees the disconnect and stops)."""
        self.forward = None
        if not self._done:
            self._connection.drop()
            self._finish(Disconnected("the answer was closed before its end", mid_body=True))

    release = close  # aiohttp's name for the same


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine, one exchange at a time; httptools calls the on_* methods."""

    def __init__(self, client: EngineHTTP, origin: _Origin) -> None:
        self.client, self.origin = client, origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.headers_ready: asyncio.Future[None] | None = None
        self.got_bytes = False  # the current exchange has heard anything from the engine
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        # Timeouts of the current exchange: one timer re-armed only when it fires (not once per read).
        self.deadline: float | None = None
        self.read_s: float | None = None
        self.first_s: float | None = None
        self.body_started = False
        self.last_heard = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a leg's head and body go as they are written

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_heard = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(BadAnswer("the engine answered with a protocol upgrade"))
        except httptools.HttpParserError as exc:
            self._fail(BadAnswer(f"the engine's answer is not HTTP/1.1: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client._forget(self)
        if self.response is None or self.headers_ready is None:
            return  # idle, or its exchange already ended
        mid_body = self.headers_ready.done()
        if mid_body and exc is None and self._ends_at_close():
            self.on_message_complete()  # a body without length or chunks ends when the connection does
            return
        what = f"reset ({exc})" if exc else "closed"
        self._fail(Disconnected(f"the engine {what} the connection {'mid-answer' if mid_body else 'before answering'}",
                                mid_body=mid_body))

    def _ends_at_close(self) -> bool:
        headers = self.response.headers if self.response is not None else {}
        return "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "").lower()

    # --- httptools callbacks ---
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.response is not None and self.headers_ready is not None and not self.headers_ready.done():
            self.response.status = self.parser.get_status_code()
            self.headers_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        if not self.body_started:  # from now on the silence limit is read_s
            self.body_started = True
            if self.first_s and self.timer is not None:
                self.timer.cancel()
                self._arm()
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        response, keep = self.response, self.parser.should_keep_alive()
        self._end_exchange()
        if response is not None:
            response._finish()
        if keep and not self.closed:
            self.client._give_back(self)
        else:
            self.drop()

    # --- the exchange ---
    def send(self, head: bytes, body: bytes, timeout: Timeout) -> Response:
        assert self.transport is not None and self.response is None, "one exchange at a time"
        self.response = Response(self)
        self.headers_ready = self.loop.create_future()
        self.got_bytes = False
        now = self.loop.time()
        self.deadline = now + timeout.total_s if timeout.total_s else None
        self.read_s, self.first_s, self.body_started, self.last_heard = timeout.read_s, timeout.first_s, False, now
        self._arm()
        self.transport.writelines((head, body))
        return self.response

    def _silence_s(self) -> float | None:
        return self.first_s if self.first_s and not self.body_started else self.read_s

    def _arm(self) -> None:
        silence = self._silence_s()
        due = min((t for t in (self.deadline, self.last_heard + silence if silence else None) if t is not None), default=None)
        self.timer = self.loop.call_at(due, self._check_time) if due is not None else None

    def _check_time(self) -> None:
        now, silence = self.loop.time(), self._silence_s()
        if self.deadline is not None and now >= self.deadline:
            self._fail(TimeoutError("the engine's answer did not end within the leg's time"))
        elif silence and not self.paused and now - self.last_heard >= silence:
            self._fail(TimeoutError(f"the engine was silent for {silence:g} s"))
        else:
            if self.paused:  # the reader is behind, not the engine: its silence does not count
                self.last_heard = now
            self._arm()

    def _end_exchange(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.response = None, None
        self.resume()  # an answer that ended in the read that paused it: the next exchange reads again

    def _fail(self, error: BaseException) -> None:
        """End the exchange with `error` (the caller's await raises it) and close the connection."""
        response, ready = self.response, self.headers_ready
        self._end_exchange()
        if ready is not None and not ready.done():
            ready.set_exception(error)
            ready.exception()  # retrieved here: a failure before the caller awaits is not "never retrieved"
        if response is not None:
            response._finish(error)
        self.drop()

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.last_heard = self.loop.time()
            self.transport.resume_reading()

    def drop(self) -> None:
        if not self.closed:
            self.closed = True
            self.client._forget(self)
            if self.transport is not None:
                self.transport.close()


class EngineHTTP:
    """Keep-alive HTTP/1.1 POSTs to the engines, with fixed headers on every request (the internal key)."""

    def __init__(self, headers: Mapping[str, str] | None = None, keepalive_s: float = 30.0) -> None:
        self.fixed = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        self.keepalive_s = keepalive_s
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._open: set[_Connection] = set()

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], timeout: Timeout) -> Response:
        """POST `body` to `url` and return once the status line and headers arrived. Raises ConnectFailed,
        Disconnected, BadAnswer, TimeoutError; cancelled, the connection is closed."""
        _netloc, slash, rest = url.partition("://")[2].partition("/")
        origin = self._origin(url[: len(url) - len(rest) - len(slash)])
        head = self._head(origin, slash + rest or "/", len(body), headers)
        for attempt in (0, 1):
            connection = self._take_idle(origin)
            reused = connection is not None
            if connection is None:
                connection = await self._connect(origin, timeout)
            response = connection.send(head, body, timeout)
            try:
                assert connection.headers_ready is not None
                await connection.headers_ready
                return response
            except Disconnected:
                if reused and not connection.got_bytes and attempt == 0:
                    continue  # the engine had closed this idle connection: it never read the request
                raise
            except BaseException:
                connection.drop()
                raise
        raise AssertionError("unreachable")

    def _head(self, origin: _Origin, path: str, length: int, headers: Mapping[str, str]) -> bytes:
        """The request line and headers: the origin's Host and fixed headers, then this leg's."""
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        if extra.count("\n") != len(headers) or extra.count("\r") != len(headers):
            raise ValueError("a leg's header holds a line break")  # the client's X-Request-ID is passed on: never split
        return b"".join((f"POST {path} HTTP/1.1\r\n".encode("latin-1"), origin.host_header,
                         f"Content-Length: {length}\r\n{extra}\r\n".encode("utf-8", "surrogateescape")))

    def _origin(self, base: str) -> _Origin:
        """`base`: scheme://host[:port] of an engine URL, parsed once."""
        origin = self._origins.get(base)
        if origin is None:
            parts = urlsplit(base)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConnectFailed(f"not an http(s) URL: {base!r}")
            tls = parts.scheme == "https"
            origin = _Origin((parts.hostname, parts.port or (443 if tls else 80), tls),
                             f"Host: {parts.netloc}\r\n{self.fixed}".encode("latin-1"))
            self._origins[base] = origin
        return origin

    def _take_idle(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin.key)
        while idle:
            connection = idle.pop()  # its loop's clock: asking asyncio for the running loop is a getpid syscall on 3.11
            if not connection.closed and connection.loop.time() - connection.idle_since < self.keepalive_s:
                return connection
            connection.drop()
        return None

    async def _connect(self, origin: _Origin, timeout: Timeout) -> _Connection:
        host, port, tls = origin.key
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout.connect_s):
                _transport, connection = await loop.create_connection(lambda: _Connection(self, origin), host, port,
                                                                      ssl=tls or None)
        except TimeoutError:
            raise TimeoutError(f"no connection to {host}:{port} within {timeout.connect_s:g} s") from None
        except OSError as exc:  # refused, unresolvable (socket.gaierror), unreachable
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from exc
        self._open.add(connection)
        return connection

    def _give_back(self, connection: _Connection) -> None:
        connection.idle_since = connection.loop.time()
        self._idle.setdefault(connection.origin.key, []).append(connection)

    def _forget(self, connection: _Connection) -> None:
        self._open.discard(connection)

    async def close(self) -> None:
        for connection in list(self._open):
            connection.drop()
        self._idle.clear()
