"""Is numpy the limit of batched decode attention? The engine's numpy path against a compiled paged kernel (numba).

A section of `python -m benchmarks.engine` (needs `pip install '.[kernels]'`; skipped without numba). For the
largest decode batch at each context, one layer's attention over the whole batch, reading every sequence's
blocks where they lie in the pool:
- numpy: the engine's own tasks (`attention.attention` per sequence, spread over the cores as `forward` does);
- numba: `paged_decode`, one compiled call, a `prange` over (sequence, KV head) walking the block table.
Both are checked equal (1e-4) before they are timed; each is printed against the layer's KV bytes over the
measured copy bandwidth. The engine keeps the numpy path: it is the reference its tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from benchmarks._common import Bench, best_time
from stack.engine import model as model_module
from stack.engine.attention import attention
from stack.engine.kv_cache import KVCache


def compile_kernel() -> Callable[..., None] | None:
    """`paged_decode` compiled by numba, or None when numba is not installed."""
    try:
        import numba
    except ImportError:
        return None

    @numba.njit(parallel=True, fastmath=True, cache=False)
    def paged_decode(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, tables: np.ndarray, lengths: np.ndarray,
                     out: np.ndarray) -> None:  # pragma: no cover - compiled
        """q (B, H, hd) scaled; k_pool, v_pool (blocks, bs, KV, hd) of one layer; tables (B, max_blocks); lengths (B,)
        -> out (B, H, hd): one decode query per sequence against its first lengths[b] positions."""
        B, H, hd = q.shape
        bs, KV = k_pool.shape[1], k_pool.shape[2]
        G = H // KV
        for task in numba.prange(B * KV):
            b, h = task // KV, task % KV
            S = lengths[b]
            scores = np.empty((G, S), np.float32)
            for p in range(S):  # K read once for the G query heads of the group
                block, row = tables[b, p // bs], p % bs
                for g in range(G):
                    acc = np.float32(0)
                    for d in range(hd):
                        acc += q[b, h * G + g, d] * k_pool[block, row, h, d]
                    scores[g, p] = acc
            for g in range(G):
                top = scores[g, 0]
                for p in range(1, S):
                    top = max(top, scores[g, p])
                total = np.float32(0)
                for p in range(S):
                    scores[g, p] = np.exp(scores[g, p] - top)
                    total += scores[g, p]
                for d in range(hd):
                    out[b, h * G + g, d] = 0
                for p in range(S):
                    block, row = tables[b, p // bs], p % bs
                    w = scores[g, p] / total
                    for d in range(hd):
                        out[b, h * G + g, d] += w * v_pool[block, row, h, d]

    return paged_decode


def numpy_decode(q: np.ndarray, caches: list[KVCache], layer: int) -> np.ndarray:
    """The engine's path for one layer: per-sequence attention, spread over the cores as `forward` spreads it."""
    out = np.empty_like(q)  # (B, H, hd)
    runs = [c.runs(c.length) for c in caches]

    def attend(group: list[int]) -> None:
        for j in group:
            out[j : j + 1] = attention(q[j : j + 1], caches[j].views(layer, caches[j].length, 0, runs[j]), caches[j].length - 1)

    groups = model_module.attention_groups([c.length for c in caches])
    list(model_module.attention_pool().map(attend, groups)) if len(groups) > 1 else attend(groups[0])
    return out


def compare(bench: Bench, caches: list[KVCache], label: str) -> None:
    """Time one layer's decode attention over `caches` both ways; print each against its bytes bound."""
    kernel = compile_kernel()
    if kernel is None:
        bench.report(f"{label}: numba paged kernel", "skipped", "pip install '.[kernels]' to evaluate it")
        return
    cfg, pool = bench.model.config, caches[0].pool
    q = np.random.default_rng(4).standard_normal((len(caches), cfg.n_heads, cfg.head_dim), dtype=np.float32)  # (B, H, hd)
    tables = np.stack([c.table for c in caches])  # (B, blocks)
    lengths = np.array([c.length for c in caches], np.int64)  # (B,)
    out = np.empty_like(q)
    scaled = q * np.float32(cfg.head_dim**-0.5)
    kernel(scaled, pool.k[0], pool.v[0], tables, lengths, out)  # compile, and check against the engine's path
    np.testing.assert_allclose(out, numpy_decode(q, caches, 0), rtol=1e-4, atol=1e-4)
    layer_bytes = int(lengths.sum()) * cfg.kv_bytes_per_token // cfg.n_layers  # K and V of one layer
    bound = layer_bytes / (bench.baselines["copy_gbps"] * 1e9)
    for arm, run in (("numpy", lambda: numpy_decode(q, caches, 0)),
                     ("numba", lambda: kernel(scaled, pool.k[0], pool.v[0], tables, lengths, out))):
        seconds = best_time(run, bench.repeat, bench.clock)
        bench.report(f"{label}: {arm} attention, one layer", f"{seconds * 1e3:8.2f} ms",
                     f"{bound / seconds:.2f} x its KV bytes bound ({bound * 1e3:.2f} ms)")
