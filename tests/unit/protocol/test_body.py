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
])
def test_every_broken_body_is_a_400_naming_the_problem(raw: bytes, code: str, says: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode_body(raw)
    assert (caught.value.status, caught.value.code) == (400, code)
    assert says in caught.value.message


def test_an_escaped_surrogate_pair_is_a_character() -> None:
    """What json.dumps writes for an emoji by default: a pair, read as the one character it encodes."""
    assert decode_body(b'{"text": "Shipped \\ud83d\\ude80"}') == {"text": "Shipped \U0001F680"}
