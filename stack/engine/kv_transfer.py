"""Pushing a prompt's KV cache from a prefill engine to a decode engine (wire: kv_wire.py).

`KVProducer.push` opens one connection per transfer in a worker thread and `sendall`s each
layer's K/V straight from the cache's memory (no copies in Python), then waits for the decode's
ack, so a failure is known on both sides. The receiving side is kv_consumer.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stack.common import events
from stack.common.logging import log_event
from stack.engine import kv_wire
from stack.engine.errors import KVTransferError
from stack.engine.kv_wire import KVHeader, Reply, WireError


def prompt_hash(tokens: Sequence[int]) -> str:
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


# -- producer --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PushResult:
    bytes: int
    transfer_ms: float
    gbps: float  # gigabytes (1e9) per second, header to ack


class KVProducer:
    """Pushes KV to decode engines; one connection per transfer."""

    def __init__(self, io_timeout_s: float) -> None:
        self.io_timeout_s = io_timeout_s  # any single connect/send/recv may block at most this long

    async def push(self, header: KVHeader, payload: list[np.ndarray], decode_kv_addr: str) -> PushResult:
        """Send `payload` (kv_wire.segments order) under `header`; raise KVTransferError on any failure."""
        tid = header.transfer_id
        log_event(
            events.KV_PRODUCER_SENDING,
            f"pushing {header.num_tokens} tokens of KV ({header.total_bytes} bytes) to {decode_kv_addr}",
            transfer_id=tid, decode_kv_addr=decode_kv_addr, num_tokens=header.num_tokens, bytes=header.total_bytes,
        )
        started = time.perf_counter()
        try:
            # The name lookup is bounded too: socket.create_connection's timeout does not cover getaddrinfo, and a decode
            # whose container is gone costs the resolver ~10 s of retries. The whole push is bounded (each step and the sum).
            addr = await _resolve(split_addr(decode_kv_addr), self.io_timeout_s)
            reply = await asyncio.wait_for(asyncio.to_thread(_push_blocking, addr, header.encode(), payload, self.io_timeout_s),
                                           timeout=3 * self.io_timeout_s)
        except _ConnectFailed as exc:
            log_event(
                events.KV_PRODUCER_CONNECT_FAILED, f"cannot connect to decode KV address {decode_kv_addr}: {exc.error}", "ERROR",
                transfer_id=tid, decode_kv_addr=decode_kv_addr, error=exc.error,
            )
            raise KVTransferError(
                "connect_failed", f"cannot push KV to decode_kv_addr {decode_kv_addr}: {exc.error}", decode_kv_addr=decode_kv_addr
            ) from None
        except (OSError, WireError, ValueError, asyncio.TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc or 'the push did not finish in time'}"
            log_event(events.KV_PRODUCER_FAILED, f"KV push to {decode_kv_addr} broke: {error}", "ERROR",
                      transfer_id=tid, decode_kv_addr=decode_kv_addr, error=error)
            raise KVTransferError("io_error", f"KV push to decode_kv_addr {decode_kv_addr} failed: {error}", decode_kv_addr=decode_kv_addr) from None
        elapsed = time.perf_counter() - started
        if not reply.ok:
            log_event(
                events.KV_PRODUCER_REJECTED, f"decode at {decode_kv_addr} rejected the KV: {reply.message}", "ERROR",
                transfer_id=tid, decode_kv_addr=decode_kv_addr, reason=reply.code, detail=reply.message, **reply.details,
            )
            raise KVTransferError(reply.code, f"decode at {decode_kv_addr} rejected the KV transfer: {reply.message}",
                                  decode_kv_addr=decode_kv_addr, **reply.details)
        result = PushResult(header.total_bytes, round(elapsed * 1000, 3), round(header.total_bytes / elapsed / 1e9, 3))
        log_event(
            events.KV_PRODUCER_SENT,
            f"pushed {header.num_tokens} tokens of KV to {decode_kv_addr} in {result.transfer_ms} ms ({result.gbps} GB/s)",
            transfer_id=tid, decode_kv_addr=decode_kv_addr, num_tokens=header.num_tokens, bytes=result.bytes,
            transfer_ms=result.transfer_ms, gbps=result.gbps,
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


def _push_blocking(addr: tuple[str, int], header: bytes, payload: list[np.ndarray], timeout: float) -> Reply:
    """Runs in a worker thread: connect, header, reply, payload, ack. sendall releases the GIL."""
    try:
        sock = socket.create_connection(addr, timeout=timeout)
    except OSError as exc:
        raise _ConnectFailed(f"{type(exc).__name__}: {exc.strerror or exc}") from None
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(header)
        reply = _read_reply(sock)
        if not reply.ok:
            return reply
        for segment in payload:
            sock.sendall(memoryview(segment).cast("B"))
        return _read_reply(sock)


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
