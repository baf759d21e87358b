"""The one body reader the router and the engine share: every broken body is a 400 naming the problem."""

import pytest

from stack.common.errors import InvalidRequest
from stack.protocol.body import decode_body


@pytest.mark.parametrize(("raw", "code", "says"), [
    (b"", "invalid_json", "empty"),
    (b"  \n", "invalid_json", "empty"),
    (b'{"a": "\xff"}', "invalid_json", "not valid UTF-8"),
    (b'{"model": ', "invalid_json", "not valid JSON: Expecting value at line 1 column 11"),
    (b"[1, 2]", "invalid_json", "must be a JSON object, got a JSON array"),
    (b'"hi"', "invalid_json", "must be a JSON object, got a JSON string"),
    (b'{"messages": [{"content": "\\ud83d"}]}', "invalid_value", "'messages[0].content': the text holds a lone UTF-16 surrogate"),
    # The same surrogate's bytes sent raw (json.loads(bytes) decodes them): the router's handlers skip parse's own walk
    (b'{"tools": [{"description": "half \xed\xa0\xbd"}]}', "invalid_value", "'tools[0].description': the text holds a lone"),
    # Python's json reads these; RFC 8259 (and so every engine's parser) has no such number
    (b'{"temperature": NaN}', "invalid_json", "not valid JSON: NaN is not a JSON number"),
    (b'{"tools": [{"maximum": -Infinity}]}', "invalid_json", "not valid JSON: -Infinity is not a JSON number"),
    (b'{"top_p": 1e400}', "invalid_json", "not valid JSON: 1e400 is beyond the range of a double"),
])
def test_every_broken_body_is_a_400_naming_the_problem(raw: bytes, code: str, says: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode_body(raw)
    assert (caught.value.status, caught.value.code) == (400, code)
    assert says in caught.value.message


def test_an_escaped_surrogate_pair_is_a_character() -> None:
    """What json.dumps writes for an emoji by default: a pair, read as the one character it encodes."""
    assert decode_body(b'{"text": "Shipped \\ud83d\\ude80"}') == {"text": "Shipped \U0001F680"}


@pytest.mark.parametrize("raw", [
    '{"model": "m", "text": "ü 🚀"}'.encode("utf-8-sig"),  # a byte-order mark
    '{"model": "m", "text": "ü 🚀"}'.encode("utf-16"),
])
def test_the_rarer_valid_encodings_still_read(raw: bytes) -> None:
    """Valid JSON that the fast reader refuses (a BOM, UTF-16) is read by the stdlib's, as before."""
    assert decode_body(raw) == {"model": "m", "text": "ü 🚀"}


def test_big_integers_and_floats_read_exactly() -> None:
    assert decode_body(b'{"seed": 123456789012345678901234567890, "t": 0.1, "n": -0.0}') == {
        "seed": 123456789012345678901234567890, "t": 0.1, "n": -0.0}
