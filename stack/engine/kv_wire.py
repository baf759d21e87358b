"""The KV socket's wire format: framing, the transfer header, replies and the payload checksum.

One TCP connection carries one transfer, producer (prefill) → consumer (decode):

    producer: PREAMBLE  = "PDKV" | u16 version | u32 header length      (network byte order)
              HEADER    = UTF-8 JSON (`KVHeader`): shapes, dtype, the hash of every full prompt block
    consumer: REPLY     = "PDKR" | u32 length | JSON {ok, code, message, …numbers}
              (ok=false: rejected before any payload moves — fingerprint, buffer, duplicate…)
              ok: `reused_blocks` = r, the leading prompt blocks decode already holds (pinned for
              this transfer); the payload starts at token s = r * block_size
    producer: PAYLOAD   = for layer in 0..n_layers-1: K[layer, s:num_tokens], V[layer, s:num_tokens]
              each (num_tokens - s, n_kv_heads, head_dim) little-endian `dtype`, C order; sent layer
              by layer as prefill computes them
    producer: TRAILER   = u32 length | JSON (`KVTrailer`): the first token, seed, checksums — what is
              known only once prefill has finished
    consumer: REPLY     = the final ack: ok, or checksum_mismatch / shape error with the numbers

A block hash covers the block's tokens, its parent's hash and the model fingerprint
(prefix_cache.chain_hashes), so a hash decode holds is the same K/V prefill would send.

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
from typing import Any, TypeVar

import numpy as np

MAGIC = b"PDKV"
REPLY_MAGIC = b"PDKR"
VERSION = 2  # 2: block hashes, delta payload, dtype float32|float16, trailer after the streamed layers
PREAMBLE = struct.Struct("!4sHI")  # magic, version, header length
TRAILER_PREFIX = struct.Struct("!I")  # trailer JSON length
REPLY_PREFIX = struct.Struct("!4sI")  # magic, JSON length
MAX_HEADER_BYTES = 1 << 20  # a header is ~1-4 kB; anything bigger is not our protocol
DTYPES = ("float32", "float16")  # payload element types, little-endian
CHECKSUM_ALGO = "sum64"


T = TypeVar("T")


class WireError(Exception):
    """Bytes on the KV socket do not follow this format."""


@dataclass(frozen=True)
class KVHeader:
    """Everything the consumer checks before accepting a payload, and what decode needs after."""

    transfer_id: str  # chosen by the router; the decode leg claims the KV by it
    request_id: str  # X-Request-ID of the prefill leg (logs on both sides join on it)
    fingerprint: str  # model fingerprint (config + weights); must equal the consumer's
    dtype: str  # "float32" | "float16" (little-endian): the sender's kv_dtype
    n_layers: int
    n_kv_heads: int
    head_dim: int
    num_tokens: int  # prompt tokens (the payload holds positions [s, num_tokens), see the module docstring)
    prompt_hash: str  # blake2b of the prompt token ids: decode checks its prompt is the one prefilled
    block_size: int = 16  # tokens per hashed block
    block_hashes: tuple[str, ...] = ()  # hash chain of the prompt's full blocks (empty: the sender has no prefix cache)
    checksum_algo: str = CHECKSUM_ALGO
    version: int = VERSION

    def start(self, reused_blocks: int) -> int:
        """First payload position when decode holds `reused_blocks` leading blocks."""
        return reused_blocks * self.block_size

    def payload_bytes(self, reused_blocks: int) -> int:
        """2 * n_layers * (num_tokens - s) * n_kv_heads * head_dim * itemsize."""
        return 2 * self.n_layers * self.segment_bytes(reused_blocks)

    def segment_bytes(self, reused_blocks: int) -> int:
        return (self.num_tokens - self.start(reused_blocks)) * self.n_kv_heads * self.head_dim * np.dtype(self.dtype).itemsize

    def max_reuse(self) -> int:
        """Blocks decode may skip: at least one token is always shipped, so a payload is never empty."""
        return min(len(self.block_hashes), (self.num_tokens - 1) // self.block_size)

    def encode(self) -> bytes:
        body = json.dumps(asdict(self), separators=(",", ":")).encode()
        return PREAMBLE.pack(MAGIC, VERSION, len(body)) + body

    @classmethod
    def decode(cls, body: bytes) -> KVHeader:
        header = _from_json(cls, body, "block_hashes", "header")
        if header.dtype not in DTYPES or header.checksum_algo != CHECKSUM_ALGO:
            raise WireError(f"unsupported dtype/checksum {header.dtype}/{header.checksum_algo}; expected one of {DTYPES}/{CHECKSUM_ALGO}")
        if min(header.n_layers, header.n_kv_heads, header.head_dim, header.num_tokens, header.block_size) <= 0:
            raise WireError(f"non-positive shape in KV header: {header.n_layers} layers, {header.num_tokens} tokens, "
                            f"{header.n_kv_heads} x {header.head_dim}, block_size {header.block_size}")
        if len(header.block_hashes) > header.num_tokens // header.block_size:
            raise WireError(f"KV header is inconsistent: {len(header.block_hashes)} block hashes for {header.num_tokens} tokens")
        return header


@dataclass(frozen=True)
class KVTrailer:
    """What follows the streamed layers: known only once prefill has sampled the first token."""

    first_token: int  # the token prefill sampled from the last prompt position (generation step 0)
    seed: int  # the sampling seed prefill used, so decode continues the same random stream at step 1
    checksums: tuple[str, ...] = ()  # per payload segment: K0, V0, K1, V1, …
    first_logprob: tuple[Any, ...] | None = None  # [token, logprob, [[id, logprob], …]] when the request asked for logprobs
    cached_tokens: int = 0  # prompt tokens prefill took from its prefix cache (decode reports them in usage)

    def encode(self) -> bytes:
        body = json.dumps(asdict(self), separators=(",", ":")).encode()
        return TRAILER_PREFIX.pack(len(body)) + body

    @classmethod
    def decode(cls, body: bytes, n_layers: int) -> KVTrailer:
        trailer = _from_json(cls, body, "checksums", "trailer")
        if len(trailer.checksums) != 2 * n_layers:
            raise WireError(f"KV trailer has {len(trailer.checksums)} checksums for {n_layers} layers (2 per layer)")
        return trailer


def _from_json(cls: type[T], body: bytes, list_field: str, what: str) -> T:
    """`cls(**json)` with `list_field` as a tuple; WireError naming `what` if it is not that."""
    try:
        data = json.loads(body)
        data[list_field] = tuple(data.get(list_field, ()))
        return cls(**data)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, AttributeError) as exc:
        raise WireError(f"malformed KV {what}: {exc}") from None


def trailer_length(data: bytes) -> int:
    (length,) = TRAILER_PREFIX.unpack(data)
    if not 0 < length <= MAX_HEADER_BYTES:
        raise WireError(f"KV trailer length {length} outside 1..{MAX_HEADER_BYTES}")
    return length


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
        out += layer_segments(k, v, layer, 0, num_tokens)
    return out


def layer_segments(k: np.ndarray, v: np.ndarray, layer: int, start: int, end: int, dtype: str | None = None) -> list[np.ndarray]:
    """Layer `layer`'s K and V at positions [start, end): views, or copies in `dtype` when it differs."""
    parts = [k[layer, start:end], v[layer, start:end]]  # (end - start, n_kv_heads, head_dim) each, contiguous
    if dtype is None or parts[0].dtype == np.dtype(dtype):
        return parts
    return [p.astype(dtype) for p in parts]
