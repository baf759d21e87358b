"""Pushing a prompt's KV cache from a prefill engine to a decode engine (wire: kv_wire.py).

`KVProducer.push` opens one connection per transfer in a worker thread. The prefill's forward feeds
a `LayerStream` from its own thread as each layer's K/V are written (`layer_done`), so layer L goes
on the wire while layer L+1 computes; the handshake tells which leading blocks decode already holds
and only the rest is sent (straight from the cache's memory in float32, a cast copy in float16).
`finish(trailer)` adds the first token; the decode's ack ends it, so a failure is known on both
sides. The receiving side is kv_consumer.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from stack.common import events
from stack.common.logging import log_event
from stack.engine import kv_wire
from stack.engine.errors import KVTransferError
from stack.engine.kv_cache import KVCache
from stack.engine.kv_wire import KVHeader, KVTrailer, Reply, WireError


T = TypeVar("T")
# One socket step of a push (each bounded by the producer's io timeout): a 60k-token prompt's layer segment is
# 61 MB on dummy:small, which a busy decode may take longer than one timeout to read as a whole.
SEND_STEP_BYTES = 4 * 2**20


def prompt_hash(tokens: Sequence[int]) -> str:
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


# -- producer --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PushResult:
    bytes: int  # payload bytes sent (the blocks decode lacked)
    reused_blocks: int  # leading blocks decode already held: not sent
    transfer_ms: float  # connect to ack
    tail_ms: float  # prefill finished (trailer ready) to ack: the transfer time NOT hidden behind compute
    gbps: float  # payload gigabytes (1e9) per second, connect to ack


class _Aborted(Exception):
    """The prefill ended without a trailer (failed, cancelled): close the connection mid-payload."""


class LayerStream:
    """One transfer's source: the forward thread's finished layers, then the trailer (or an abort).

    Items are consumed by the sender thread in order; the producer of items (forward, then the
    hand-off) always ends with `finish` or `abort`, so the sender never waits forever.
    """

    def __init__(self) -> None:
        self._items: queue.Queue[tuple[int, KVCache] | KVTrailer | None] = queue.Queue()
        self.finished_at = 0.0  # perf_counter when the trailer was handed over

    def layer_done(self, layer: int, cache: KVCache) -> None:
        """Forward thread: layer `layer` of `cache` holds every prompt position now."""
        self._items.put((layer, cache))

    def finish(self, trailer: KVTrailer) -> None:
        self.finished_at = time.perf_counter()
        self._items.put(trailer)

    def abort(self) -> None:
        self._items.put(None)

    def next(self) -> tuple[int, KVCache] | KVTrailer:
        item = self._items.get()
        if item is None:
            raise _Aborted()
        return item


class KVProducer:
    """Pushes KV to decode engines; one connection per transfer."""

    def __init__(self, io_timeout_s: float) -> None:
        self.io_timeout_s = io_timeout_s  # any single connect/send/recv may block at most this long

    async def push(self, header: KVHeader, stream: LayerStream, decode_kv_addr: str) -> PushResult:
        """Send the layers `stream` yields under `header`, then its trailer; raise KVTransferError on any failure.

        The waits for layers (the prefill's queueing and compute) are not bounded here: the hand-off
        always ends the stream. Each socket step is.
        """
        tid = header.transfer_id
        log_event(
            events.KV_PRODUCER_SENDING,
            f"pushing {header.num_tokens} tokens of KV ({header.payload_bytes(0)} bytes before reuse) to {decode_kv_addr}",
            transfer_id=tid, decode_kv_addr=decode_kv_addr, num_tokens=header.num_tokens, bytes=header.payload_bytes(0),
        )
        try:
            # The name lookup is bounded too: socket.create_connection's timeout does not cover getaddrinfo, and a decode
            # whose container is gone costs the resolver ~10 s of retries.
            addr = await _resolve(split_addr(decode_kv_addr), self.io_timeout_s)
            # Its own thread, not the loop's shared executor: it waits for the prefill, and queued prefills
            # must never take the threads running pushes (their caches are held until the push ends).
            reply, reused, started = await _in_own_thread(_push_blocking, addr, header, stream, self.io_timeout_s)
        except _Aborted:
            raise KVTransferError("aborted", "the prefill ended before its KV was complete; the transfer was abandoned") from None
        except _ConnectFailed as exc:
            log_event(
                events.KV_PRODUCER_CONNECT_FAILED, f"cannot connect to decode KV address {decode_kv_addr}: {exc.error}", "ERROR",
                transfer_id=tid, decode_kv_addr=decode_kv_addr, error=exc.error,
            )
            raise KVTransferError(
                "connect_failed", f"cannot push KV to decode_kv_addr {decode_kv_addr}: {exc.error}", decode_kv_addr=decode_kv_addr
            ) from None
        except (OSError, WireError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc or 'the push did not finish in time'}"
            log_event(events.KV_PRODUCER_FAILED, f"KV push to {decode_kv_addr} broke: {error}", "ERROR",
                      transfer_id=tid, decode_kv_addr=decode_kv_addr, error=error)
            raise KVTransferError("io_error", f"KV push to decode_kv_addr {decode_kv_addr} failed: {error}", decode_kv_addr=decode_kv_addr) from None
        done = time.perf_counter()
        elapsed = done - started
        if not reply.ok:
            log_event(
                events.KV_PRODUCER_REJECTED, f"decode at {decode_kv_addr} rejected the KV: {reply.message}", "ERROR",
                transfer_id=tid, decode_kv_addr=decode_kv_addr, reason=reply.code, detail=reply.message, **reply.details,
            )
            raise KVTransferError(reply.code, f"decode at {decode_kv_addr} rejected the KV transfer: {reply.message}",
                                  decode_kv_addr=decode_kv_addr, **reply.details)
        sent = header.payload_bytes(reused)
        result = PushResult(sent, reused, round(elapsed * 1000, 3), round((done - stream.finished_at) * 1000, 3), round(sent / elapsed / 1e9, 3))
        log_event(
            events.KV_PRODUCER_SENT,
            f"pushed {header.num_tokens} tokens of KV to {decode_kv_addr} ({reused} blocks reused, {sent} bytes) in "
            f"{result.transfer_ms} ms, {result.tail_ms} ms of it after the prefill finished ({result.gbps} GB/s)",
            transfer_id=tid, decode_kv_addr=decode_kv_addr, num_tokens=header.num_tokens, bytes=result.bytes,
            transfer_ms=result.transfer_ms, gbps=result.gbps, reused_blocks=reused, tail_ms=result.tail_ms,
        )
        return result


class _ConnectFailed(Exception):
    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


async def _resolve(addr: tuple[str, int], timeout: float) -> tuple[str, int]:
    """host:port → a connectable (ip, port) within `timeout`, or _ConnectFailed."""
    host, port = addr
    try:
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout)
    except asyncio.TimeoutError:
        raise _ConnectFailed(f"gaierror: name resolution of {host!r} took longer than {timeout:g}s") from None
    except OSError as exc:
        raise _ConnectFailed(f"{type(exc).__name__}: {exc.strerror or exc}") from None
    return infos[0][4][0], infos[0][4][1]


def _in_own_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """`fn(*args)` in a new daemon thread; its result or exception in the returned future."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, exc: BaseException | None) -> None:
        if future.done():  # the awaiting task was cancelled
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            outcome: tuple[T | None, BaseException | None] = (fn(*args), None)
        except BaseException as exc:  # handed to the awaiting task, raised there
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed meanwhile (its engine stopped): nobody awaits this push any more
            pass

    threading.Thread(target=run, name="kv-push", daemon=True).start()
    return future


def _push_blocking(addr: tuple[str, int], header: KVHeader, stream: LayerStream, timeout: float) -> tuple[Reply, int, float]:
    """Runs in its own thread: connect, header, reply, each layer as it comes, trailer, ack; (ack, reused blocks, start time).

    Connects at the prefill's first finished layer, so no connection idles while a prefill queues.
    Every socket step is bounded by `timeout`; the waits for the next layer last as long as the
    prefill computes it (a loaded CPU may take seconds per layer), and decode closes a push that stays
    silent for kv_lease_ms (counted from its last byte, never from the header). sendall releases the GIL; the forward goes on computing the next layer meanwhile.
    """
    item = stream.next()  # the hand-off always ends the stream: this wait ends with the prefill
    started = time.perf_counter()
    try:
        sock = socket.create_connection(addr, timeout=timeout)
    except OSError as exc:
        raise _ConnectFailed(f"{type(exc).__name__}: {exc.strerror or exc}") from None
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(header.encode())
        reply = _read_reply(sock)
        if not reply.ok:
            return reply, 0, started
        reused = int(reply.details.get("reused_blocks", 0))
        start, checksums = header.start(reused), []
        try:
            while not isinstance(item, KVTrailer):
                layer, cache = item
                for segment in kv_wire.layer_segments(cache.k, cache.v, layer, start, header.num_tokens, header.dtype):
                    checksums.append(kv_wire.checksum(segment))
                    data = memoryview(segment).cast("B")
                    for at in range(0, len(data), SEND_STEP_BYTES):  # sendall's timeout covers one call: bound steps, not the segment
                        sock.sendall(data[at : at + SEND_STEP_BYTES])
                item = stream.next()  # bounded by the prefill's step, which always ends (finish or abort)
        except _Aborted:
            sock.shutdown(socket.SHUT_RDWR)  # decode sees the payload end early and drops the reservation
            raise WireError("the prefill ended before its KV was complete; the transfer was abandoned") from None
        sock.sendall(replace(item, checksums=tuple(checksums)).encode())
        return _read_reply(sock), reused, started


def _read_reply(sock: socket.socket) -> Reply:
    def read(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise WireError(f"decode closed the KV connection after {len(data)} of {n} reply bytes")
            data += chunk
        return bytes(data)

    return Reply.decode(read(kv_wire.REPLY_PREFIX.size), read)
