"""The decode side of the KV socket: listener, receive buffer, claims and leases (wire: kv_wire.py).

Each connection (kv_connection.py) has the kernel write the payload directly into the arrays the
decode request will claim, and verifies every segment's checksum as soon as it is in. Admission
happens on the header, before any payload moves: the fingerprint must match and the transfer's KV
must fit, both the receive buffer now (`kv_buffer_size` bounds in-flight + held +
claimed-but-not-yet-loaded bytes) and this engine's KV pool at all; a transfer that does not fit is
refused with both numbers (the prefill answers 503 `decode_kv_capacity`, and the router tries
another decode) rather than cut off halfway. Received KV
waits for its decode request (`claim`, bounded by kv_transfer_timeout_ms); KV nobody claims is
freed when its lease (kv_lease_ms) runs out, so the buffer always returns to 0. Receive arrays are
recycled within the same budget: first-touch page faults on fresh memory cost more than the copy.

Prefix reuse: on the header, the leading prompt blocks this engine's prefix cache holds (by hash)
are pinned for the transfer and announced in the accept reply (`reused_blocks`); only the rest is
received, and the pins go when the decode request has copied the blocks in (or the KV is dropped).
Deciding here, on the socket, rather than in the router keeps one source of truth: the cache that
evicts is the one that answers, and the pin closes the race between the answer and the use.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from stack.common import events
from stack.common.logging import log_event
from stack.engine.metrics import EngineMetrics
from stack.engine import kv_wire
from stack.engine.errors import KVTransferError
from stack.engine.kv_cache import KVPool
from stack.engine.kv_connection import KVConnection
from stack.engine.kv_wire import KVHeader, KVTrailer, Reply
from stack.engine.prefix_cache import Block, PrefixCache


RECYCLE_ROUND_TOKENS = 128  # receive arrays come in multiples of this many tokens, so they fit again


@dataclass(eq=False)
class ReceiveArrays:
    """K and V arrays one transfer is received into: (n_layers, capacity, n_kv_heads, head_dim) each."""

    k: np.ndarray
    v: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def fits(self, header: KVHeader, tokens: int) -> bool:
        return (self.k.dtype == np.dtype(header.dtype) and self.k.shape[0] == header.n_layers
                and self.k.shape[2:] == (header.n_kv_heads, header.head_dim) and self.k.shape[1] >= tokens)


@dataclass(eq=False)
class Reservation:
    """An admitted transfer's share of the receive buffer and the cached blocks it reuses (pinned)."""

    header: KVHeader
    reused: list[Block]  # the leading prompt blocks this engine holds: not sent
    nbytes: int  # payload bytes (what the buffer counts)
    arrays: ReceiveArrays | None = None

    @property
    def tokens(self) -> int:
        """Positions the payload holds: [start, num_tokens)."""
        return self.header.num_tokens - self.header.start(len(self.reused))


@dataclass(eq=False)
class ReceivedKV:
    """A complete, verified transfer held in the receive buffer until its decode request loads it."""

    reservation: Reservation
    trailer: KVTrailer
    peer: str
    consumer: KVConsumer
    released: bool = False

    @property
    def header(self) -> KVHeader:
        return self.reservation.header

    @property
    def reused(self) -> list[Block]:
        return self.reservation.reused

    @property
    def k(self) -> np.ndarray:
        assert self.reservation.arrays is not None
        return self.reservation.arrays.k[:, : self.reservation.tokens]  # (n_layers, num_tokens - start, n_kv_heads, head_dim)

    @property
    def v(self) -> np.ndarray:
        assert self.reservation.arrays is not None
        return self.reservation.arrays.v[:, : self.reservation.tokens]

    def release(self) -> None:
        """Return its bytes to the receive buffer and unpin its blocks (after loading into the KV pool, or on abort)."""
        if not self.released:
            self.released = True
            self.consumer.free(self.reservation)


