"""stack.common.config: one-line errors naming file, key and problem."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from stack.common.config import ConfigError, build, check, read_file


@dataclass(frozen=True)
class Transfer:
    kv_port: int = 9100
    kv_buffer_size: float = 1e9

    def __post_init__(self) -> None:
        check(0 < self.kv_port < 65536, "kv_port", f"must be a TCP port (1-65535), got {self.kv_port}")


@dataclass(frozen=True)
class Engine:
    role: Literal["prefill", "decode", "both"] = "both"
    transfer: Transfer = field(default_factory=Transfer)
    endpoints: tuple[str, ...] = ()
    name: str | None = None


def test_defaults_and_article_number_strings() -> None:
    """Missing keys take defaults; the article's "8e9" string is a valid number."""
    engine = build(Engine, {"transfer": {"kv_buffer_size": "8e9"}, "endpoints": ["a", "b"]}, "c.json")
    assert engine == Engine(transfer=Transfer(kv_buffer_size=8e9), endpoints=("a", "b"))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"role": "x"}, "c.json: role: must be one of 'prefill', 'decode', 'both', got \"x\""),
        ({"transfer": {"kv_port": "91x0"}}, 'c.json: transfer.kv_port: expected an integer, got "91x0"'),
        ({"transfer": {"kv_port": True}}, "c.json: transfer.kv_port: expected an integer, got true"),
        ({"transfer": {"kv_port": 0}}, "c.json: transfer.kv_port: must be a TCP port (1-65535), got 0"),
        ({"colour": 1}, "c.json: colour: unknown key (known keys: endpoints, name, role, transfer)"),
        ({"endpoints": "a"}, 'c.json: endpoints: expected a list, got "a"'),
        ({"endpoints": ["a", 3]}, "c.json: endpoints[1]: expected a string, got 3"),
    ],
)
def test_errors_name_file_key_and_problem(data: dict, message: str) -> None:
    """Each kind of mistake gives exactly one line with file, dotted key and the problem."""
    with pytest.raises(ConfigError) as info:
        build(Engine, data, "c.json")
    assert str(info.value) == message


def test_read_file_syntax_errors(tmp_path) -> None:
    """Broken JSON/TOML and missing files become ConfigError naming the file and where."""
    bad_json = tmp_path / "config.json"
    bad_json.write_text('{"role": "prefill",\n "kv": }')
    with pytest.raises(ConfigError, match=r"config.json: invalid JSON at line 2 column 8"):
        read_file(bad_json)
    bad_toml = tmp_path / "settings.toml"
    bad_toml.write_text("[server]\nport = = 1\n")
    with pytest.raises(ConfigError, match=r"settings.toml: invalid TOML"):
        read_file(bad_toml)
    with pytest.raises(ConfigError, match=r"missing.toml: cannot read file"):
        read_file(tmp_path / "missing.toml")
    good = tmp_path / "ok.toml"
    good.write_text('[server]\nport = 8080\n')
    assert read_file(good) == {"server": {"port": 8080}}
