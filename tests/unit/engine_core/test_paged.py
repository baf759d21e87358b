"""Paged KV: block tables scattered over the pool, shared prefix blocks and key tiles all give the reference's
numbers (greedy tokens equal, logprobs within 1e-4); a wrong block table does not."""

from __future__ import annotations

import numpy as np
import pytest

from stack.engine import batched_decode
from stack.engine import model as model_module
from stack.engine.kv_cache import KVCache, KVPool
from stack.engine.model import Model, Segment, forward

from .reference import TINY, naive_logits

BS = 4
PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 9, 200, 17, 3, 99, 41, 7, 150]


def scattered_pool(blocks: int = 64) -> KVPool:
    """A pool whose free blocks are every other one, so new tables are runs of length 1: attention sees every
    block apart."""
    pool = KVPool(TINY, blocks * BS * TINY.kv_bytes_per_token, BS)
    fillers = [pool.allocate(BS) for _ in range(blocks)]
    for cache in fillers[::2]:
        pool.free(cache)  # type: ignore[arg-type]
    return pool


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def assert_matches_reference(got: np.ndarray, expected: np.ndarray) -> None:
    """Greedy tokens equal and log-probabilities within 1e-4."""
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    np.testing.assert_allclose(log_softmax(got), log_softmax(expected), rtol=0, atol=1e-4)


def test_scattered_tables_match_the_reference(tiny_model: Model, tiny_tensors: dict) -> None:
    """Prefill and decode through a table of non-consecutive blocks give the naive reference's logits."""
    pool = scattered_pool()
    cache = pool.allocate(len(PROMPT) + 4)
    assert cache is not None and len(cache.runs(cache.capacity)) == cache.blocks  # every block is its own run
    logits = forward(tiny_model, [Segment(np.array(PROMPT), cache, 0)], all_logits=True)[0]
    assert_matches_reference(logits, naive_logits(TINY, tiny_tensors, PROMPT))
    tokens = list(PROMPT)
    for token in (5, 99, 250):
        step = forward(tiny_model, [Segment(np.array([token]), cache, cache.length)])[0]
        tokens.append(token)
        assert_matches_reference(step, naive_logits(TINY, tiny_tensors, tokens)[-1])


@pytest.mark.parametrize("attention", ["numba", "numpy"])
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_decode_over_scattered_tables_equals_one_by_one(tiny_model: Model, monkeypatch: pytest.MonkeyPatch,
                                                                threads: int, attention: str) -> None:
    """One step over 10 sequences whose blocks interleave in the pool equals each decoding alone in its own cache
    (the kernel's one call, and numpy's tasks split over the threads)."""
    monkeypatch.setattr(model_module, "attention_threads", lambda: threads)
    monkeypatch.setattr(model_module, "PARALLEL_MIN_KEYS", 0)
    rng = np.random.default_rng(7)
    histories = [list(rng.integers(0, 256, int(n))) for n in rng.integers(2, 30, 10)]
    pool = scattered_pool(240)
    caches = [pool.allocate(40) for _ in histories]
    forward(tiny_model, [Segment(np.array(h), c, 0) for c, h in zip(caches, histories)])  # type: ignore[arg-type]
    assert all(len(c.runs(c.capacity)) == c.blocks for c in caches)  # type: ignore[union-attr]
    batched = forward(tiny_model, [Segment(np.array([7]), c, c.length) for c in caches], attention=attention)  # type: ignore[union-attr]
    for row, history in zip(batched, histories):
        alone = KVCache(TINY, 40)
        forward(tiny_model, [Segment(np.array(history), alone, 0)])
        expected = forward(tiny_model, [Segment(np.array([7]), alone, alone.length)])[0]
        np.testing.assert_allclose(row, expected, rtol=1e-5, atol=1e-5)


def test_shared_prefix_blocks_continue_like_a_full_prefill(tiny_model: Model, tiny_tensors: dict) -> None:
    """A second table that starts with the first one's full blocks (by reference) computes only its own rest."""
    pool = scattered_pool()
    first = pool.allocate(len(PROMPT))
    assert first is not None
    forward(tiny_model, [Segment(np.array(PROMPT), first, 0)])
    shared = first.table[:3].tolist()
    second = pool.allocate(len(PROMPT) + 8, shared)
    assert second is not None and second.table[:3].tolist() == shared
    assert pool.refs[shared].tolist() == [2, 2, 2]
    tail = PROMPT[3 * BS :] + [1, 2, 3]
    second.set_length(3 * BS)
    logits = forward(tiny_model, [Segment(np.array(tail), second, 3 * BS)], all_logits=True)[0]
    assert_matches_reference(logits, naive_logits(TINY, tiny_tensors, PROMPT[: 3 * BS] + tail)[3 * BS :])
    np.testing.assert_array_equal(second.k[:, : 3 * BS], first.k[:, : 3 * BS])  # the very same blocks
    pool.free(first)
    pool.free(second)
    assert pool.refs.sum() == 32 and pool.free_blocks == 32  # only the scattered fillers remain


