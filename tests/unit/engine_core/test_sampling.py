"""Token sampling: greedy, (seed, step) determinism, top-p support and temperature."""

from __future__ import annotations

import numpy as np

import pytest

from stack.engine.sampling import adjust, logprobs, sample

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


def test_top_k_and_min_p_cut_the_support() -> None:
    """top_k=2 keeps the two most likely tokens; min_p=0.5 keeps those with p >= 0.5 * p_max (here 0 and 1)."""
    assert set(sample(LOGITS, 1.0, 1.0, 7, step, top_k=2) for step in range(500)) == {0, 1}
    assert set(sample(LOGITS, 1.0, 1.0, 7, step, min_p=0.5) for step in range(500)) == {0, 1}
    assert set(sample(LOGITS, 1.0, 1.0, 7, step, min_p=0.25) for step in range(500)) == {0, 1, 2}


def test_choices_draw_their_own_streams() -> None:
    """Choice 0 keeps the request's stream; choice 1 draws differently from the same seed."""
    first = [sample(LOGITS, 1.0, 1.0, 42, step) for step in range(50)]
    second = [sample(LOGITS, 1.0, 1.0, 42, step, choice=1) for step in range(50)]
    assert first != second and first == [sample(LOGITS, 1.0, 1.0, 42, step, choice=0) for step in range(50)]


def test_adjust_applies_vllm_processors() -> None:
    """logit_bias adds, banned ids go to -inf, penalties follow vLLM's formulas, the grammar mask leaves only allowed ids."""
    logits = np.array([2.0, -1.0, 0.5, 1.0], dtype=np.float32)
    counts = np.array([2, 1, 0, 0], np.int32)
    out = adjust(logits, bias=((2, 10.0),), banned=frozenset({3}))
    assert out[2] == 10.5 and out[3] == -np.inf and out[0] == 2.0
    rep = adjust(logits, counts=counts, in_prompt=np.array([False, False, True, False]), repetition=2.0)
    np.testing.assert_allclose(rep, [1.0, -2.0, 0.25, 1.0])  # positive / 2, negative * 2, unseen kept
    pen = adjust(logits, counts=counts, frequency=0.5, presence=1.0)
    np.testing.assert_allclose(pen, [2.0 - 1.0 - 1.0, -1.0 - 0.5 - 1.0, 0.5, 1.0])
    masked = adjust(logits, allowed=np.array([False, True, False, True]))
    assert int(np.argmax(masked)) == 3 and masked[0] == -np.inf


def test_logprobs_are_log_softmax_with_the_best_first() -> None:
    """The chosen token's logprob is log softmax; the top list is sorted best first."""
    chosen, top = logprobs(LOGITS, 2, 3)
    assert chosen == pytest.approx(np.log(0.15), abs=1e-6)
    assert [t for t, _ in top] == [0, 1, 2] and top[0][1] == pytest.approx(np.log(0.5), abs=1e-6)
