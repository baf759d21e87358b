"""The JSON encoder of the streaming hot path (SSE frames): orjson, with the stdlib for what it refuses.

orjson encodes a stream chunk several times faster than `json.dumps` and writes UTF-8 bytes, which is
what a socket takes anyway. (Log lines keep the stdlib encoder: orjson cannot write their `"key": value`
spacing, which log readers grep for.) Its output is compact JSON like
`json.dumps(..., separators=(",", ":"), ensure_ascii=False)`; it differs on NaN/Infinity (null, which
strict JSON readers prefer). It refuses integers past 64 bits and strings with lone surrogates (a
client can send either); those values go through the stdlib encoder with ASCII escapes, which writes a
lone surrogate as its `\\uXXXX` escape: valid JSON that any UTF-8 writer accepts.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

_STDLIB = json.JSONEncoder(default=str, separators=(",", ":"))
_OPTIONS = orjson.OPT_NON_STR_KEYS


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON; anything it cannot type is written as `str(value)`."""
    try:
        return orjson.dumps(value, default=str, option=_OPTIONS)
    except TypeError:  # orjson.JSONEncodeError: a >64-bit int or a lone surrogate
        return _STDLIB.encode(value).encode()
