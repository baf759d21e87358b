"""Choosing the next token from logits: vLLM's logits processors, then greedy or top-k/top-p/min-p sampling.

The random draw for a step is derived from `(seed, step)` alone (plus the choice index for the
2nd..nth choice of a request), never from a running generator, so a token sampled on the prefill
instance followed by tokens sampled on the decode instance equals the colocated run token for token:
both sides only need to agree on the seed and the step index.

`adjust` applies, in vLLM's order (vllm/v1/sample/sampler.py): logit_bias, min_tokens (stop tokens
banned until then), repetition / frequency / presence penalties (vllm/model_executor/layers/utils.py
`apply_penalties`: repetition over prompt + output, the other two over output counts), and the
grammar mask. Logprobs are the raw model distribution (vLLM's default `logprobs_mode=raw_logprobs`).
"""

from __future__ import annotations

import numpy as np

from stack.engine.sequence import Sequence, TokenLogprob


def sample(logits: np.ndarray, temperature: float, top_p: float, seed: int | None, step: int, *,
           top_k: int = 0, min_p: float = 0.0, choice: int = 0) -> int:
    """(vocab,) logits -> token id. Greedy when temperature == 0.

    `step` is the index of the generated token (0 for the first one, the one prefill produces).
    `top_k` 0 or -1 = off; `min_p` 0 = off. With `seed=None` the draw uses fresh OS entropy.
    """
    assert logits.ndim == 1, f"sample expects (vocab,) logits, got shape {logits.shape}"
    assert temperature >= 0 and 0 < top_p <= 1, f"bad temperature {temperature} / top_p {top_p}"
    if temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature  # (vocab,)
    probs = np.exp(scaled - scaled.max())  # (vocab,)
    if top_k > 0 and top_k < len(probs):
        kth = np.partition(scaled, -top_k)[-top_k]  # the k-th largest logit
        probs[scaled < kth] = 0.0
    if min_p > 0:
        probs[probs < min_p * probs.max()] = 0.0  # probs.max() is 1 after the shift: min_p of the top token
    probs /= probs.sum()
    rng = np.random.default_rng(None if seed is None else [seed & 0xFFFFFFFFFFFFFFFF, step, *([choice] if choice else [])])
    if top_p >= 1:  # no nucleus: draw straight from the cumulative mass, no sort needed
        cumulative = np.cumsum(probs)  # (vocab,)
        return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"), len(probs) - 1))
    order = np.argsort(-probs, kind="stable")  # (vocab,) most likely first; stable = deterministic ties
    cumulative = np.cumsum(probs[order])  # (vocab,)
    # Nucleus: the smallest prefix whose mass reaches top_p (always at least one token).
    keep = int(np.searchsorted(cumulative, top_p * cumulative[-1])) + 1
    kept = cumulative[: min(keep, len(order))]  # (k,)
    pick = int(np.searchsorted(kept, rng.random() * kept[-1], side="right"))
    return int(order[min(pick, len(kept) - 1)])


def adjust(logits: np.ndarray, *, bias: tuple[tuple[int, float], ...] = (), banned: frozenset[int] | None = None,
           counts: np.ndarray | None = None, in_prompt: np.ndarray | None = None, repetition: float = 1.0,
           frequency: float = 0.0, presence: float = 0.0, allowed: np.ndarray | None = None) -> np.ndarray:
    """(vocab,) logits -> (vocab,) processed logits (a copy when anything applies).

    `counts` (vocab,) output token counts; `in_prompt` (vocab,) bool; `allowed` (vocab,) bool grammar mask.
    """
    out = logits.astype(np.float32, copy=True)  # (vocab,)
    for token, b in bias:
        out[token] += b
    if banned:
        out[list(banned)] = -np.inf
    if counts is not None:
        if repetition != 1.0:
            seen = counts > 0 if in_prompt is None else (counts > 0) | in_prompt  # (vocab,)
            out[seen] = np.where(out[seen] > 0, out[seen] / repetition, out[seen] * repetition)
        if frequency:
            out -= np.float32(frequency) * counts
        if presence:
            out -= np.float32(presence) * (counts > 0)
    if allowed is not None:
        out[~allowed] = -np.inf
    return out


def logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of `token` under softmax(logits), and the `top` most likely (id, logprob), best first."""
    x = logits.astype(np.float64)  # (vocab,)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    chosen = float(x[token] - lse)
    if top <= 0:
        return chosen, ()
    ids = np.argpartition(-x, min(top, len(x) - 1))[:top]  # (top,) unordered
    ids = ids[np.argsort(-x[ids], kind="stable")]
    return chosen, tuple((int(i), float(x[i] - lse)) for i in ids)


def next_token(seq: Sequence, row: np.ndarray, stop_ids: frozenset[int]) -> tuple[int, TokenLogprob | None]:
    """(vocab,) raw logits -> the next token of `seq` (and its logprobs if asked for); `stop_ids` are the
    tokenizer's end-of-sequence ids."""
    p, step = seq.params, len(seq.output)
    banned = None
    if step < p.min_tokens:  # vLLM's min_tokens: no EOS and no stop_token_ids yet
        banned = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else stop_ids)
    processed = row
    if p.logit_bias or banned or seq.counts is not None or seq.constraint is not None:
        processed = adjust(row, bias=p.logit_bias, banned=banned, counts=seq.counts, in_prompt=seq.in_prompt,
                           repetition=p.repetition_penalty, frequency=p.frequency_penalty, presence=p.presence_penalty,
                           allowed=None if seq.constraint is None else seq.constraint.allowed())
    token = sample(processed, p.temperature, p.top_p, seq.seed, step, top_k=p.top_k, min_p=p.min_p, choice=seq.choice)
    if p.logprobs is None:
        return token, None
    chosen, top = logprobs(row, token, p.logprobs)
    return token, TokenLogprob(token, chosen, top)
