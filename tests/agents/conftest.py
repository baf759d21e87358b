"""The agents tier: real agent CLIs, unchanged, against a loopback capture server and the real compose stack.

`claude_binary` installs the pinned Claude Code CLI once (scripts/claude-code.sh: from the package index, cached
outside .venv). `agents_stack` is the default disaggregated stack (the default model: the engines' config
checkpoint) whose router also takes claude-* model names, so both README routes run against one stack.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agents.claude_code import REPO, install
from tests.integration.compose_stack import DISAGGREGATED, Stack, ensure_image, start_stack, unique_project

OVERLAY = "tests/agents/compose.router-settings.yaml"
ALIASES_OFF = '# model_aliases = ["claude-*"]'
ALIASES_ON = 'model_aliases = ["claude-*"]'


@pytest.fixture(scope="session")
def claude_binary() -> Path:
    return install()


def alias_settings(directory: Path) -> Path:
    """router/settings.toml as shipped, with README's `model_aliases = ["claude-*"]` line uncommented."""
    shipped = (REPO / "router" / "settings.toml").read_text()
    assert ALIASES_OFF in shipped, f"router/settings.toml no longer has the line {ALIASES_OFF!r} that README tells users to uncomment"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "settings.toml").write_text(shipped.replace(ALIASES_OFF, ALIASES_ON, 1))
    return directory


@pytest.fixture(scope="module")
def agents_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    ensure_image()
    settings = alias_settings(tmp_path_factory.mktemp("router-config"))
    settings.chmod(0o755)  # the router's user in the container reads it
    stack = start_stack(unique_project("pdt-agents"), files=(*DISAGGREGATED, OVERLAY),
                        env={"PD_CHECKPOINT": None, "PD_TEST_ROUTER_CONFIG_DIR": str(settings)})
    try:
        yield stack
    finally:
        stack.stop()
