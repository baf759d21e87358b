"""Typed config loading shared by the engine (config.json) and the router (settings.toml).

A config file becomes frozen dataclasses in one call; any problem raises `ConfigError`, whose
one-line message names the file, the key (dotted path) and what is wrong:

    decode/config.json: kv_transfer_config.kv_port: expected an integer, got "91x0"

`build(cls, data, file)` checks unknown keys, types (int, float, bool, str, Literal, Optional,
nested dataclasses, list/tuple of those) and fills defaults. Value rules beyond types (ranges,
cross-field checks) live in each dataclass's `__post_init__`, raising `ConfigError` through
`fail(...)` helpers that carry the same file/key context.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(Exception):
    """A config file or environment value is invalid; the message is the single line to print."""

    def __init__(self, file: str | Path, key: str, problem: str) -> None:
        self.file, self.key, self.problem = str(file), key, problem
        super().__init__(f"{file}: {key}: {problem}" if key else f"{file}: {problem}")


def read_file(path: str | Path) -> dict[str, Any]:
    """Parse a .json or .toml file into a dict; syntax errors become ConfigError with the line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read file ({exc.strerror})") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(path, "", f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "", f"invalid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(path, "", f"expected an object at the top level, got {type(data).__name__}")
    return data


def _describe(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, int, float, bool)) or value is None else type(value).__name__


def _convert(tp: Any, value: Any, file: str, key: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, file, key)
            except ConfigError as exc:
                errors.append(exc.problem)
        raise ConfigError(file, key, errors[0] if len(errors) == 1 else f"expected one of {options}, got {_describe(value)}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(file, key, f"must be one of {', '.join(map(repr, allowed))}, got {_describe(value)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(file, key, f"expected a table/object, got {_describe(value)}")
        return build(tp, value, file, prefix=f"{key}.")
    if origin in (list, tuple):
        (item_tp, *_) = get_args(tp) or (Any,)
        if not isinstance(value, list):
            raise ConfigError(file, key, f"expected a list, got {_describe(value)}")
        return tuple(_convert(item_tp, v, file, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(file, key, f"expected a table/object, got {_describe(value)}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(file, key, f"expected true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(file, key, f"expected an integer, got {_describe(value)}")
        return value
    if tp is float:
        # The article writes sizes as strings like "8e9" and numbers like 8e9: accept both.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(file, key, f"expected a number, got {_describe(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(file, key, f"expected a string, got {_describe(value)}")
        return value
    raise TypeError(f"config field {key}: unsupported annotation {tp!r}")


def build(cls: type[T], data: dict[str, Any], file: str | Path, prefix: str = "") -> T:
    """Build dataclass `cls` from `data`, rejecting unknown keys and wrong types."""
    file = str(file)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(file, f"{prefix}{key}", f"unknown key (known keys: {known})")
    kwargs = {}
    for name, field in fields.items():
        key = f"{prefix}{name}"
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], file, key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(file, key, "required key is missing")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        # __post_init__ raised with a bare key: add this table's prefix and the file.
        raise ConfigError(file, exc.key if exc.key.startswith(prefix) else f"{prefix}{exc.key}", exc.problem) from None


def check(condition: bool, key: str, problem: str) -> None:
    """Use in __post_init__: raise ConfigError(file filled in by build) when condition is false."""
    if not condition:
        raise ConfigError("", key, problem)

