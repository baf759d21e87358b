"""Per-request KV caches and the block pool that hands them out under a byte budget.

Design: the pool counts fixed-size blocks of `block_size` tokens against `budget_bytes`. At admission
a request reserves blocks for everything it may ever hold (prompt + max_tokens) and gets one
contiguous `KVCache` of exactly that capacity, so a running request never needs more memory later:
admission either fits now, waits (`allocate` returns None), or is refused up front
(`can_ever_fit` is False). The pool therefore never over-allocates, at the price of reserving
memory for tokens that a request may not generate (no paging, no preemption).

The prefix cache (prefix_cache.py) keeps finished requests' full blocks in the blocks nobody
reserved: `take_block`/`give_blocks` move them, and `allocate` asks its `evictor` to free
unpinned cached blocks when a reservation would not fit otherwise.
"""

from __future__ import annotations

import numpy as np

from typing import Protocol

from stack.engine.errors import CacheCapacityError
from stack.engine.weights import ModelConfig

DTYPE = np.dtype(np.float32)


class KVCache:
    """K and V of one sequence: `k`, `v` are (n_layers, capacity, n_kv_heads, head_dim) float32.

    Positions [0, length) hold valid entries; `forward` writes new ones and advances `length`.
    K holds post-RoPE keys in the engine's interleaved head_dim order (see weights.py), not HF's
    rotate-half order: a cache is only meaningful to a model with the same fingerprint.
    """

    def __init__(self, config: ModelConfig, capacity: int, blocks: int = 0) -> None:
        shape = (config.n_layers, capacity, config.n_kv_heads, config.head_dim)
        self.config = config
        self.k = np.empty(shape, DTYPE)  # (n_layers, capacity, n_kv_heads, head_dim)
        self.v = np.empty(shape, DTYPE)  # (n_layers, capacity, n_kv_heads, head_dim)
        self.length = 0
        self.blocks = blocks  # blocks reserved in the owning pool; 0 once freed (or if unpooled)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the valid part (what a transfer ships)."""
        return self.length * self.config.kv_bytes_per_token

    def layer_nbytes(self, num_tokens: int | None = None) -> int:
        """Bytes of one layer's K+V for `num_tokens` (default: the valid length)."""
        n = self.length if num_tokens is None else num_tokens
        return 2 * n * self.config.n_kv_heads * self.config.head_dim * DTYPE.itemsize

    def layer_bytes(self, layer: int) -> bytes:
        """Layer `layer`'s valid K then V as raw little-endian float32 bytes (K block, then V block)."""
        n = self.length
        return self.k[layer, :n].tobytes() + self.v[layer, :n].tobytes()

    def to_layer_bytes(self) -> list[bytes]:
        """`layer_bytes` for every layer, in layer order."""
        return [self.layer_bytes(layer) for layer in range(self.config.n_layers)]

    def load_layer_bytes(self, layer: int, data: bytes | memoryview, num_tokens: int) -> None:
        """Fill layer `layer` positions [0, num_tokens) from `layer_bytes` output; checks the size.

        Call it for every layer, then `set_length(num_tokens)`; the decode side rebuilds a cache
        this way inside a block it allocated from its own pool.
        """
        expected = self.layer_nbytes(num_tokens)
        if len(data) != expected:
            raise ValueError(f"layer {layer}: got {len(data)} bytes, expected {expected} for {num_tokens} tokens")
        if num_tokens > self.capacity:
            raise CacheCapacityError(f"{num_tokens} tokens exceed this cache's capacity {self.capacity}")
        flat = np.frombuffer(data, dtype=DTYPE)  # (2 * num_tokens * n_kv_heads * head_dim,)
        kv = flat.reshape(2, num_tokens, self.config.n_kv_heads, self.config.head_dim)  # (2, T, KV, hd)
        self.k[layer, :num_tokens] = kv[0]
        self.v[layer, :num_tokens] = kv[1]

    def set_length(self, num_tokens: int) -> None:
        """Declare positions [0, num_tokens) valid (after `load_layer_bytes` on every layer)."""
        assert 0 <= num_tokens <= self.capacity, f"length {num_tokens} outside [0, {self.capacity}]"
        self.length = num_tokens

    @classmethod
    def from_layer_bytes(cls, config: ModelConfig, layers: list[bytes], num_tokens: int, capacity: int) -> KVCache:
        """An unpooled cache of `capacity` rebuilt from `to_layer_bytes` output (tests, tools)."""
        if len(layers) != config.n_layers:
            raise ValueError(f"got {len(layers)} layers, the model has {config.n_layers}")
        cache = cls(config, capacity)
        for layer, data in enumerate(layers):
            cache.load_layer_bytes(layer, data, num_tokens)
        cache.set_length(num_tokens)
        return cache


