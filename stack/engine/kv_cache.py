"""The paged KV pool and its block tables: one preallocated pair of arrays, handed out block by block.

Design (vLLM's and nano-vllm's paging): `KVPool` owns K and V of every block as two arrays of shape
(n_layers, total_blocks, block_size, n_kv_heads, head_dim), a reference count per block and which
blocks the prefix cache holds. A sequence's `KVCache` is a block table into it: position p lives at
block `table[p // block_size]`, row `p % block_size`. A block is in use while a table or a pin refers
to it; a block the prefix cache holds with no reference left is evictable (prefix_cache.py keeps the
LRU order and the hashes); every other block is free.

At admission a request takes blocks for everything it may ever hold (prompt + max_tokens), sharing the
cached blocks of its prompt's prefix by reference, so a running request never needs memory later:
admission either fits now, waits (`allocate` returns None), or is refused up front (`can_ever_fit`).
Free blocks are taken lowest id first, so a fresh table is mostly runs of consecutive blocks; attention
reads each run as one contiguous view (`KVCache.runs`), with no gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from stack.engine.errors import CacheCapacityError
from stack.engine.weights import ModelConfig

DTYPE = np.dtype(np.float32)


class Evictor(Protocol):
    """What the pool asks for room: the prefix cache."""

    def evict(self, wanted: int) -> int: ...


class KVPool:
    """Fixed-size blocks under a byte budget, their reference counts and the arrays that hold them."""

    def __init__(self, config: ModelConfig, budget_bytes: int, block_size: int = 16) -> None:
        assert block_size > 0, f"block_size must be positive, got {block_size}"
        self.config = config
        self.block_size = block_size
        self.block_bytes = block_size * config.kv_bytes_per_token
        self.budget_bytes = budget_bytes
        self.total_blocks = budget_bytes // self.block_bytes
        shape = (config.n_layers, self.total_blocks, block_size, config.n_kv_heads, config.head_dim)
        # np.empty maps the budget without touching it: resident memory grows with the blocks used
        self.k = np.empty(shape, DTYPE)  # (n_layers, total_blocks, block_size, n_kv_heads, head_dim)
        self.v = np.empty(shape, DTYPE)
        self.refs = np.zeros(self.total_blocks, np.int32)  # (total_blocks,) tables and pins holding each block
        self.cached = np.zeros(self.total_blocks, bool)  # (total_blocks,) held by the prefix cache
        self.free_blocks = self.total_blocks  # refs == 0 and not cached
        self.evictable_blocks = 0  # refs == 0 and cached
        self.evictor: Evictor | None = None

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    @property
    def used_bytes(self) -> int:
        return (self.total_blocks - self.free_blocks) * self.block_bytes

    @property
    def reclaimable_blocks(self) -> int:
        """Free blocks plus cached ones nobody holds: what a reservation could get now."""
        return self.free_blocks + self.evictable_blocks

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

    def allocate(self, num_tokens: int, shared: Sequence[int] = ()) -> KVCache | None:
        """A cache with room for `num_tokens` (whole blocks) whose first blocks are `shared` (cached blocks,
        by reference), or None if the pool lacks room now. Raises `CacheCapacityError` if it never fits."""
        self.check_fits(num_tokens)
        self.hold(shared)  # the evictions below must not take them
        fresh = self.blocks_for(num_tokens) - len(shared)
        if fresh > self.free_blocks:
            short = fresh - self.free_blocks
            if self.evictor is None or self.evictable_blocks < short:  # evict nothing for what still would not fit
                self.release(shared)
                return None
            self.evictor.evict(short)
        taken = np.flatnonzero((self.refs == 0) & ~self.cached)[:fresh]  # lowest ids first: long consecutive runs
        self.hold(taken)
        return KVCache(self.config, 0, self, np.concatenate([np.asarray(shared, np.int64), taken]))

    def free(self, cache: KVCache) -> None:
        """Drop `cache`'s references to its blocks; freeing twice is a no-op."""
        assert cache.pool is self, "a cache goes back to the pool it came from"
        self.release(cache.table)
        cache.table = cache.table[:0]

    def hold(self, blocks: Sequence[int] | np.ndarray) -> None:
        """One more reference to each of `blocks` (a table's or a pin's)."""
        ids = np.asarray(blocks, np.int64)
        first = np.unique(ids[self.refs[ids] == 0])
        self.free_blocks -= int(np.count_nonzero(~self.cached[first]))
        self.evictable_blocks -= int(np.count_nonzero(self.cached[first]))
        np.add.at(self.refs, ids, 1)

    def release(self, blocks: Sequence[int] | np.ndarray) -> None:
        """One reference fewer to each of `blocks`; a block nobody holds becomes free, or evictable if cached."""
        ids = np.asarray(blocks, np.int64)
        np.subtract.at(self.refs, ids, 1)
        assert (self.refs[ids] >= 0).all(), "a block released more often than held"
        last = np.unique(ids[self.refs[ids] == 0])
        self.free_blocks += int(np.count_nonzero(~self.cached[last]))
        self.evictable_blocks += int(np.count_nonzero(self.cached[last]))

    def set_cached(self, block: int, cached: bool) -> None:
        """The prefix cache takes (True) or evicts (False) `block`; counts follow."""
        if self.cached[block] == cached:
            return
        self.cached[block] = cached
        if self.refs[block] == 0:
            step = 1 if cached else -1
            self.evictable_blocks += step
            self.free_blocks -= step