class KVConsumer:
    """The decode side's KV listener and receive buffer."""

    def __init__(self, *, fingerprint: str, buffer_size: int, lease_ms: int, metrics: EngineMetrics | None = None,
                 prefix: PrefixCache | None = None, pool: KVPool | None = None) -> None:
        self.metrics = metrics or EngineMetrics()
        self.pool = pool  # the decode's KV pool: a transfer it could never hold is refused at the header
        self.prefix = prefix  # this engine's prefix cache: blocks it holds are not received again
        self.fingerprint = fingerprint
        self.buffer_size = buffer_size
        self.lease_ms = lease_ms
        self.buffer_used = 0  # bytes reserved: in flight + held + claimed-not-yet-released
        self.port = 0
        self._idle: list[ReceiveArrays] = []  # recycled receive arrays; their bytes + buffer_used <= buffer_size
        self._held: dict[str, ReceivedKV] = {}  # arrived, not yet claimed
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self._inflight: set[str] = set()
        self._waiters: dict[str, asyncio.Future[ReceivedKV]] = {}
        self._expired: dict[str, float] = {}  # transfer ids whose claim timed out (monotonic time)
        self._server: asyncio.Server | None = None

    @property
    def held_transfers(self) -> int:
        return len(self._held)

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: KVConnection(self), host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        log_event(events.KV_CONSUMER_LISTENING, f"KV consumer listening on {host}:{self.port} (buffer {self.buffer_size} bytes)",
                  kv_port=self.port, kv_buffer_size=self.buffer_size, kv_lease_ms=self.lease_ms)
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for handle in self._leases.values():
            handle.cancel()
        for received in self._held.values():
            received.release()
        self._held.clear()
        self._leases.clear()

    async def claim(self, transfer_id: str, timeout_ms: int) -> ReceivedKV:
        """The KV pushed under `transfer_id`, waiting up to `timeout_ms` for it to arrive."""
        started = time.monotonic()
        received = self._held.pop(transfer_id, None)
        if received is None:
            future: asyncio.Future[ReceivedKV] = asyncio.get_running_loop().create_future()
            self._waiters[transfer_id] = future
            try:
                received = await asyncio.wait_for(future, timeout_ms / 1000)
            except TimeoutError:
                waited_ms = round((time.monotonic() - started) * 1000, 1)
                self._remember_expired(transfer_id)
                inflight = transfer_id in self._inflight
                log_event(
                    events.KV_CONSUMER_TIMEOUT,
                    f"KV for transfer {transfer_id} did not arrive within kv_transfer_timeout_ms={timeout_ms} "
                    f"(waited {waited_ms} ms{'; it is still arriving' if inflight else '; nothing was pushed'})",
                    "ERROR", transfer_id=transfer_id, waited_ms=waited_ms, kv_transfer_timeout_ms=timeout_ms, in_flight=inflight,
                )
                raise KVTransferError(
                    "timeout",
                    f"the KV cache for transfer {transfer_id} did not arrive within kv_transfer_timeout_ms={timeout_ms} "
                    f"(waited {waited_ms} ms); check that prefill can reach this decode's kv_port {self.port}",
                    waited_ms=waited_ms, kv_transfer_timeout_ms=timeout_ms,
                ) from None
            except asyncio.CancelledError:  # the decode request went away: refuse this KV if it still comes
                if future.done() and not future.cancelled():
                    future.result().release()  # it arrived in the same loop turn the request left
                self._remember_expired(transfer_id)
                raise
            finally:
                self._waiters.pop(transfer_id, None)
        else:
            self._leases.pop(transfer_id).cancel()
        wait_ms = round((time.monotonic() - started) * 1000, 1)
        log_event(events.KV_CONSUMER_CLAIMED, f"claimed KV of transfer {transfer_id} ({received.header.num_tokens} tokens) after {wait_ms} ms",
                  transfer_id=transfer_id, wait_ms=wait_ms, num_tokens=received.header.num_tokens, bytes=received.reservation.nbytes)
        return received

    # -- called by KVConnection ----------------------------------------------------------------

    def admit(self, header: KVHeader, peer: str) -> tuple[Reply, Reservation | None]:
        """Accept (with the reservation) or reject a transfer from its header, before any payload is read."""
        tid, rid = header.transfer_id, header.request_id
        if header.fingerprint != self.fingerprint:
            msg = (f"model fingerprint mismatch: this decode runs {self.fingerprint}, the prefill sent {header.fingerprint}; "
                   "prefill and decode must load the same checkpoint and seed")
            log_event(events.KV_CONSUMER_FINGERPRINT_MISMATCH, msg, "ERROR", request_id=rid, transfer_id=tid,
                      local=self.fingerprint, remote=header.fingerprint, peer=peer)
            self.metrics.on_kv_failed("receive", "fingerprint_mismatch")
            return Reply(False, "fingerprint_mismatch", msg, {"local": self.fingerprint, "remote": header.fingerprint}), None
        reused = self._reusable(header)
        nbytes = header.payload_bytes(len(reused))
        refused = self._capacity(header, nbytes, peer)
        if refused is not None:
            return refused, None
        if tid in self._held or tid in self._inflight:
            return self._protocol_error(rid, tid, peer, "duplicate_transfer", f"transfer id {tid} is already held or arriving"), None
        if tid in self._expired:
            return self._protocol_error(rid, tid, peer, "claim_expired",
                                        f"the decode request for transfer {tid} already gave up waiting (kv_transfer_timeout_ms)"), None
        if self.prefix is not None:
            self.prefix.pin(reused)
        self.buffer_used += nbytes
        self._inflight.add(tid)
        return Reply(True, "accepted", "send the payload", {"reused_blocks": len(reused), "bytes": nbytes}), Reservation(header, reused, nbytes)

    def _capacity(self, header: KVHeader, nbytes: int, peer: str) -> Reply | None:
        """A refusal naming both numbers if the transfer cannot be held: never by the KV pool, or not now by the buffer."""
        tid, rid, tokens = header.transfer_id, header.request_id, header.num_tokens
        per_token = max(header.payload_bytes(0) // max(tokens, 1), 1)
        if self.pool is not None and not self.pool.can_ever_fit(tokens + 1):  # the prompt and at least one generated token
            pool_tokens = self.pool.total_blocks * self.pool.block_size
            msg = (f"KV of {tokens} tokens (+1 to generate) does not fit this decode's KV pool: it holds {pool_tokens} tokens "
                   f"({self.pool.total_blocks * self.pool.block_bytes} bytes, kv_cache_bytes={self.pool.budget_bytes}; "
                   f"max_seq_len {self.pool.config.max_seq_len})")
            log_event(events.KV_CONSUMER_POOL_TOO_SMALL, msg, "ERROR", request_id=rid, transfer_id=tid, num_tokens=tokens,
                      pool_tokens=pool_tokens, kv_cache_bytes=self.pool.budget_bytes, peer=peer)
            self.metrics.on_kv_failed("receive", "pool_too_small")
            return Reply(False, "pool_too_small", msg, {"num_tokens": tokens, "pool_tokens": pool_tokens, "kv_cache_bytes": self.pool.budget_bytes})
        if self.buffer_used + nbytes > self.buffer_size:
            free = self.buffer_size - self.buffer_used
            msg = (f"KV transfer of {nbytes} bytes ({tokens} tokens) does not fit the receive buffer: "
                   f"kv_buffer_size={self.buffer_size} bytes (about {self.buffer_size // per_token} tokens), {self.buffer_used} in use, "
                   f"{free} free (about {free // per_token} tokens)")
            log_event(events.KV_CONSUMER_BUFFER_FULL, msg, "ERROR", request_id=rid, transfer_id=tid, bytes=nbytes, num_tokens=tokens,
                      kv_buffer_size=self.buffer_size, buffer_used=self.buffer_used, peer=peer)
            self.metrics.on_kv_failed("receive", "buffer_full")
            return Reply(False, "buffer_full", msg, {"bytes": nbytes, "num_tokens": tokens, "kv_buffer_size": self.buffer_size,
                                                     "buffer_used": self.buffer_used})
        return None

    def _reusable(self, header: KVHeader) -> list[Block]:
        """The leading blocks of the header's prompt this engine's prefix cache holds (same block size only)."""
        if self.prefix is None or header.block_size != self.prefix.block_size:
            return []
        return self.prefix.match(header.block_hashes, header.max_reuse())

    def receive_arrays(self, res: Reservation) -> ReceiveArrays:
        """Arrays for an admitted transfer: a recycled pair that fits, else new ones (idle pairs make room)."""
        header, tokens = res.header, res.tokens
        fitting = [a for a in self._idle if a.fits(header, tokens)]
        if fitting:
            arrays = min(fitting, key=lambda a: a.nbytes)
            self._idle.remove(arrays)
            res.arrays = arrays
            return arrays
        capacity = -(-tokens // RECYCLE_ROUND_TOKENS) * RECYCLE_ROUND_TOKENS
        slack = (capacity - tokens) * res.nbytes // tokens
        if slack > self.buffer_size - self.buffer_used:  # no room to round up: exact size (the reservation is already in)
            capacity = tokens
        shape = (header.n_layers, capacity, header.n_kv_heads, header.head_dim)
        arrays = ReceiveArrays(np.empty(shape, header.dtype), np.empty(shape, header.dtype))
        self._trim_idle(self.buffer_size - self.buffer_used - (arrays.nbytes - res.nbytes))  # used has this transfer
        res.arrays = arrays
        return arrays

    def free(self, res: Reservation) -> None:
        """A transfer's bytes leave the buffer and its pins go; its arrays wait for the next transfer if the budget allows."""
        self.buffer_used -= res.nbytes
        if self.prefix is not None:
            self.prefix.unpin(res.reused)
        if res.arrays is not None:
            self._idle.append(res.arrays)
        self._trim_idle(self.buffer_size - self.buffer_used)

    def _trim_idle(self, keep_bytes: int) -> None:
        while self._idle and sum(a.nbytes for a in self._idle) > max(keep_bytes, 0):
            self._idle.remove(max(self._idle, key=lambda a: a.nbytes))

    def complete(self, res: Reservation, trailer: KVTrailer, peer: str, receive_s: float, actual: list[str]) -> Reply:
        """The payload and trailer are in, `actual` holds the segment checksums: hold it for its claimer, or drop it."""
        header = res.header
        tid, rid = header.transfer_id, header.request_id
        self._inflight.discard(tid)
        bad = [i for i, (a, e) in enumerate(zip(actual, trailer.checksums, strict=True)) if a != e]
        if bad:
            self.free(res)
            i = bad[0]
            msg = (f"KV payload checksum mismatch in {len(bad)} of {len(actual)} segments (first: layer {i // 2} "
                   f"{'KV'[i % 2]}: expected {trailer.checksums[i]}, got {actual[i]}); the KV was dropped")
            log_event(events.KV_CONSUMER_CHECKSUM_MISMATCH, msg, "ERROR", request_id=rid, transfer_id=tid,
                      expected=trailer.checksums[i], actual=actual[i], bad_segments=len(bad), peer=peer)
            self.metrics.on_kv_failed("receive", "checksum_mismatch")
            return Reply(False, "checksum_mismatch", msg, {"expected": trailer.checksums[i], "actual": actual[i]})
        received = ReceivedKV(res, trailer, peer, self)
        self.metrics.on_kv_received(res.nbytes, receive_s, len(res.reused))
        gbps = round(res.nbytes / max(receive_s, 1e-9) / 1e9, 3)
        log_event(events.KV_CONSUMER_RECEIVED, f"received {header.num_tokens} tokens of KV ({res.nbytes} bytes, {len(res.reused)} blocks "
                  f"reused) from {peer}", request_id=rid, transfer_id=tid, num_tokens=header.num_tokens, bytes=res.nbytes, peer=peer,
                  receive_ms=round(receive_s * 1000, 3), gbps=gbps, reused_blocks=len(res.reused))
        waiter = self._waiters.get(tid)
        if waiter is not None and not waiter.done():
            waiter.set_result(received)
        else:
            self._held[tid] = received
            self._leases[tid] = asyncio.get_running_loop().call_later(self.lease_ms / 1000, self._expire, tid)
        return Reply(True, "stored", "KV stored", {"bytes": res.nbytes})

    def abort_inflight(self, res: Reservation, received_bytes: int, peer: str) -> None:
        """The connection closed mid-payload: drop the reservation."""
        header = res.header
        self._inflight.discard(header.transfer_id)
        self.free(res)
        self.metrics.on_kv_failed("receive", "incomplete")
        log_event(events.KV_CONSUMER_INCOMPLETE, f"KV connection from {peer} closed after {received_bytes} of {res.nbytes} payload bytes",
                  "ERROR", request_id=header.request_id, transfer_id=header.transfer_id, received=received_bytes,
                  bytes=res.nbytes, peer=peer)

    def protocol_error(self, peer: str, error: str) -> Reply:
        return self._protocol_error("-", None, peer, "bad_header", error)

    def _protocol_error(self, rid: str, tid: str | None, peer: str, code: str, error: str) -> Reply:
        log_event(events.KV_CONSUMER_PROTOCOL_ERROR, f"rejected KV transfer from {peer}: {error}", "ERROR",
                  request_id=rid, transfer_id=tid, code=code, error=error, peer=peer)
        return Reply(False, code, error)

    def _expire(self, tid: str) -> None:
        self._leases.pop(tid, None)
        received = self._held.pop(tid, None)
        if received is None:
            return
        received.release()
        self.metrics.on_kv_failed("receive", "lease_expired")
        log_event(events.KV_CONSUMER_LEASE_EXPIRED,
                  f"freed {received.reservation.nbytes} bytes of KV for transfer {tid}: no decode request claimed it within kv_lease_ms={self.lease_ms}",
                  "WARNING", request_id=received.header.request_id, transfer_id=tid, bytes=received.reservation.nbytes,
                  lease_ms=self.lease_ms, buffer_used=self.buffer_used)

    def _remember_expired(self, tid: str) -> None:
        """Refuse this transfer if it still arrives; ids are forgotten after one lease (bounded memory)."""
        now = time.monotonic()
        self._expired = {t: at for t, at in self._expired.items() if at > now - self.lease_ms / 1000}
        self._expired[tid] = now
