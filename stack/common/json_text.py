"""JSON codecs made once, for the values the router reads and writes on every request.

`json.dumps` and `JSONEncoder.encode` build a new C encoder on each call, about a microsecond that does nothing
for the value; the router encodes several values a request (log lines, the legs' bodies, the answer, stream
frames), so each shape it writes gets one encoder from `make`, called directly. The text is what `json.dumps`
writes with the same options, byte for byte; the one difference is no circular-reference check (every value
written comes from parsed JSON or from our own literals, which cannot hold a cycle).

The request bodies, which are large (a coding agent's turn is ~30-90 kB of messages and tool schemas), go through
msgspec's C codec instead (vLLM's own): `decode` reads strict JSON (no lone surrogate, no NaN or Infinity, no number
beyond a double) and `encode` writes compact UTF-8. For a 33 kB agent body that is ~2x json.loads and ~5x this module's
text encoder (docs/router-performance.md).
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


dumps = make()  # `json.dumps(value)`: the JSON answers (errors, whole completions)


# The engines' request bodies as compact UTF-8 JSON bytes (a NaN would become null: decode_body lets none in).
encode: Callable[[Any], bytes] = msgspec.json.Encoder().encode
# A request body's bytes as JSON values, strict (RFC 8259): msgspec.DecodeError (or RecursionError) for anything else.
decode: Callable[[bytes], Any] = msgspec.json.Decoder().decode
# Keys sorted, compact, UTF-8 kept: text that is equal for equal values whatever their key order (affinity.py).
encode_sorted: Callable[[Any], bytes] = msgspec.json.Encoder(order="sorted").encode
DecodeError = msgspec.DecodeError
