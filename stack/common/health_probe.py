"""The compose health check: one grpc.health.v1 Check over HTTP/2, in the standard library only.

    python -m stack.common.health_probe HOST:PORT     # prints the status, exits 0 only when SERVING

Same answer as `python -m stack.common.health` (grpcio), at a fraction of the cost: compose runs it
every few seconds in every container, and importing grpcio made each probe cost ~140 ms of CPU on
the engine's own core; this costs ~20 ms. The wire exchange (RFC 9113 frames, gRPC's
length-prefixed message, protobuf field 1 of HealthCheckResponse) is small enough to write out:

    → preface, SETTINGS, HEADERS (POST /grpc.health.v1.Health/Check), DATA (empty request, END_STREAM)
    ← SETTINGS (acked), HEADERS, DATA (0x08 <status>), HEADERS (trailers: grpc-status)
"""

from __future__ import annotations

import socket
import struct
import sys

SERVING, NOT_SERVING, UNREACHABLE, TIMEOUT = "SERVING", "NOT_SERVING", "UNREACHABLE", "TIMEOUT"
_STATUS_NAMES = {0: "UNKNOWN", 1: SERVING, 2: NOT_SERVING, 3: "SERVICE_UNKNOWN"}
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x7
_END_STREAM, _END_HEADERS, _ACK = 0x1, 0x4, 0x1
_STREAM = 1


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal header field without indexing, new name, no Huffman (RFC 7541 §6.2.2); short strings only."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def request(authority: str) -> bytes:
    headers = b"".join(_literal(name, value) for name, value in (
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/grpc.health.v1.Health/Check"),
        (b":authority", authority.encode()), (b"content-type", b"application/grpc"), (b"te", b"trailers")))
    empty_request = b"\x00\x00\x00\x00\x00"  # not compressed, length 0: HealthCheckRequest(service="")
    return (_PREFACE + _frame(_SETTINGS, 0, 0) + _frame(_HEADERS, _END_HEADERS, _STREAM, headers)
            + _frame(_DATA, _END_STREAM, _STREAM, empty_request))


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return data


def _status(message: bytes) -> str:
    """HealthCheckResponse: field 1 (varint tag 0x08) = status; an empty message is status 0."""
    if not message:
        return _STATUS_NAMES[0]
    if message[0] != 0x08 or len(message) < 2:
        raise ValueError(f"unexpected HealthCheckResponse bytes {message!r}")
    return _STATUS_NAMES.get(message[1], "UNKNOWN")


def probe(address: str, timeout: float = 2.0) -> str:
    """SERVING, NOT_SERVING, … or UNREACHABLE (nothing answered properly) / TIMEOUT (no answer in time)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(request(address))
            body = b""
            while True:
                length, kind, flags, stream = _parse_header(_read_exact(sock, 9))
                payload = _read_exact(sock, length)
                if kind == _SETTINGS and not flags & _ACK:
                    sock.sendall(_frame(_SETTINGS, _ACK, 0))
                elif kind in (_GOAWAY, _RST_STREAM):
                    return UNREACHABLE
                elif stream == _STREAM and kind == _DATA:
                    body += payload
                if stream == _STREAM and kind in (_DATA, _HEADERS) and flags & _END_STREAM:
                    break
    except (socket.timeout, TimeoutError):
        return TIMEOUT
    except (OSError, ValueError):
        return UNREACHABLE
    if len(body) < 5:
        return UNREACHABLE  # trailers only: the call failed (e.g. no health service)
    try:
        return _status(body[5:5 + struct.unpack(">I", body[1:5])[0]])
    except ValueError:
        return UNREACHABLE


def _parse_header(header: bytes) -> tuple[int, int, int, int]:
    length = int.from_bytes(header[:3], "big")
    return length, header[3], header[4], struct.unpack(">I", header[5:9])[0] & 0x7FFFFFFF


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m stack.common.health_probe HOST:PORT", file=sys.stderr)
        return 2
    status = probe(argv[0])
    print(status)
    return 0 if status == SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
