"""Automatic prefix caching: full KV blocks kept after their request, found again by a hash chain.

A block is `block_size` consecutive tokens. Its hash covers its token ids and its parent's hash, and
the chain's root is the model fingerprint, so equal hashes mean "same model, same tokens at the same
positions from the start": the K/V are the same, and a block from another model can never match
(nano-vllm's block_manager.py, vLLM's automatic prefix caching). Only FULL blocks are cached.

Design (measured in docs/architecture.md): each running sequence keeps its own contiguous float32
`KVCache`, so attention reads one array; cached blocks live beside them as (n_layers, block_size,
n_kv_heads, head_dim) arrays in `kv_dtype` and are COPIED into a new sequence's cache on a hit (a
memcpy per block, orders of magnitude cheaper than recomputing it). Paging would share the memory
instead, but every attention would then gather its keys through a block table.

Memory: cached blocks count against the same `KVPool` budget as the running sequences. They only
use blocks nobody reserved; when an admission needs room, the least recently used blocks whose
reference count is 0 are evicted (`KVPool.allocate` calls `evict`). A reference is held while a
block is about to be copied: across an admission's own eviction, and on a decode engine from the
KV handshake (which announced the block to prefill) until its decode request copies it in.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stack.engine.kv_cache import KVCache, KVPool
from stack.engine.metrics import EngineMetrics


@dataclass(eq=False)
class Block:
    """One cached full block: K and V of `block_size` positions for every layer, in the cache dtype."""

    hash: str
    k: np.ndarray  # (n_layers, block_size, n_kv_heads, head_dim)
    v: np.ndarray  # (n_layers, block_size, n_kv_heads, head_dim)
    refs: int = 0


def chain_hashes(fingerprint: str, tokens: Sequence[int], block_size: int, known: Sequence[str] = ()) -> list[str]:
    """The hash of every full block of `tokens`; `known` are already computed hashes of its first blocks."""
    out = list(known[: len(tokens) // block_size])
    parent = out[-1] if out else hashlib.blake2b(fingerprint.encode(), digest_size=16).hexdigest()
    ids = np.asarray(tokens, dtype=np.int64)
    for i in range(len(out), len(tokens) // block_size):
        parent = hashlib.blake2b(parent.encode() + ids[i * block_size : (i + 1) * block_size].tobytes(), digest_size=16).hexdigest()
        out.append(parent)
    return out


class PrefixCache:
    """Hash → cached block, in least-recently-used order; `enabled=False` caches nothing (same interface)."""

    def __init__(self, pool: KVPool, fingerprint: str, *, enabled: bool = True, dtype: str = "float32",
                 metrics: EngineMetrics | None = None) -> None:
        self.pool = pool
        self.fingerprint = fingerprint
        self.enabled = enabled
        self.dtype = np.dtype(dtype)
        self.metrics = metrics or EngineMetrics()
        self.block_size = pool.block_size
        self.blocks: OrderedDict[str, Block] = OrderedDict()  # oldest use first
        self.pinned = 0  # blocks with refs > 0 (never evicted)
        pool.evictor = self

    def hashes(self, tokens: Sequence[int], known: Sequence[str] = ()) -> list[str]:
        return chain_hashes(self.fingerprint, tokens, self.block_size, known) if self.enabled else []

    @property
    def evictable(self) -> int:
        return len(self.blocks) - self.pinned

    # -- lookup ----------------------------------------------------------------------------------

    def match(self, hashes: Sequence[str], limit: int | None = None) -> list[Block]:
        """The cached blocks of the longest cached prefix of `hashes` (at most `limit` blocks)."""
        found: list[Block] = []
        for h in hashes[:limit]:
            block = self.blocks.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def match_prompt(self, hashes: Sequence[str], num_tokens: int) -> list[Block]:
        """`match` for a prompt to compute: at least its last token is left, so its logits exist."""
        return self.match(hashes, (num_tokens - 1) // self.block_size)

    def pin(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            block.refs += 1
            self.pinned += block.refs == 1
            self.blocks.move_to_end(block.hash)  # a use: the most recently used now

    def unpin(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            assert block.refs > 0, f"block {block.hash} unpinned more often than pinned"
            block.refs -= 1
            self.pinned -= block.refs == 0

    def load(self, blocks: Sequence[Block], cache: KVCache) -> int:
        """Copy `blocks` into positions [0, len(blocks) * block_size) of `cache`; the number of tokens."""
        bs = self.block_size
        for i, block in enumerate(blocks):
            cache.k[:, i * bs : (i + 1) * bs] = block.k  # casts kv_dtype -> the cache's float32
            cache.v[:, i * bs : (i + 1) * bs] = block.v
        return len(blocks) * bs

    def allocate(self, num_tokens: int, hit: Sequence[Block]) -> KVCache | None:
        """`pool.allocate`, with the blocks of `hit` pinned so its evictions cannot take them."""
        self.pin(hit)
        try:
            return self.pool.allocate(num_tokens)
        finally:
            self.unpin(hit)

    def record(self, queried: int, hit: int) -> None:
        """One admission's lookup: `queried` prompt tokens, `hit` of them served from the cache."""
        if self.enabled:
            self.metrics.on_prefix_lookup(queried, hit)

    # -- insertion and eviction --------------------------------------------------------------------

    def store(self, tokens: Sequence[int], cache: KVCache, hashes: Sequence[str] = ()) -> list[str]:
        """Keep every full block of `tokens` (positions [0, cache.length) of `cache`) not cached yet.

        Takes free pool blocks, evicting older unpinned ones; stops at the first block that finds no
        room (its children would be unreachable without it). Returns the hashes of all full blocks.
        """
        if not self.enabled:
            return []
        full = self.hashes(list(tokens[: cache.length]), hashes)
        bs = self.block_size
        for i, h in enumerate(full):
            if h in self.blocks:
                self.blocks.move_to_end(h)
                continue
            if not self.pool.take_block():
                break
            span = slice(i * bs, (i + 1) * bs)
            self.blocks[h] = Block(h, cache.k[:, span].astype(self.dtype), cache.v[:, span].astype(self.dtype))
        return full

    def evict(self, wanted: int) -> int:
        """Free up to `wanted` unpinned blocks, least recently used first (KVPool calls it); how many went."""
        victims = [h for h, b in self.blocks.items() if b.refs == 0][:wanted]
        for h in victims:
            del self.blocks[h]
        self.pool.give_blocks(len(victims))
        if victims:
            self.metrics.on_prefix_evicted(len(victims))
        return len(victims)
