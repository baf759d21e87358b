"""Limits a JSON request body must meet before any parser or handler sees it (the router's front middleware runs this).

Python's json module recurses once per nesting level (a body nested ~1,000 deep raises RecursionError,
and every recursive walk after the parse would too) and refuses integer literals over 4,300 digits
with a ValueError. Both are client mistakes, so they are found here, on the raw bytes, and answered
400 naming the limit. The scan drops every string's text with three C-level byte operations (two
`replace` for the escapes, one `split` on the quotes) and looks at what is left: brackets, numbers and
literals, a few hundred bytes in an agent's 30 kB request of prose and tool schemas. A regex that blanked the
strings cost ~0.35 ms there; the router still scans bodies past 256 kB in a worker thread.

    check_body(raw)    InvalidRequest: nesting deeper than MAX_DEPTH, a number longer than MAX_NUMBER_CHARS,
                       a lone UTF-16 surrogate escape (no engine can tokenize it)

A surrogate escape is read as JSON reads it, backslash by backslash: `\\ud83d\\ude80` is one emoji (a pair),
`\\\\ud83d` is the text "\\ud83d" (an escaped backslash, then letters: what a tool result holding Python's
`json.dumps` output carries), and only a high surrogate without its low one, or a low one alone, is refused.
"""

from __future__ import annotations

import json
import re

import numpy as np

from stack.common.errors import InvalidRequest

MAX_DEPTH = 64  # the deepest real bodies (tool schemas inside messages) are ~12 levels
MAX_NUMBER_CHARS = 100  # a JSON number literal: digits, sign, point, exponent (a float64 needs ~25)

# A number's characters as "1", everything else as " ": a literal past the limit is then a run of "1"s, found by one
# substring search (a regex tried at every position of the structure cost ~8 µs on an agent's body).
_NUMBER_CHARS = bytes(49 if chr(b) in "-+0123456789.eE" else 32 for b in range(256))
_LONG_NUMBER = b"1" * (MAX_NUMBER_CHARS + 1)
# JSON escapes from left to right, each consumed whole so that a backslash's parity is JSON's: an escaped backslash
# (never the start of a \u escape), a surrogate pair, or a lone surrogate (the one group `lone` names).
_ESCAPES = re.compile(rb"\\(?:\\|u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|(?P<lone>u[dD][89a-fA-F][0-9a-fA-F]{2}))")
# The same surrogates sent raw: UTF-8 forbids encoding them, but json.loads(bytes) decodes with surrogatepass.
_RAW_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


def max_depth(structure: bytes) -> int:
    """The deepest nesting in JSON text whose strings are already removed (`structure`)."""
    if not structure:
        return 0
    steps = _OPEN[np.frombuffer(structure, dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def structure(raw: bytes) -> bytes:
    """JSON text without its strings (keys included, quotes and all): what is left is brackets, separators, numbers
    and literals. Escapes pair left to right, as `replace` scans, so after the escaped backslashes and then the
    escaped quotes are gone every quote left opens or closes a string, and the text between them alternates."""
    if raw.find(b"\\") >= 0:  # not `in`, which on CPython 3.11 raises and clears a TypeError first (relay.py)
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(raw.split(b'"')[0::2])


def check_body(raw: bytes) -> None:
    """Raise InvalidRequest (code invalid_json) if `raw` breaks a limit above; the JSON itself is parsed later.

    The bracket walk runs only when more than MAX_DEPTH brackets are left once the strings are gone (fewer cannot
    nest deeper)."""
    surrogate = raw.find(b"\\u") >= 0 and _lone_escape(raw) or raw.find(b"\xed") >= 0 and _RAW_SURROGATE.search(raw)
    bare = structure(raw)
    if bare.count(b"[") + bare.count(b"{") > MAX_DEPTH and (depth := max_depth(bare)) > MAX_DEPTH:
        raise InvalidRequest(f"Request body nests JSON {depth} levels deep; at most {MAX_DEPTH} are accepted.", code="json_too_deep")
    if _LONG_NUMBER in bare.translate(_NUMBER_CHARS):
        raise InvalidRequest(f"Request body has a number literal longer than {MAX_NUMBER_CHARS} characters.",
                             code="json_number_too_long")
    if surrogate:
        _name_surrogate(raw)
        raise InvalidRequest("Request body contains a lone UTF-16 surrogate escape (like \\ud800 without its pair); "
                             "send valid Unicode.", code="invalid_json")


def _lone_escape(raw: bytes) -> bool:
    """Whether the JSON text holds a \\uXXXX escape of a surrogate without its pair (see the module doc)."""
    return any(match.group("lone") for match in _ESCAPES.finditer(raw))


def _name_surrogate(raw: bytes) -> None:
    """The contract's 400 naming the field that holds the surrogate (issue 10), when the body parses (its depth and
    numbers are checked already); otherwise the caller's body-level 400."""
    from stack.protocol.fields import check_unicode  # the contract's own check and wording

    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return
    try:
        check_unicode(body)
    except InvalidRequest as err:  # the body-level code, with the contract's message and the field named
        raise InvalidRequest(err.message, param=err.param, code="invalid_json") from None
