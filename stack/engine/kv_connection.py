"""One incoming KV transfer on decode's socket: preamble → header → (reply) → payload → trailer → ack.

A `BufferedProtocol` has the kernel write each payload segment straight into the receive arrays
(kv_consumer.py owns them, admission and leases). A stalled producer must not hold its reservation
forever, but a long prompt's push legitimately takes minutes: layer L goes on the wire while layer
L+1 is still being computed. So the bound is an idle one: the connection is aborted only when no
byte has arrived for `kv_lease_ms` (the lease counts from the last byte, not from the header).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import numpy as np

from stack.common import events
from stack.common.logging import log_event
from stack.engine import kv_wire
from stack.engine.kv_wire import KVHeader, KVTrailer, Reply, WireError


class Reservation(Protocol):
    """What this connection reads of an admitted transfer (kv_consumer.Reservation)."""

    header: KVHeader
    nbytes: int  # payload bytes

    @property
    def tokens(self) -> int: ...


class Arrays(Protocol):
    k: np.ndarray
    v: np.ndarray


class Consumer(Protocol):
    """The side that owns admission, receive arrays and leases (kv_consumer.KVConsumer); told, not imported, so the two
    modules form no import circle."""

    lease_ms: int

    def admit(self, header: KVHeader, peer: str) -> tuple[Reply, Reservation | None]: ...
    def receive_arrays(self, res: Reservation) -> Arrays: ...
    def complete(self, res: Reservation, trailer: KVTrailer, peer: str, receive_s: float, actual: list[str]) -> Reply: ...
    def abort_inflight(self, res: Reservation, received_bytes: int, peer: str) -> None: ...
    def protocol_error(self, peer: str, error: str) -> Reply: ...


class KVConnection(asyncio.BufferedProtocol):
    """One incoming transfer, from its first byte to the ack (or to its abort)."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.res: Reservation | None = None
        self.targets: list[memoryview] = []  # what the current stage fills, in order
        self.segments: list[np.ndarray] = []  # the payload's segments (views into k and v)
        self.checksums: list[str] = []  # of each payload segment received so far
        self.stage = "preamble"
        self._expect(bytearray(kv_wire.PREAMBLE.size))
        self.payload_received = 0
        self.payload_started = 0.0
        self.done = False
        self.last_byte = 0.0  # loop time of the last byte received
        self.idle_check: asyncio.TimerHandle | None = None

    def _expect(self, *targets: bytearray | np.ndarray) -> None:
        self.raw = targets[0]  # the preamble/header bytearray (payload stages fill numpy arrays)
        self.targets = [memoryview(t).cast("B") for t in targets]
        self.filled = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.loop = asyncio.get_running_loop()
        self.last_byte = self.loop.time()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.targets[0][self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.last_byte = self.loop.time()  # one float store per read: the idle check below re-arms from it
        self.filled += nbytes
        if self.stage == "payload":
            self.payload_received += nbytes
        if self.filled < len(self.targets[0]):
            return
        self.targets.pop(0)
        self.filled = 0
        if self.stage == "payload":  # verify while the producer sends the next segment
            self.checksums.append(kv_wire.checksum(self.segments[len(self.checksums)]))
        if not self.targets:
            self._stage_complete()

    def _check_idle(self) -> None:
        """Abort when nothing arrived for kv_lease_ms; otherwise look again when that much time has passed since the last byte."""
        limit = self.consumer.lease_ms / 1000
        idle = self.loop.time() - self.last_byte
        if idle < limit:
            self.idle_check = self.loop.call_at(self.last_byte + limit, self._check_idle)
            return
        assert self.res is not None and self.transport is not None, "the idle check runs only for an admitted transfer"
        header = self.res.header
        log_event(events.KV_CONSUMER_STALLED,
                  f"KV transfer {header.transfer_id} from {self.peer} sent nothing for {idle:.1f} s (kv_lease_ms={self.consumer.lease_ms}) "
                  f"after {self.payload_received} of {self.res.nbytes} payload bytes; closing it",
                  "ERROR", request_id=header.request_id, transfer_id=header.transfer_id, idle_ms=round(idle * 1000),
                  kv_lease_ms=self.consumer.lease_ms, received=self.payload_received, bytes=self.res.nbytes, peer=self.peer)
        self.transport.abort()

    def _stage_complete(self) -> None:
        try:
            if self.stage == "preamble":
                self.stage = "header"
                self._expect(bytearray(kv_wire.parse_preamble(bytes(self.raw))))
            elif self.stage == "header":
                self._on_header(KVHeader.decode(bytes(self.raw)))
            elif self.stage == "payload":
                self.stage = "trailer_length"
                self._expect(bytearray(kv_wire.TRAILER_PREFIX.size))
            elif self.stage == "trailer_length":
                self.stage = "trailer"
                self._expect(bytearray(kv_wire.trailer_length(bytes(self.raw))))
            else:
                self._on_trailer()
        except WireError as exc:
            if self.res is not None and not self.done:  # a bad trailer: the reservation and its pins go
                self.done = True
                self.consumer.abort_inflight(self.res, self.payload_received, self.peer)
            self._finish(self.consumer.protocol_error(self.peer, str(exc)))

    def _on_header(self, header: KVHeader) -> None:
        reply, res = self.consumer.admit(header, self.peer)
        if res is None:
            self._finish(reply)
            return
        self.res = res
        arrays = self.consumer.receive_arrays(res)
        self.stage = "payload"
        self.segments = kv_wire.segments(arrays.k, arrays.v, res.tokens)
        self._expect(*self.segments)
        self.payload_started = time.perf_counter()
        assert self.transport is not None
        self.idle_check = self.loop.call_later(self.consumer.lease_ms / 1000, self._check_idle)
        self.transport.write(reply.encode())

    def _on_trailer(self) -> None:
        assert self.res is not None, "trailer without header"
        trailer = KVTrailer.decode(bytes(self.raw), self.res.header.n_layers)
        self.done = True
        receive_s = time.perf_counter() - self.payload_started
        self._finish(self.consumer.complete(self.res, trailer, self.peer, receive_s, self.checksums))

    def _finish(self, reply: Reply) -> None:
        self.done = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(reply.encode())
            self.transport.close()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.idle_check is not None:
            self.idle_check.cancel()
        if self.res is not None and not self.done:  # admitted, and the trailer never came
            self.consumer.abort_inflight(self.res, self.payload_received, self.peer)
