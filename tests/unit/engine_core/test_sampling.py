"""Token sampling: greedy, (seed, step) determinism, top-p support and temperature."""

from __future__ import annotations

import numpy as np

from stack.engine.sampling import sample

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))


def draws(temperature: float, top_p: float, n: int = 2000, seed: int = 7) -> np.ndarray:
    return np.array([sample(LOGITS, temperature, top_p, seed, step) for step in range(n)])


def test_temperature_zero_is_argmax() -> None:
    """temperature 0 picks the highest logit whatever the seed."""
    logits = np.array([0.1, 3.0, -2.0, 2.9], dtype=np.float32)
    assert {sample(logits, 0.0, 1.0, seed, step) for seed in (None, 1, 2) for step in range(5)} == {1}


def test_seed_and_step_fix_the_draw() -> None:
    """The same (seed, step) gives the same token in any order; other steps or seeds vary."""
    forward = [sample(LOGITS, 1.0, 1.0, 42, step) for step in range(50)]
    backward = [sample(LOGITS, 1.0, 1.0, 42, step) for step in reversed(range(50))][::-1]
    assert forward == backward
    assert len(set(forward)) > 1
    assert forward != [sample(LOGITS, 1.0, 1.0, 43, step) for step in range(50)]


def test_top_p_restricts_the_support() -> None:
    """top_p keeps the smallest most-likely set reaching p: 0.7 -> {0, 1}; 0.1 -> {0}."""
    assert set(draws(1.0, 0.7)) == {0, 1}
    assert set(draws(1.0, 0.1, n=200)) == {0}
    assert set(draws(1.0, 1.0)) == {0, 1, 2, 3}


def test_sampling_follows_the_tempered_distribution() -> None:
    """Frequencies match softmax(logits / temperature): low temperature concentrates, high flattens."""
    for temperature in (0.3, 1.0, 5.0):
        scaled = np.exp(LOGITS.astype(np.float64) / temperature)
        freq = np.bincount(draws(temperature, 1.0), minlength=4) / 2000
        np.testing.assert_allclose(freq, scaled / scaled.sum(), atol=0.04)
    assert (draws(0.3, 1.0) == 0).mean() > (draws(5.0, 1.0) == 0).mean() + 0.4