def test_key_tiles_and_query_blocks_match_the_reference(tiny_model: Model, tiny_tensors: dict,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The online softmax over many small key tiles (crossing block runs) equals the one-tile softmax (numpy's path:
    the kernel has no tiles)."""
    monkeypatch.setattr("stack.engine.attention.KEY_BLOCK", 3)
    monkeypatch.setattr("stack.engine.attention.THIN_KEY_BLOCK", 5)
    monkeypatch.setattr("stack.engine.attention.QUERY_BLOCK", 4)
    monkeypatch.setattr("stack.engine.attention.THIN_QUERIES", 4)
    cache = scattered_pool().allocate(len(PROMPT) + 2)
    assert cache is not None
    logits = forward(tiny_model, [Segment(np.array(PROMPT), cache, 0)], all_logits=True, attention="numpy")[0]
    assert_matches_reference(logits, naive_logits(TINY, tiny_tensors, PROMPT))
    step = forward(tiny_model, [Segment(np.array([11]), cache, cache.length)], attention="numpy")[0]
    assert_matches_reference(step, naive_logits(TINY, tiny_tensors, PROMPT + [11])[-1])


@pytest.mark.parametrize("attention", ["numba", "numpy"])
def test_a_wrong_block_table_is_caught(tiny_model: Model, tiny_tensors: dict, attention: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A table entry pointing at the wrong block (block 0's keys read twice, block 1's lost) makes the next decode
    step disagree with the reference: attention (the kernel and numpy alike) really reads keys through the table.
    (Swapping two entries would not show: attention is blind to the order of its keys, their positions are in the
    RoPE'd K.)"""
    monkeypatch.setattr(batched_decode, "MIN_SEGMENTS", 1)  # the kernel takes a lone sequence too
    cache = scattered_pool().allocate(len(PROMPT) + 1)
    assert cache is not None
    forward(tiny_model, [Segment(np.array(PROMPT), cache, 0)], attention="numpy")
    cache.table[1] = cache.table[0]
    step = forward(tiny_model, [Segment(np.array([11]), cache, cache.length)], attention=attention)[0]
    with pytest.raises(AssertionError):
        assert_matches_reference(step, naive_logits(TINY, tiny_tensors, PROMPT + [11])[-1])


def test_paged_views_read_and_write_across_runs() -> None:
    """`cache.k[layer, a:b]` gathers across runs (what the KV hand-off sends); writes land in the right blocks."""
    cache = scattered_pool().allocate(20)
    assert cache is not None
    data = np.arange(TINY.n_layers * 20 * TINY.n_kv_heads * TINY.head_dim, dtype=np.float32).reshape(TINY.n_layers, 20, TINY.n_kv_heads, TINY.head_dim)
    cache.k[:, :20] = data
    np.testing.assert_array_equal(cache.k[1, 3:17], data[1, 3:17])
    np.testing.assert_array_equal(cache.k[:, 5], data[:, 5])
    block, row = cache.table[13 // BS], 13 % BS
    np.testing.assert_array_equal(cache.pool.k[0, block, row], data[0, 13])


LONG = 120  # tokens of the long prompt the small_tiles fixture cuts into many blocks and tiles


def assert_long_prompt_matches_reference(model: Model, tensors: dict, seed: int, attention: str = "numba") -> None:
    """A LONG-token prompt through one forward: the naive reference's logits at every position."""
    prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 256, LONG)]
    logits = forward(model, [Segment(np.array(prompt), KVCache(TINY, LONG), 0)], all_logits=True, attention=attention)[0]
    assert_matches_reference(logits, naive_logits(TINY, tensors, prompt))


@pytest.mark.usefixtures("small_tiles")
def test_long_prompt_scores_stay_tile_sized(tiny_model: Model, tiny_tensors: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded memory: a 120-token prompt's attention never holds more scores than a (query block x key tile), yet
    equals the reference."""
    from stack.engine import attention as attention_module

    sizes: list[int] = []
    fold = attention_module.online_softmax

    def recording(state, scores, v, ops=attention_module.NUMPY):  # type: ignore[no-untyped-def]
        sizes.append(scores.size)
        return fold(state, scores, v, ops)

    monkeypatch.setattr(attention_module, "online_softmax", recording)
    assert_long_prompt_matches_reference(tiny_model, tiny_tensors, seed=3, attention="numpy")
    G = TINY.n_heads // TINY.n_kv_heads
    assert max(sizes) <= 16 * G * 32 < LONG * LONG
