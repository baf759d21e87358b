"""stack.bench.dataset: ShareGPT files, the random set and synthetic length distributions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stack.bench.dataset import DatasetError, byte_count, load_sharegpt, random_requests, synthetic_sharegpt


def conversation(i: int, human: str, gpt: str) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}


@pytest.fixture
def sharegpt_file(tmp_path):
    records = [conversation(i, f"question number {i} about caches", "answer " * (i + 1)) for i in range(6)]
    records.append(conversation(90, "hi", "a long enough answer"))  # prompt < 4 tokens: dropped
    records.append(conversation(91, "a long enough question", "ok"))  # output < 4 tokens: dropped
    records.append({"id": "c92", "conversations": [{"from": "human", "value": "only one turn here"}]})
    records.append(conversation(93, "x" * 1100, "too long prompt"))  # prompt > 1024: dropped
    path = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def test_sharegpt_first_turn_is_prompt_second_is_output_budget(sharegpt_file) -> None:
    """Prompt = first turn, output budget = token count of the second; short/one-turn/long ones dropped."""
    samples = load_sharegpt(sharegpt_file, 6, np.random.default_rng(0))
    assert sorted(s.prompt for s in samples) == sorted(f"question number {i} about caches" for i in range(6))
    for s in samples:
        i = int(s.prompt.split()[2])
        assert s.prompt_len == byte_count(s.prompt)
        assert s.expected_output_len == len(("answer " * (i + 1)).encode())


def test_sharegpt_is_seeded_and_fixed_output_len(sharegpt_file) -> None:
    """The same seed gives the same order; `output_len` overrides the second turn's length."""
    first = load_sharegpt(sharegpt_file, 4, np.random.default_rng(7), output_len=16)
    again = load_sharegpt(sharegpt_file, 4, np.random.default_rng(7), output_len=16)
    assert first == again
    assert {s.expected_output_len for s in first} == {16}


def test_sharegpt_too_few_or_bad_file(sharegpt_file, tmp_path) -> None:
    """Asking for more usable conversations than exist, or a non-JSON file, is a DatasetError."""
    with pytest.raises(DatasetError, match="only 6 usable conversations, 7 requested"):
        load_sharegpt(sharegpt_file, 7, np.random.default_rng(0))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DatasetError, match="cannot read ShareGPT JSON"):
        load_sharegpt(bad, 1, np.random.default_rng(0))


def test_synthetic_exact_lengths_with_zero_spread() -> None:
    """sigma=0: every prompt is exactly input_mean byte tokens and every budget output_mean."""
    samples = synthetic_sharegpt(20, np.random.default_rng(0), input_mean=800, output_mean=128, sigma=0.0)
    assert {s.prompt_len for s in samples} == {800}
    assert {byte_count(s.prompt) for s in samples} == {800}
    assert {s.expected_output_len for s in samples} == {128}
    assert len({s.prompt for s in samples}) == 20  # different texts


def test_synthetic_length_distribution() -> None:
    """Log-normal lengths: mean ≈ input_mean, right-skewed (median < mean), within the clip bounds."""
    samples = synthetic_sharegpt(2000, np.random.default_rng(1), input_mean=800, output_mean=128, sigma=0.5)
    lengths = np.array([s.prompt_len for s in samples])
    # sd ≈ 0.53·800 ≈ 426, standard error ≈ 9.5; the 2048 clip trims ~1.7% of the tail (≈ −15).
    assert lengths.mean() == pytest.approx(800, abs=60)
    assert np.median(lengths) < lengths.mean()
    assert lengths.min() >= 4 and lengths.max() <= 2048
    outputs = np.array([s.expected_output_len for s in samples])
    assert outputs.mean() == pytest.approx(128, abs=12) and outputs.max() <= 512


def test_synthetic_pairs_always_fit_the_context() -> None:
    """No drawn request needs more than the total context (prompt + output): such pairs are drawn again, so a
    long-tailed set never sends a request the engine must refuse; the rest of the set is as drawn."""
    plain = synthetic_sharegpt(300, np.random.default_rng(2), input_mean=800, output_mean=128, sigma=0.5, max_total=10_000)
    assert max(s.prompt_len + s.expected_output_len for s in plain) > 1984  # the tail does cross the line
    fitted = synthetic_sharegpt(300, np.random.default_rng(2), input_mean=800, output_mean=128, sigma=0.5)
    assert max(s.prompt_len + s.expected_output_len for s in fitted) <= 1984
    for a, b in zip(plain, fitted):  # pairs that fit are untouched, at their place
        if a.prompt_len + a.expected_output_len <= 1984:
            assert (a.prompt_len, a.expected_output_len) == (b.prompt_len, b.expected_output_len)
    with pytest.raises(DatasetError, match="exceed"):
        synthetic_sharegpt(1, np.random.default_rng(0), input_mean=1900, output_mean=200)


def test_synthetic_counts_with_the_given_tokenizer() -> None:
    """With a tokenizer, lengths are in its tokens (a word counter here), not bytes."""
    words = lambda text: len(text.split())  # noqa: E731 — a stand-in tokenizer: one token per word
    samples = synthetic_sharegpt(5, np.random.default_rng(2), input_mean=50, sigma=0.0, count=words)
    assert {s.prompt_len for s in samples} == {50}
    assert all(words(s.prompt) == 50 for s in samples)


def test_random_set_lengths() -> None:
    """vLLM's random set: lengths uniform in len·(1±ratio); exact when ratio is 0."""
    exact = random_requests(10, np.random.default_rng(0), input_len=64, output_len=8)
    assert {(s.prompt_len, s.expected_output_len) for s in exact} == {(64, 8)}
    spread = random_requests(200, np.random.default_rng(0), input_len=100, output_len=10, range_ratio=0.5)
    assert min(s.prompt_len for s in spread) >= 50 and max(s.prompt_len for s in spread) <= 150
    assert len({s.prompt_len for s in spread}) > 20