class Evictor(Protocol):
    """What the pool asks for room: the prefix cache."""

    @property
    def evictable(self) -> int: ...

    def evict(self, wanted: int) -> int: ...


class KVPool:
    """Fixed-size blocks counted against a byte budget; see the module docstring for the policy."""

    def __init__(self, config: ModelConfig, budget_bytes: int, block_size: int = 16) -> None:
        assert block_size > 0, f"block_size must be positive, got {block_size}"
        self.config = config
        self.block_size = block_size
        self.block_bytes = block_size * config.kv_bytes_per_token
        self.budget_bytes = budget_bytes
        self.total_blocks = budget_bytes // self.block_bytes
        self.free_blocks = self.total_blocks
        self.evictor: Evictor | None = None  # the prefix cache, whose unpinned blocks count as reclaimable

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    @property
    def used_bytes(self) -> int:
        return (self.total_blocks - self.free_blocks) * self.block_bytes

    @property
    def reclaimable_blocks(self) -> int:
        """Free blocks plus cached ones nobody pins: what a reservation could get now."""
        return self.free_blocks + (self.evictor.evictable if self.evictor is not None else 0)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """True if `num_tokens` fits the model's context and the whole (empty) pool."""
        return 0 < num_tokens <= self.config.max_seq_len and self.blocks_for(num_tokens) <= self.total_blocks

    def check_fits(self, num_tokens: int) -> None:
        """Raise `CacheCapacityError` naming the numbers if `num_tokens` can never fit."""
        if num_tokens > self.config.max_seq_len:
            raise CacheCapacityError(
                f"{num_tokens} tokens exceed the model's max_seq_len {self.config.max_seq_len}"
            )
        if not self.can_ever_fit(num_tokens):
            raise CacheCapacityError(
                f"{num_tokens} tokens need {self.blocks_for(num_tokens) * self.block_bytes} bytes of KV; "
                f"the pool holds {self.total_blocks * self.block_bytes} (budget {self.budget_bytes})"
            )

    def allocate(self, num_tokens: int) -> KVCache | None:
        """A cache with capacity for `num_tokens` (rounded up to whole blocks), or None if the pool
        lacks room right now. Raises `CacheCapacityError` if it could never fit."""
        self.check_fits(num_tokens)
        blocks = self.blocks_for(num_tokens)
        if blocks > self.free_blocks:
            short = blocks - self.free_blocks
            if self.evictor is None or self.evictor.evictable < short:  # evict nothing for a reservation that still would not fit
                return None
            self.evictor.evict(short)
        self.free_blocks -= blocks
        return KVCache(self.config, blocks * self.block_size, blocks)

    def free(self, cache: KVCache) -> None:
        """Return `cache`'s blocks to the pool; freeing twice is a no-op."""
        self.free_blocks += cache.blocks
        assert self.free_blocks <= self.total_blocks, f"pool overflow: {self.free_blocks} > {self.total_blocks}"
        cache.blocks = 0

    def take_block(self) -> bool:
        """One block for the prefix cache: a free one, else an evicted older cached one; False if none."""
        if self.free_blocks == 0 and (self.evictor is None or self.evictor.evict(1) == 0):
            return False
        self.free_blocks -= 1
        return True

    def give_blocks(self, count: int) -> None:
        """The prefix cache evicted `count` blocks."""
        self.free_blocks += count
        assert self.free_blocks <= self.total_blocks, f"pool overflow: {self.free_blocks} > {self.total_blocks}"
