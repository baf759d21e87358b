"""The encoders made once (stack/common/json_text.py) write what json.dumps writes with the same options."""

from __future__ import annotations

import json

import pytest

from stack.common import json_text

VALUES = [
    {"model": "m", "messages": [{"role": "user", "content": "é€ \\ \" \n \ud83d\ude80"}], "max_tokens": 4, "stream": False},
    {"nested": {"a": [1, 2.5, None, True, False, 10**30, -0.0]}, "": ""},
    "a lone \ud800 surrogate",
    [],
    3.25,
    None,
]


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("ensure_ascii", [True, False])
@pytest.mark.parametrize("compact", [True, False])
def test_same_text_as_json_dumps(value, ensure_ascii: bool, compact: bool) -> None:
    """Every option pair gives json.dumps' exact text, escapes and number forms included."""
    separators = (",", ":") if compact else None
    assert json_text.make(ensure_ascii=ensure_ascii, compact=compact)(value) == \
        json.dumps(value, ensure_ascii=ensure_ascii, separators=separators)


def test_default_and_refusal_are_json_dumps_own() -> None:
    """With `default` a foreign object is written through it; without, it is a TypeError, as json.dumps raises."""
    assert json_text.make(default=str)({"at": ValueError("x")}) == json.dumps({"at": ValueError("x")}, default=str)
    with pytest.raises(TypeError, match="not JSON serializable"):
        json_text.dumps({"at": object()})


@pytest.mark.parametrize("value", VALUES + [{"at": ValueError("x"), "tools": ["a", "b"], "e2e_ms": 12.34, "nested": {"": {}}}])
def test_log_text_is_json_dumps_text(value) -> None:
    """A log line's fields (json_text.text, msgspec's encoder and formatter) read as json.dumps writes them: the same
    spacing, escapes and numbers; a lone surrogate (msgspec refuses it) and `default=str` objects included."""
    assert json_text.text(value) == json.dumps(value, ensure_ascii=False, default=str)


def test_log_text_writes_the_same_values_where_its_text_differs() -> None:
    """Floats with an exponent are written msgspec's way: other text, the same number for any JSON reader."""
    value = {"big": 1e16, "small": 1.5e-7, "huge": 1.7976931348623157e308}
    assert json_text.text(value) == '{"big": 1e16, "small": 1.5e-7, "huge": 1.7976931348623157e308}'
    assert json.loads(json_text.text(value)) == value


@pytest.mark.parametrize("data", [json.dumps(value).encode() for value in VALUES] + [
    b"NaN", b'{"logprob": -Infinity}', b"1e400", b'"\\ud800"', b"\xef\xbb\xbf{}", b'{"a": 1, "a": 2}', b"123456789012345678901234567890"])
def test_engine_json_reads_as_json_loads_reads_it(data: bytes) -> None:
    """An engine's answer or chunk (json_text.loads) gives what json.loads gives, what msgspec refuses included."""
    result, expected = json_text.loads(data), json.loads(data)
    assert result == expected or (result != result and expected != expected)  # NaN is not equal to itself


@pytest.mark.parametrize("data", [b"", b"{", b'{"a": }', b"[1, 2"])
def test_engine_json_that_does_not_parse_fails_as_json_loads_fails(data: bytes) -> None:
    """What does not parse raises json.loads' ValueError (the leg's failure, upstream.exception_failure)."""
    with pytest.raises(json.JSONDecodeError):
        json_text.loads(data)
