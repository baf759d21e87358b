"""The body guard reads \\u escapes as JSON does: a pair is one character, an escaped backslash starts no escape,
and only a surrogate without its partner is a 400 (stack/common/safe_json.py)."""

from __future__ import annotations

import json

import pytest

from stack.common.errors import InvalidRequest
from stack.common.safe_json import check_body

SERVED = [
    rb'{"t": "Shipped \ud83d\ude80"}',  # the emoji, as json.dumps writes it
    rb'{"t": "Shipped \uD83D\uDE80"}',  # upper case, as JavaScript writes it
    rb'{"t": "{\"status\": \"Shipped \\ud83d\\ude80\"}"}',  # the text of that escape (a tool printed json.dumps output)
    rb'{"t": "\\ud800"}',  # an escaped backslash, then the letters u d 8 0 0
    rb'{"t": "\\\\\ud83d\ude80"}',  # two escaped backslashes, then a real pair
    json.dumps({"t": "\\" * 7 + "\N{ROCKET}" + "\\ud800"}).encode(),
]
REFUSED = [
    rb'{"t": "cut \ud83d"}',  # a high surrogate alone
    rb'{"t": "\ude80 cut"}',  # a low one alone
    rb'{"t": "\\\ud800"}',  # an escaped backslash, then a real lone surrogate
    rb'{"t": "\ud83d\ud83d\ude80"}',  # a high one whose partner went to the next
    rb'{"t": "\ud83d\\ude80"}',  # the partner is text, not an escape
]


@pytest.mark.parametrize("raw", SERVED)
def test_pairs_and_escaped_backslashes_pass(raw: bytes) -> None:
    """Well-formed text passes the guard (and JSON agrees: it encodes as UTF-8)."""
    check_body(raw)
    json.dumps(json.loads(raw), ensure_ascii=False).encode()


@pytest.mark.parametrize("raw", REFUSED)
def test_lone_surrogates_are_a_400_naming_the_field(raw: bytes) -> None:
    """A surrogate without its partner is refused, naming the field (JSON agrees: it cannot be UTF-8)."""
    with pytest.raises(InvalidRequest, match="lone UTF-16 surrogate") as caught:
        check_body(raw)
    assert caught.value.param == "t"
    with pytest.raises(UnicodeEncodeError):
        json.dumps(json.loads(raw), ensure_ascii=False).encode()
