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
