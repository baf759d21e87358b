"""Fixtures for the compose integration tests: the image (built once) and one shared PD stack."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.compose_stack import Stack, ensure_image, start_stack, unique_project


@pytest.fixture(scope="session")
def app_image() -> None:
    """The app image, built (or found in the layer cache) once per session."""
    ensure_image()


@pytest.fixture(scope="session")
def pd_stack(app_image: None) -> Iterator[Stack]:
    """One disaggregated stack (decode → prefill → router, dummy:tiny) shared by the session."""
    stack = start_stack(unique_project("pdt-disagg"))
    try:
        yield stack
    finally:
        stack.stop()
