"""Choosing the next token from logits: greedy, temperature and nucleus (top-p) sampling.

The random draw for a step is derived from `(seed, step)` alone, never from a running generator, so
a token sampled on the prefill instance followed by tokens sampled on the decode instance equals the
colocated run token for token: both sides only need to agree on the seed and the step index.
"""

from __future__ import annotations

import numpy as np


def sample(logits: np.ndarray, temperature: float, top_p: float, seed: int | None, step: int) -> int:
    """(vocab,) logits -> token id. Greedy when temperature == 0.

    `step` is the index of the generated token (0 for the first one, the one prefill produces).
    With `seed=None` the draw uses fresh OS entropy (not reproducible, as the OpenAI API allows).
    """
    assert logits.ndim == 1, f"sample expects (vocab,) logits, got shape {logits.shape}"
    assert temperature >= 0 and 0 < top_p <= 1, f"bad temperature {temperature} / top_p {top_p}"
    if temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature  # (vocab,)
    probs = np.exp(scaled - scaled.max())  # (vocab,)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")  # (vocab,) most likely first; stable = deterministic ties
    sorted_probs = probs[order]  # (vocab,)
    cumulative = np.cumsum(sorted_probs)  # (vocab,)
    # Nucleus: the smallest prefix whose mass reaches top_p (always at least one token).
    keep = int(np.searchsorted(cumulative, top_p * cumulative[-1])) + 1
    kept = cumulative[: min(keep, len(order))]  # (k,)
    rng = np.random.default_rng(None if seed is None else [seed & 0xFFFFFFFFFFFFFFFF, step])
    choice = int(np.searchsorted(kept, rng.random() * kept[-1], side="right"))
    return int(order[min(choice, len(kept) - 1)])
