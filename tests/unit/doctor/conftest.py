"""Doctor unit-test fixtures: the log bundles, a clean client environment and a tmp home."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from doctor.environment import RELEVANT_PREFIXES
from tests.unit.doctor.scenarios import write_bundles

RECORDED = Path(__file__).parent / "bundles"  # client output and logs recorded from a real stack


@pytest.fixture(scope="session")
def bundles(tmp_path_factory) -> Path:
    """A folder with every bundle: the scenarios written by real log calls (scenarios.py) and the recorded files."""
    folder = tmp_path_factory.mktemp("bundles")
    for path in RECORDED.iterdir():
        if path.suffix in (".log", ".txt"):
            shutil.copy(path, folder)
    return write_bundles(folder)


@pytest.fixture(autouse=True)
def clean_client_env(monkeypatch, tmp_path):
    """No proxy/key/base-URL variable of the machine running the tests leaks into a diagnosis."""
    for name in list(os.environ):
        if name.upper().startswith(RELEVANT_PREFIXES) or name == "NO_COLOR":
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
