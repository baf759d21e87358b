"""Fixtures for the engine core tests (helpers and the naive reference live in reference.py)."""

from __future__ import annotations

import numpy as np
import pytest

from stack.engine.model import Model, load_model

from .reference import TINY, model_from_tensors, random_hf_tensors


@pytest.fixture(scope="session")
def tiny_tensors() -> dict[str, np.ndarray]:
    return random_hf_tensors(TINY, seed=1)


@pytest.fixture(scope="session")
def tiny_model(tiny_tensors: dict[str, np.ndarray]) -> Model:
    return model_from_tensors(TINY, tiny_tensors)


@pytest.fixture(scope="session")
def dummy_tiny() -> Model:
    return load_model("dummy:tiny", seed=0)


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """attention.py's blocks made small: a LONG-token prompt (test_paged.py) spans many 16-query blocks and 32-key
    tiles, the causal diagonal in some, the online softmax across the rest. THIN_QUERIES 8: 16-query blocks take the
    per-head path, as 128 do."""
    from stack.engine import attention

    monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
    monkeypatch.setattr(attention, "KEY_BLOCK", 32)
    monkeypatch.setattr(attention, "THIN_QUERIES", 8)
