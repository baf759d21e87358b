"""JSON codecs made once, for the values the router reads and writes on every request.

`json.dumps` and `JSONEncoder.encode` build a new C encoder on each call, about a microsecond that does nothing
for the value; the router encodes several values a request (log lines, the legs' bodies, the answer, stream
frames), so each shape it writes gets one encoder from `make`, called directly. The text is what `json.dumps`
writes with the same options, byte for byte; the one difference is no circular-reference check (every value
written comes from parsed JSON or from our own literals, which cannot hold a cycle).

The request bodies, which are large (a coding agent's turn is ~30-90 kB of messages and tool schemas), go through
msgspec's C codec instead (vLLM's own): `decode` reads strict JSON (no lone surrogate, no NaN or Infinity, no number
beyond a double) and `encode` writes compact UTF-8. For a 33 kB agent body that is ~2x json.loads and ~5x this module's
text encoder (docs/router-performance.md). So do the engines' answers and stream chunks (`loads`), SSE frames
(stack.common.sse.dumps) and log lines' fields (`text`), each falling back to the stdlib for what msgspec refuses.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from json import encoder as _stdlib
from typing import Any

import msgspec


def _unserialisable(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def make(*, ensure_ascii: bool = True, compact: bool = False, default: Callable[[Any], Any] | None = None) -> Callable[[Any], str]:
    """An encoder: `json.dumps(value, ensure_ascii=…, separators=(",", ":") if compact else None, default=…)`."""
    item, key = (",", ":") if compact else (", ", ": ")
    if _stdlib.c_make_encoder is None:  # a Python without the C accelerator: the stdlib's own path
        return json.JSONEncoder(ensure_ascii=ensure_ascii, separators=(item, key), default=default).encode
    quote = _stdlib.encode_basestring_ascii if ensure_ascii else _stdlib.encode_basestring
    encode = _stdlib.c_make_encoder(None, default or _unserialisable, quote, None, key, item, False, False, True)
    return lambda value: "".join(encode(value, 0))


dumps = make()  # `json.dumps(value)`: error answers (stack.common.errors)
# Compact UTF-8 JSON bytes: the engines' request bodies (a NaN would become null: decode_body lets none in), SSE
# frames (sse.dumps), log fields (text). An object JSON has no type for is written as its str, as default=str does.
encode: Callable[[Any], bytes] = msgspec.json.Encoder(enc_hook=str).encode
# A request body's bytes as JSON values, strict (RFC 8259): msgspec.DecodeError (or RecursionError) for anything else.
decode: Callable[[bytes], Any] = msgspec.json.Decoder().decode

# Keys sorted, compact, UTF-8 kept: text that is equal for equal values whatever their key order (affinity.py).
encode_sorted: Callable[[Any], bytes] = msgspec.json.Encoder(order="sorted").encode
DecodeError = msgspec.DecodeError


def loads(data: bytes) -> Any:
    """`json.loads(data)` for what an engine sends (answers, stream chunks): msgspec's decoder first, in C and without
    json.loads' charset sniffing of bytes; json.loads itself for what msgspec refuses (NaN, Infinity, 1e400, a lone
    surrogate, a BOM, JSON that does not parse, whose error is then json.loads' own), so every answer reads as before."""
    try:
        return decode(data)
    except (DecodeError, RecursionError):
        return json.loads(data)


_STDLIB_TEXT = make(ensure_ascii=False, default=str)


def text(value: Any) -> str:
    """`json.dumps(value, ensure_ascii=False, default=str)`, for log lines' fields: msgspec's encoder then its
    formatter (`format(indent=0)` writes json.dumps' `", "` and `": "`), both in C, in under half the instructions
    of the stdlib's encoder (callgrind: ~9k against ~19k for the fields of a `router.request_done` line). The same
    JSON values; the text differs only where msgspec writes a value its own way: a float's exponent (`1e16` for
    `1e+16`), NaN and Infinity (null, which is valid JSON), and what it knows natively (datetime, UUID, sets, bytes,
    dataclasses; other objects go through str, as with `default=str`). What msgspec refuses (a lone surrogate) the
    stdlib's encoder writes."""
    try:
        return msgspec.json.format(encode(value), indent=0).decode()
    except (TypeError, ValueError, OverflowError):  # UnicodeEncodeError is a ValueError
        return _STDLIB_TEXT(value)


_STDLIB_COMPACT = make(ensure_ascii=False, compact=True, default=str)
_STDLIB_ASCII = make(ensure_ascii=True, compact=True, default=str)


def compact(value: Any) -> bytes:
    """Compact UTF-8 JSON for clients: SSE frames (stack.common.sse) and whole answers. msgspec's encoder writes an
    Anthropic text delta (one a token) in a fifth of the stdlib encoder's instructions (callgrind: 2.6k against 14.7k
    a call); the same JSON values as json.dumps, floats' exponents written msgspec's way (`1e-7`) and NaN as null.
    What it refuses, the stdlib's encoder writes; a lone surrogate (a client's \\ud800 echoed back) cannot be UTF-8,
    so that value gets ASCII escapes instead of failing."""
    try:
        return encode(value)
    except (TypeError, ValueError, OverflowError):  # UnicodeEncodeError is a ValueError
        pass
    try:
        return _STDLIB_COMPACT(value).encode()
    except UnicodeEncodeError:
        return _STDLIB_ASCII(value).encode()