class KVCache:
    """K and V of one sequence: a block table into a `KVPool` (its own one-block pool when made directly).

    Positions [0, length) hold valid entries; `forward` writes new ones and advances `length`.
    K holds post-RoPE keys in the engine's interleaved head_dim order (see weights.py), not HF's
    rotate-half order: a cache is only meaningful to a model with the same fingerprint.
    `k` and `v` index like (n_layers, capacity, n_kv_heads, head_dim) arrays (`PagedView`).
    """

    def __init__(self, config: ModelConfig, capacity: int, pool: KVPool | None = None, table: np.ndarray | None = None) -> None:
        if pool is None:  # unpooled (tests, tools): one block of exactly `capacity` positions
            pool = KVPool(config, max(capacity, 1) * config.kv_bytes_per_token, max(capacity, 1))
            table = np.zeros(1, np.int64)
            pool.hold(table)
        assert table is not None, "a pooled cache needs its block table"
        self.config, self.pool, self.table = config, pool, table  # table: (blocks,) int64 block ids
        self.length = 0

    @property
    def k(self) -> PagedView:
        """K as an (n_layers, capacity, n_kv_heads, head_dim) view of the blocks (made per use: no reference cycle
        keeps a freed pool's memory alive until the garbage collector runs)."""
        return PagedView(self, self.pool.k)

    @property
    def v(self) -> PagedView:
        return PagedView(self, self.pool.v)

    @property
    def capacity(self) -> int:
        return len(self.table) * self.pool.block_size

    @property
    def blocks(self) -> int:
        """Blocks this cache holds in its pool; 0 once freed."""
        return len(self.table)

    def runs(self, end: int) -> list[tuple[int, int, int]]:
        """(first block id, first position, end position) of each run of consecutive block ids covering [0, end)."""
        bs = self.pool.block_size
        table = self.table[: -(-end // bs)]
        if not len(table):
            return []
        breaks = np.flatnonzero(np.diff(table) != 1) + 1  # where a run starts anew
        starts = [0, *breaks.tolist()]
        ends = [*breaks.tolist(), len(table)]
        return [(int(table[a]), a * bs, min(b * bs, end)) for a, b in zip(starts, ends)]

    def spans(self, end: int, start: int = 0, runs: list[tuple[int, int, int]] | None = None) -> list[tuple[slice, slice, int]]:
        """Where positions [start, end) lie: per run, (pool block slice, row slice within those blocks' rows,
        first position). `runs` is `runs(end)` when the caller has it (a step computes them once for all layers)."""
        bs, out = self.pool.block_size, []
        for block, lo, hi in self.runs(end) if runs is None else runs:
            if hi <= start or lo >= end:
                continue
            hi, a = min(hi, end), max(start, lo)
            out.append((slice(block, block + (-(-hi // bs) - lo // bs)), slice(a - lo, hi - lo), a))
        return out

    def views(self, layer: int, end: int, start: int = 0,
              runs: list[tuple[int, int, int]] | None = None) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """Layer `layer`'s positions [start, end) as (K, V, first position) views, one per run."""
        shape = (-1, self.config.n_kv_heads, self.config.head_dim)  # (positions, KV, hd)
        return [(self.pool.k[layer, blocks].reshape(shape)[rows], self.pool.v[layer, blocks].reshape(shape)[rows], a)
                for blocks, rows, a in self.spans(end, start, runs)]

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray,
              runs: list[tuple[int, int, int]] | None = None) -> None:
        """Store (T, n_kv_heads, head_dim) K and V at positions [start, start + T) of layer `layer`."""
        if len(k) == 1:  # a decode token: one row of one block
            block, row = self.table[start // self.pool.block_size], start % self.pool.block_size
            self.pool.k[layer, block, row], self.pool.v[layer, block, row] = k[0], v[0]
            return
        for kd, vd, pos in self.views(layer, start + len(k), start, runs):
            kd[...] = k[pos - start : pos - start + len(kd)]
            vd[...] = v[pos - start : pos - start + len(vd)]

    def head(self, num_tokens: int) -> tuple[PagedView, PagedView]:
        """K and V of positions [0, num_tokens) as views that read the blocks only when indexed (no copy now)."""
        return PagedView(self, self.pool.k, num_tokens), PagedView(self, self.pool.v, num_tokens)

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

        Call it for every layer, then `set_length(num_tokens)`.
        """
        expected = self.layer_nbytes(num_tokens)
        if len(data) != expected:
            raise ValueError(f"layer {layer}: got {len(data)} bytes, expected {expected} for {num_tokens} tokens")
        if num_tokens > self.capacity:
            raise CacheCapacityError(f"{num_tokens} tokens exceed this cache's capacity {self.capacity}")
        flat = np.frombuffer(data, dtype=DTYPE)  # (2 * num_tokens * n_kv_heads * head_dim,)
        kv = flat.reshape(2, num_tokens, self.config.n_kv_heads, self.config.head_dim)  # (2, T, KV, hd)
        self.write(layer, 0, kv[0], kv[1])

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


class PagedView(np.lib.mixins.NDArrayOperatorsMixin):
    """`cache.k` / `cache.v`: indexes like an (n_layers, capacity, n_kv_heads, head_dim) array by
    [layers, positions] (an int or a step-1 slice each). A read is a view when the positions lie in one
    run of consecutive blocks, else a gathered copy; a write (`view[...] = x`) goes to the blocks.
    Arithmetic and numpy functions see the gathered whole."""

    def __init__(self, cache: KVCache, store: np.ndarray, length: int | None = None) -> None:
        self.cache, self.store, self.length = cache, store, length  # length: positions shown (default: capacity)
        self.dtype = store.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        cfg = self.cache.config
        return (cfg.n_layers, self.cache.capacity if self.length is None else self.length, cfg.n_kv_heads, cfg.head_dim)

    def _parts(self, key: object) -> list[np.ndarray]:
        """Per run, the ([L,] n, KV, hd) views of the keyed positions (an empty one for an empty range)."""
        layer, positions = (key if isinstance(key, tuple) else (key, slice(None)))
        if layer is Ellipsis:
            layer = slice(None)
        start, stop, step = (positions.indices(self.shape[1]) if isinstance(positions, slice)
                             else (positions, positions + 1, 1))
        assert step == 1, "positions are read in order"
        cfg, parts = self.cache.config, []
        for blocks, rows, _ in self.cache.spans(stop, start) or [(slice(0, 0), slice(0, 0), 0)]:
            run = self.store[layer, blocks]  # ([L,] blocks, bs, KV, hd)
            parts.append(run.reshape(*run.shape[:-4], -1, cfg.n_kv_heads, cfg.head_dim)[..., rows, :, :])  # ([L,] n, KV, hd)
        return parts

    def __getitem__(self, key: object) -> np.ndarray:
        parts = self._parts(key)
        out = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-3)
        return out[..., 0, :, :] if isinstance(key, tuple) and isinstance(key[1], int) else out

    def __setitem__(self, key: object, value: object) -> None:
        parts = self._parts(key)
        value = np.asarray(value, self.dtype)
        at = 0
        for part in parts:
            n = part.shape[-3]
            part[...] = value[..., at : at + n, :, :] if value.ndim >= 3 else value
            at += n

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: object, **kwargs: object) -> object:
        arrays = [np.asarray(x) if isinstance(x, PagedView) else x for x in inputs]
        return getattr(ufunc, method)(*arrays, **kwargs)

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        out = self[:, :]
        return out if dtype is None else out.astype(dtype)
