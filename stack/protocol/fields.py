"""Typed reads of a JSON body's fields; every mistake is an `InvalidRequest` naming the field.

The wording is OpenAI's ("Missing required parameter: 'x'.", "Invalid type for 'x': …",
"Invalid value for 'x': …"), which SDK users and our tests see. A null is the same as an absent
field unless the field is required. `labels` renames fields in messages: an API translated into
a chat request (Anthropic `stop_sequences` → `stop`) still names the field its client sent.
"""

from __future__ import annotations

import json

import math
from collections.abc import Mapping
from typing import Any

from stack.common.errors import InvalidRequest
from stack.protocol.bounds import Bound

_MISSING = object()
_EXPECTED = {"int": "an integer", "number": "a number", "bool": "true or false", "strings": "a string or an array of strings",
             "token_ids": "an array of token ids", "token_bias": "an object mapping token ids to numbers"}


def json_type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def lone_surrogate(value: Any, where: str = "") -> tuple[str, int] | None:
    """(the field, the character index) of the first lone UTF-16 surrogate in any string of `value`
    (keys included), or None. JSON's "\\ud800" escapes decode to such code points; no tokenizer
    can encode them (not Unicode scalar values), so the contract refuses them before any engine does."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return where, exc.start
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate(key, where) or lone_surrogate(item, f"{where}.{key}" if where else key)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := lone_surrogate(item, f"{where}[{i}]"):
                return found
    return None


def check_unicode(value: Any, where: str = "", labels: Mapping[str, str] | None = None) -> None:
    """The 400 naming the field that holds a lone surrogate (see `lone_surrogate`); `labels` renames the field as
    the client's API calls it. One C-level encode says whether there is one; only then does the walk name it."""
    try:
        (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)).encode("utf-8")
        return
    except (UnicodeEncodeError, TypeError, ValueError):  # TypeError/ValueError: not JSON data; the walk decides
        pass
    found = lone_surrogate(value, where)
    if found is not None:
        field, index = found
        field = (labels or {}).get(field, field)
        raise InvalidRequest(f"Invalid value for '{field or 'body'}': the text holds a lone UTF-16 surrogate at character {index}, "
                             "which is not valid Unicode (a character cut in half?); send well-formed text.",
                             param=field or None, code="invalid_value")


class Fields:
    """Typed access to one JSON object's fields (`prefix` names where it sits, e.g. "stream_options.")."""

    def __init__(self, body: dict[str, Any], prefix: str = "", labels: Mapping[str, str] | None = None) -> None:
        self.body = body
        self.prefix = prefix
        self.labels = labels or {}

    def label(self, name: str) -> str:
        return f"{self.prefix}{self.labels.get(name, name)}"

    def _get(self, name: str, required: bool) -> Any:
        value = self.body.get(name, _MISSING)
        if value is _MISSING or value is None:
            if required:
                raise InvalidRequest(f"Missing required parameter: '{self.label(name)}'.", param=self.label(name),
                                     code="missing_required_parameter")
            return _MISSING
        return value

    def wrong(self, name: str, expected: str, value: Any) -> InvalidRequest:
        return InvalidRequest(f"Invalid type for '{self.label(name)}': expected {expected}, got a {json_type(value)}.",
                              param=self.label(name), code="invalid_type")

    def bad(self, name: str, problem: str, code: str = "invalid_value") -> InvalidRequest:
        return InvalidRequest(f"Invalid value for '{self.label(name)}': {problem}", param=self.label(name), code=code)

    def string(self, name: str, required: bool = False, default: str | None = None) -> str | None:
        value = self._get(name, required)
        if value is _MISSING:
            return default
        if not isinstance(value, str):
            raise self.wrong(name, "a string", value)
        check_unicode(value, self.label(name))
        return value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self._get(name, False)
        if value is _MISSING:
            return default
        if not isinstance(value, bool):
            raise self.wrong(name, "true or false", value)
        return value

    def integer(self, name: str, minimum: int, required: bool = False) -> int | None:
        value = self._get(name, required)
        if value is _MISSING:
            return None
        if not _is_int(value):
            raise self.wrong(name, "an integer", value)
        if value < minimum:
            raise self.bad(name, f"must be >= {minimum}, got {value}.")
        return value

    def obj(self, name: str, required: bool = False) -> dict[str, Any] | None:
        value = self._get(name, required)
        if value is _MISSING:
            return None
        if not isinstance(value, dict):
            raise self.wrong(name, "an object", value)
        return value

    def array(self, name: str, required: bool = False) -> list[Any] | None:
        value = self._get(name, required)
        if value is _MISSING:
            return None
        if not isinstance(value, list):
            raise self.wrong(name, "an array", value)
        return value

    def objects(self, name: str, required: bool = False) -> list[Fields]:
        """The array at `name` whose items are objects, each as Fields of its own (`name[i].key`)."""
        items = self.array(name, required) or []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                where = f"{self.label(name)}[{i}]"
                raise InvalidRequest(f"Invalid type for '{where}': expected an object.", param=where, code="invalid_type")
        return [Fields(item, f"{self.label(name)}[{i}].") for i, item in enumerate(items)]

    def nested(self, name: str, required: bool = False) -> Fields | None:
        """The object at `name` as Fields of its own (messages name its keys `name.key`)."""
        value = self.obj(name, required)
        return None if value is None else Fields(value, f"{self.label(name)}.")

    def bounded(self, bound: Bound) -> Any:
        """The field `bound` describes, checked against its row; None when unset.

        strings → tuple[str, ...]; token_ids → tuple[int, ...]; token_bias → tuple[(int, float), ...].
        """
        name = bound.name
        value = self._get(name, False)
        if value is _MISSING:
            return None
        kind = bound.value
        if kind == "bool":
            if not isinstance(value, bool):
                raise self.wrong(name, _EXPECTED[kind], value)
            return value
        if kind in ("int", "number"):
            if not (_is_int(value) if kind == "int" else _is_number(value)):
                raise self.wrong(name, _EXPECTED[kind], value)
            if not math.isfinite(value):
                raise self.bad(name, f"must be a finite number, got {value}.")
            if problem := bound.check(value):
                raise self.bad(name, problem)
            return value if kind == "int" else float(value)
        if kind == "strings":
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
                raise self.wrong(name, _EXPECTED[kind], value)
            if not all(items):
                raise self.bad(name, "sequences must not be empty strings.")
            if bound.max_items is not None and len(items) > bound.max_items:
                raise self.bad(name, f"at most {bound.max_items} sequences, got {len(items)}.")
            return tuple(items)
        if kind == "token_ids":
            if not isinstance(value, list) or not all(_is_int(t) for t in value):
                raise self.wrong(name, _EXPECTED[kind], value)
            if any(t < 0 for t in value):
                raise self.bad(name, f"token ids must be >= 0, got {min(value)}.")
            return tuple(value)
        return self._token_bias(bound, value)

    def _token_bias(self, bound: Bound, value: Any) -> tuple[tuple[int, float], ...]:
        name = bound.name
        if not isinstance(value, dict) or not all(_is_number(v) for v in value.values()):
            raise self.wrong(name, _EXPECTED["token_bias"], value)
        pairs = []
        for key, bias in value.items():
            if not key.isdigit():
                raise self.bad(name, f"keys must be token ids (digits), got {key!r}.")
            if not math.isfinite(bias) or (problem := bound.check(bias)):
                raise self.bad(name, f"the bias for token {key} {problem or 'must be a finite number.'}")
            pairs.append((int(key), float(bias)))
        return tuple(pairs)
