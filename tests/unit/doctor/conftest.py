"""Doctor unit-test fixtures: a clean client environment and a tmp home."""

from __future__ import annotations

import os

import pytest

from doctor.environment import RELEVANT_PREFIXES


@pytest.fixture(autouse=True)
def clean_client_env(monkeypatch, tmp_path):
    """No proxy/key/base-URL variable of the machine running the tests leaks into a diagnosis."""
    for name in list(os.environ):
        if name.upper().startswith(RELEVANT_PREFIXES) or name == "NO_COLOR":
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
