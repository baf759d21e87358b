"""The one reader of a request body: bytes → a JSON object, or a 400 `invalid_json` that says what is wrong.

The router and the engine both read bodies with it, so the same mistake gets the same code and message on every hop
(the size limit is the caller's: the router knows its `max_body_bytes`, the engine is reached only by the router).
"""

from __future__ import annotations

import json
from typing import Any

from stack.common.errors import InvalidRequest
from stack.protocol.fields import check_unicode, json_type


def decode_body(raw: bytes) -> dict[str, Any]:
    """A JSON object, or InvalidRequest(code="invalid_json") naming the problem (empty, not UTF-8, not JSON and where,
    not an object, a lone UTF-16 surrogate)."""
    if not raw.strip():
        raise InvalidRequest("Request body is empty; send a JSON object.", code="invalid_json")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise InvalidRequest("Request body is not valid UTF-8 JSON.", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}.",
                             code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"Request body must be a JSON object, got a JSON {json_type(body)}.", code="invalid_json")
    # A lone surrogate comes from a \uXXXX escape or from its bytes sent raw (json.loads(bytes) lets them through,
    # all starting \xed as some Hangul does): walk only then. The body that leaves has none (parse(checked=True)).
    if b"\\u" in raw or b"\xed" in raw:
        check_unicode(body)
    return body
