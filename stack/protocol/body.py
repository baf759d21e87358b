"""The one reader of a request body: bytes → a JSON object, or a 400 `invalid_json` that says what is wrong.

The router and the engine both read bodies with it, so the same mistake gets the same code and message on every hop
(the size limit is the caller's: the router knows its `max_body_bytes`, the engine is reached only by the router).
"""

from __future__ import annotations

import json
import math
from typing import Any

from stack.common import json_text
from stack.common.errors import InvalidRequest
from stack.protocol.fields import check_unicode, json_type


class _NotANumber(ValueError):
    """NaN, Infinity or a number beyond a double: Python's json reads them, RFC 8259 has no such number."""


def _refuse_constant(name: str) -> float:
    raise _NotANumber(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _NotANumber(f"{text[:40]} is beyond the range of a double")
    return value


def decode_body(raw: bytes) -> dict[str, Any]:
    """A JSON object, or InvalidRequest(code="invalid_json") naming the problem (empty, not UTF-8, not JSON and where,
    not an object, a lone UTF-16 surrogate, NaN or Infinity).

    msgspec reads a valid body (json_text.decode: strict, in C). What it refuses is read again by Python's json, whose
    messages say where the text breaks and which also reads the rarer valid forms (a byte-order mark, UTF-16)."""
    try:
        body = json_text.decode(raw)
    except (json_text.DecodeError, RecursionError):
        body = _lenient(raw)
    if not isinstance(body, dict):
        raise InvalidRequest(f"Request body must be a JSON object, got a JSON {json_type(body)}.", code="invalid_json")
    return body


def _lenient(raw: bytes) -> Any:
    """Python's json on what msgspec refused: the error that says where, or the value of a valid rarer form."""
    if not raw.strip():
        raise InvalidRequest("Request body is empty; send a JSON object.", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite)
    except UnicodeDecodeError:
        raise InvalidRequest("Request body is not valid UTF-8 JSON.", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}.",
                             code="invalid_json") from None
    except _NotANumber as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}.", code="invalid_json") from None
    # A lone surrogate comes from a \uXXXX escape or from its bytes sent raw (json.loads(bytes) lets them through,
    # all starting \xed as some Hangul does; msgspec refuses both): walk only then. The body that leaves has none.
    if isinstance(body, dict) and (raw.find(b"\\u") >= 0 or raw.find(b"\xed") >= 0):  # find: see safe_json
        check_unicode(body)
    return body
