"""The live CLI's first request still has the recorded shape (tests/agents/fixtures/, written by record.py), and the
CLI, run as the tier runs it, connects to nothing but the server it was given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agents.claude_code import cli_version, structure
from tests.agents.record import FIXTURE, first_request

pytestmark = pytest.mark.agents
EXACT_SIZES = ("tools", "messages", "message_blocks")
SLACK = 0.25  # prose sizes move with the working directory, the date and the environment block


def test_the_first_request_has_the_recorded_shape(claude_binary: Path, tmp_path: Path) -> None:
    """Same CLI version, path, query, header names and values (secrets and session ids aside), the same body
    structure, the same tool and block counts, and prose sizes within 25%: else re-record (python -m tests.agents.record)."""
    recorded = json.loads(FIXTURE.read_text())
    assert cli_version(claude_binary) == recorded["cli_version"], "scripts/claude-code.sh moved the pin: re-record the fixture"
    live, connects, _ = first_request(claude_binary, tmp_path)
    assert (live["method"], live["path"], live["query"]) == (recorded["method"], recorded["path"], recorded["query"])
    assert live["headers"] == recorded["headers"]
    assert structure(live["body"]) == structure(recorded["body"])
    for name, size in recorded["sizes"].items():
        if name in EXACT_SIZES:
            assert live["sizes"][name] == size, name
        else:
            assert abs(live["sizes"][name] - size) <= SLACK * size, (name, live["sizes"][name], size)
    assert connects and {address for address, _ in connects} == {"127.0.0.1"}, connects
