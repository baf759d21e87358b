"""Automatic prefix caching: full KV blocks kept after their request, found again by a hash chain.

A block is `block_size` consecutive tokens. Its hash covers its token ids and its parent's hash, and
the chain's root is the model fingerprint, so equal hashes mean "same model, same tokens at the same
positions from the start": the K/V are the same, and a block from another model can never match
(nano-vllm's block_manager.py, vLLM's automatic prefix caching). Only FULL blocks are cached.

Design: a cached block is a block of the paged pool (kv_cache.py), kept after its request by
reference, never copied: a hit puts the same block ids at the head of the new sequence's table. The
pool counts a reference per table and per pin; a cached block nobody holds is evictable, least
recently used first, when an admission needs room (`KVPool.allocate` calls `evict`). A pin holds a
block that is about to be shared: on a decode engine from the KV handshake (which announced the
block to prefill) until its decode request's table holds it.
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
    """One cached full block: its chain hash and where it lives in the pool."""

    hash: str
    id: int  # block id in the pool (its reference count is the pool's)


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

    def __init__(self, pool: KVPool, fingerprint: str, *, enabled: bool = True, metrics: EngineMetrics | None = None) -> None:
        self.pool = pool
        self.fingerprint = fingerprint
        self.enabled = enabled
        self.metrics = metrics or EngineMetrics()
        self.block_size = pool.block_size
        self.blocks: OrderedDict[str, Block] = OrderedDict()  # oldest use first
        pool.evictor = self

    def hashes(self, tokens: Sequence[int], known: Sequence[str] = ()) -> list[str]:
        return chain_hashes(self.fingerprint, tokens, self.block_size, known) if self.enabled else []

    @property
    def evictable(self) -> int:
        return self.pool.evictable_blocks

    @property
    def pinned(self) -> int:
        """Cached blocks some table or pin holds (never evicted)."""
        return len(self.blocks) - self.pool.evictable_blocks

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
        self.pool.hold([block.id for block in blocks])
        for block in blocks:
            self.blocks.move_to_end(block.hash)  # a use: the most recently used now

    def unpin(self, blocks: Sequence[Block]) -> None:
        self.pool.release([block.id for block in blocks])

    def allocate(self, num_tokens: int, hit: Sequence[Block]) -> KVCache | None:
        """`pool.allocate` whose table starts with the blocks of `hit`, shared (positions [0, len(hit) * block_size))."""
        for block in hit:
            self.blocks.move_to_end(block.hash)
        return self.pool.allocate(num_tokens, [block.id for block in hit])

    def record(self, queried: int, hit: int) -> None:
        """One admission's lookup: `queried` prompt tokens, `hit` of them served from the cache."""
        if self.enabled:
            self.metrics.on_prefix_lookup(queried, hit)

    # -- insertion and eviction --------------------------------------------------------------------

    def store(self, tokens: Sequence[int], cache: KVCache, hashes: Sequence[str] = ()) -> list[str]:
        """Keep every full block of `tokens` (positions [0, cache.length) of `cache`) not cached yet.

        The blocks stay where they are (the cache's own); they become evictable once no table holds
        them. Returns the hashes of all full blocks.
        """
        if not self.enabled:
            return []
        full = self.hashes(list(tokens[: cache.length]), hashes)
        for h, block in zip(full, cache.table.tolist()):
            if h in self.blocks:  # the same content in another block: this one stays private
                self.blocks.move_to_end(h)
                continue
            self.blocks[h] = Block(h, block)
            self.pool.set_cached(block, True)
        return full

    def evict(self, wanted: int) -> int:
        """Drop up to `wanted` cached blocks nobody holds, least recently used first (KVPool calls it); how many went."""
        victims = [b for b in self.blocks.values() if self.pool.refs[b.id] == 0][:wanted]
        for block in victims:
            del self.blocks[block.hash]
            self.pool.set_cached(block.id, False)
        if victims:
            self.metrics.on_prefix_evicted(len(victims))
        return len(victims)
