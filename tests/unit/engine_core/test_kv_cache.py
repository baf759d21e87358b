"""The KV block pool (byte budget, wait/refuse, free) and the layer-by-layer byte helpers."""

from __future__ import annotations

import numpy as np
import pytest

from stack.engine.errors import CacheCapacityError
from stack.engine.kv_cache import KVCache, KVPool
from stack.engine.model import Model, Segment, forward

from .reference import TINY


def test_pool_counts_whole_blocks_under_the_budget() -> None:
    """The pool holds floor(budget / block bytes) blocks and rounds requests up to whole blocks."""
    block_bytes = 16 * TINY.kv_bytes_per_token
    pool = KVPool(TINY, budget_bytes=10 * block_bytes + block_bytes - 1, block_size=16)
    assert pool.total_blocks == pool.free_blocks == 10
    assert [pool.blocks_for(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]
    cache = pool.allocate(17)
    assert cache is not None and cache.capacity == 32 and cache.length == 0
    assert cache.k.shape == (TINY.n_layers, 32, TINY.n_kv_heads, TINY.head_dim)
    assert pool.free_blocks == 8


def test_pool_never_over_allocates_and_free_makes_room() -> None:
    """When the blocks run out allocate returns None (wait); freeing one request lets the next in."""
    pool = KVPool(TINY, budget_bytes=4 * 16 * TINY.kv_bytes_per_token, block_size=16)
    first, second = pool.allocate(40), pool.allocate(16)  # 3 blocks + 1 block
    assert first is not None and second is not None
    assert pool.free_blocks == 0
    assert pool.allocate(1) is None
    assert pool.used_bytes <= pool.budget_bytes
    pool.free(first)
    assert pool.free_blocks == 3
    pool.free(first)  # idempotent
    assert pool.free_blocks == 3
    third = pool.allocate(48)
    assert third is not None and pool.free_blocks == 0


def test_pool_refuses_what_can_never_fit() -> None:
    """Requests beyond the whole pool or the model's max_seq_len are refused with the numbers named."""
    pool = KVPool(TINY, budget_bytes=4 * 16 * TINY.kv_bytes_per_token, block_size=16)
    assert pool.can_ever_fit(64) and not pool.can_ever_fit(65)
    assert not KVPool(TINY, budget_bytes=10**9).can_ever_fit(TINY.max_seq_len + 1)
    with pytest.raises(CacheCapacityError, match=r"65 tokens need .* the pool holds"):
        pool.allocate(65)
    with pytest.raises(CacheCapacityError, match=f"max_seq_len {TINY.max_seq_len}"):
        KVPool(TINY, budget_bytes=10**9).allocate(TINY.max_seq_len + 1)
    assert pool.reclaimable_blocks == pool.total_blocks


def test_layer_bytes_round_trip_continues_identically(tiny_model: Model) -> None:
    """A cache shipped layer by layer and rebuilt elsewhere decodes exactly like the original."""
    prompt = np.array([256, 10, 20, 30, 40, 50, 60])
    original = KVCache(TINY, 16)
    forward(tiny_model, [Segment(prompt, original, 0)])
    layers = original.to_layer_bytes()
    assert [len(b) for b in layers] == [original.layer_nbytes()] * TINY.n_layers
    assert sum(map(len, layers)) == original.nbytes == len(prompt) * TINY.kv_bytes_per_token

    pool = KVPool(TINY, budget_bytes=10**7)
    rebuilt = pool.allocate(16)
    assert rebuilt is not None
    for layer, data in enumerate(layers):
        rebuilt.load_layer_bytes(layer, memoryview(data), len(prompt))
    rebuilt.set_length(len(prompt))
    step = np.array([77])
    expected = forward(tiny_model, [Segment(step, original, original.length)])
    got = forward(tiny_model, [Segment(step, rebuilt, rebuilt.length)])
    np.testing.assert_array_equal(got, expected)


def test_load_layer_bytes_checks_size_and_capacity() -> None:
    """Wrong byte counts and token counts beyond the capacity are rejected, naming the numbers."""
    cache = KVCache(TINY, 4)
    with pytest.raises(ValueError, match="got 10 bytes, expected"):
        cache.load_layer_bytes(0, b"\0" * 10, 2)
    too_many = bytes(KVCache(TINY, 8).layer_nbytes(8))
    with pytest.raises(CacheCapacityError, match="capacity 4"):
        cache.load_layer_bytes(0, too_many, 8)
    with pytest.raises(ValueError, match="got 1 layers"):
        KVCache.from_layer_bytes(TINY, [b""], 0, 4)
