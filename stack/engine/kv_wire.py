"""The KV socket's wire format: framing, the transfer header, replies and the payload checksum.

One TCP connection carries one transfer, producer (prefill) → consumer (decode):

    producer: PREAMBLE  = "PDKV" | u16 version | u32 header length      (network byte order)
              HEADER    = UTF-8 JSON (`KVHeader`)
    consumer: REPLY     = "PDKR" | u32 length | JSON {ok, code, message, …numbers}
              (ok=false: rejected before any payload moves — fingerprint, buffer, duplicate…)
    producer: PAYLOAD   = for layer in 0..n_layers-1: K[layer, :num_tokens], V[layer, :num_tokens]
              each (num_tokens, n_kv_heads, head_dim) little-endian float32, C order
    consumer: REPLY     = the final ack: ok, or checksum_mismatch / shape error with the numbers

The checksum is one per payload segment (2 per layer): the sum of the segment's 64-bit words
modulo 2**64, as 16 hex digits. It runs at ~20 GB/s in numpy, where zlib.crc32 (~2 GB/s here) is
as slow as the loopback socket itself and would halve the transfer rate; it catches truncation,
corrupted words and segments sent in the wrong order, which is what a KV stream can suffer. The
consumer verifies each segment as soon as it has arrived, overlapping the producer's sending.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

MAGIC = b"PDKV"
REPLY_MAGIC = b"PDKR"
VERSION = 1
PREAMBLE = struct.Struct("!4sHI")  # magic, version, header length
REPLY_PREFIX = struct.Struct("!4sI")  # magic, JSON length
MAX_HEADER_BYTES = 1 << 20  # a header is ~1-4 kB; anything bigger is not our protocol
DTYPE = "float32"  # payload element type, little-endian
CHECKSUM_ALGO = "sum64"


class WireError(Exception):
    """Bytes on the KV socket do not follow this format."""


@dataclass(frozen=True)
class KVHeader:
    """Everything the consumer checks before accepting a payload, and what decode needs after."""

    transfer_id: str  # chosen by the router; the decode leg claims the KV by it
    request_id: str  # X-Request-ID of the prefill leg (logs on both sides join on it)
    fingerprint: str  # model fingerprint (config + weights); must equal the consumer's
    dtype: str  # "float32" (little-endian)
    n_layers: int
    n_kv_heads: int
    head_dim: int
    num_tokens: int  # prompt tokens whose K/V follow (per-layer K and V shape: (num_tokens, n_kv_heads, head_dim))
    first_token: int  # the token prefill sampled from the last prompt position (generation step 0)
    seed: int  # the sampling seed prefill used, so decode continues the same random stream at step 1
    prompt_hash: str  # blake2b of the prompt token ids: decode checks its prompt is the one prefilled
    total_bytes: int  # payload bytes: 2 * n_layers * num_tokens * n_kv_heads * head_dim * 4
    checksum_algo: str = CHECKSUM_ALGO
    checksums: tuple[str, ...] = field(default_factory=tuple)  # per segment: K0, V0, K1, V1, …
    version: int = VERSION
    first_logprob: tuple[Any, ...] | None = None  # [token, logprob, [[id, logprob], …]] when the request asked for logprobs
    cached_tokens: int = 0  # prompt tokens prefill took from its prefix cache (decode reports them in usage)

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        return (self.num_tokens, self.n_kv_heads, self.head_dim)

    @property
    def segment_bytes(self) -> int:
        return self.num_tokens * self.n_kv_heads * self.head_dim * np.dtype(np.float32).itemsize

    def encode(self) -> bytes:
        body = json.dumps(asdict(self), separators=(",", ":")).encode()
        return PREAMBLE.pack(MAGIC, VERSION, len(body)) + body

    @classmethod
    def decode(cls, body: bytes) -> KVHeader:
        try:
            data = json.loads(body)
            data["checksums"] = tuple(data.get("checksums", ()))
            header = cls(**data)
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as exc:
            raise WireError(f"malformed KV header: {exc}") from None
        if header.dtype != DTYPE or header.checksum_algo != CHECKSUM_ALGO:
            raise WireError(f"unsupported dtype/checksum {header.dtype}/{header.checksum_algo}; expected {DTYPE}/{CHECKSUM_ALGO}")
        if min(header.n_layers, header.n_kv_heads, header.head_dim, header.num_tokens) <= 0:
            raise WireError(f"non-positive shape in KV header: {header.n_layers} layers, {header.layer_shape}")
        if header.total_bytes != 2 * header.n_layers * header.segment_bytes or len(header.checksums) != 2 * header.n_layers:
            raise WireError(
                f"KV header is inconsistent: total_bytes {header.total_bytes} for {header.n_layers} layers of "
                f"{header.layer_shape}, {len(header.checksums)} checksums"
            )
        return header


def parse_preamble(data: bytes) -> int:
    """Header length from the 10-byte preamble; WireError if it is not ours."""
    magic, version, length = PREAMBLE.unpack(data)
    if magic != MAGIC:
        raise WireError(f"not a KV transfer (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise WireError(f"KV wire version {version} is not supported (this engine speaks {VERSION})")
    if not 0 < length <= MAX_HEADER_BYTES:
        raise WireError(f"KV header length {length} outside 1..{MAX_HEADER_BYTES}")
    return length


@dataclass(frozen=True)
class Reply:
    """The consumer's answer after the header (accept/reject) and after the payload (ack)."""

    ok: bool
    code: str  # "accepted" | "stored" | buffer_full | fingerprint_mismatch | checksum_mismatch | …
    message: str
    details: dict[str, Any] = field(default_factory=dict)  # the numbers behind the code

    def encode(self) -> bytes:
        body = json.dumps({"ok": self.ok, "code": self.code, "message": self.message, **self.details}).encode()
        return REPLY_PREFIX.pack(REPLY_MAGIC, len(body)) + body

    @classmethod
    def decode(cls, prefix: bytes, read: Any) -> Reply:
        """Parse a reply given its 8-byte prefix and `read(n) -> bytes` for the body."""
        magic, length = REPLY_PREFIX.unpack(prefix)
        if magic != REPLY_MAGIC or length > MAX_HEADER_BYTES:
            raise WireError(f"not a KV reply (magic {magic!r}, length {length})")
        data = json.loads(read(length))
        ok, code, message = data.pop("ok"), data.pop("code"), data.pop("message")
        return cls(bool(ok), str(code), str(message), data)


def checksum(segment: np.ndarray) -> str:
    """Sum of the segment's 64-bit words mod 2**64, 16 hex digits (see the module docstring)."""
    assert segment.nbytes % 8 == 0, f"a KV segment is whole 64-bit words (head_dim is even), got {segment.nbytes} bytes"
    words = np.ascontiguousarray(segment).reshape(-1).view(np.uint64)  # (nbytes / 8,)
    return f"{int(np.add.reduce(words)):016x}"  # uint64 addition wraps: the sum is mod 2**64


def segments(k: np.ndarray, v: np.ndarray, num_tokens: int) -> list[np.ndarray]:
    """Payload order: K and V of each layer's first `num_tokens` positions (contiguous views, no copy).

    k, v: (n_layers, capacity, n_kv_heads, head_dim) -> [(num_tokens, n_kv_heads, head_dim)] * 2 * n_layers
    """
    out: list[np.ndarray] = []
    for layer in range(k.shape[0]):
        out += [k[layer, :num_tokens], v[layer, :num_tokens]]
    return out
