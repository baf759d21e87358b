"""The compiled decode attention (numba): every thin segment of a step against its paged KV, one call per layer.

numba is a long-kept JIT on PyPI (a NumFOCUS project, led by Anaconda): it compiles this plain-loop Python to
machine code with LLVM (its llvmlite wheel carries LLVM), with no C toolchain in the image. Why compiled: a
decode step's attention is some twenty small numpy calls per sequence and layer; at batch 32 their dispatch,
not memory, bounds the step. One call here walks every sequence's block table where the blocks lie in the
pool, a `prange` over (segment, KV head) tasks spread over the cores; each key and value is read once for the
G query heads of its group (and the T queries of a short segment), and the loops over head_dim are plain
float32 loops LLVM vectorises.

This module imports numba and nothing of the engine: the image compiles it into NUMBA_CACHE_DIR on its own
(Dockerfile), and batched_decode.py imports it only when the kernel is wanted. attention.py (numpy) stays
the reference; the tests compare the two.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numba
import numpy as np
from numba import prange

# The one signature compiled (eagerly, so no call ever compiles on a request; a call with other types raises
# TypeError): q (R, H, hd), K and V pools of one layer (blocks, bs, KV, hd), tables (B, blocks), starts (B,),
# offsets (B + 1,), out (R, H, hd); every array C-contiguous.
SIGNATURE = ("void(float32[:, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], int64[:, ::1], int64[::1], "
             "int64[::1], float32[:, :, ::1])")
# fastmath: the dot products and sums may be reassociated (vectorised); nothing here is inf or nan.
# nogil: the event loop and the KV socket keep running while a step attends.
OPTIONS = {"parallel": True, "fastmath": True, "nogil": True}


def paged_decode(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, tables: np.ndarray, starts: np.ndarray,
                 offsets: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """Causal GQA attention of B short segments over paged KV. q (R, H, hd) scaled queries, segment b's are rows
    [offsets[b], offsets[b+1]) at positions starts[b], starts[b]+1, …; k_pool, v_pool (blocks, bs, KV, hd) one
    layer of the pool; tables (B, blocks) each segment's block table -> out (R, H, hd). Query t of segment b sees
    positions [0, starts[b] + t] (its own included: forward wrote its K/V first). Query head h uses KV head
    h // G (HF repeat_kv)."""
    bs, KV, hd = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    G = q.shape[1] // KV
    B = starts.shape[0]
    for task in prange(B * KV):
        b, h = task // KV, task % KV
        first, T = offsets[b], offsets[b + 1] - offsets[b]
        rows = T * G  # query rows of this group: row t*G + g is query t, head h*G + g
        keys = starts[b] + T  # keys the last query sees
        qg = np.empty((rows, hd), np.float32)  # (rows, hd) the group's queries, contiguous
        for t in range(T):
            for g in range(G):
                for d in range(hd):
                    qg[t * G + g, d] = q[first + t, h * G + g, d]
        scores = np.empty((rows, keys), np.float32)  # (rows, keys)
        for i in range((keys + bs - 1) // bs):  # each key read once for every row of the group, block by block
            block = tables[b, i]
            for slot in range(min(bs, keys - i * bs)):
                for r in range(rows):
                    dot = np.float32(0)
                    for d in range(hd):
                        dot += qg[r, d] * k_pool[block, slot, h, d]
                    scores[r, i * bs + slot] = dot
        scale = np.empty(rows, np.float32)  # (rows,) 1 / softmax denominator
        for r in range(rows):
            seen = keys - T + r // G + 1  # causal: keys [0, starts[b] + t]
            top = scores[r, 0]
            for p in range(1, seen):
                top = max(top, scores[r, p])
            total = 0.0  # float64: a 64k-key sum keeps its digits
            for p in range(seen):
                e = np.exp(scores[r, p] - top)
                scores[r, p] = e
                total += e
            scale[r] = np.float32(1.0 / total)
        acc = np.zeros((rows, hd), np.float32)  # (rows, hd) unnormalised output
        for i in range((keys + bs - 1) // bs):  # each value read once for every row that sees it
            block = tables[b, i]
            for slot in range(min(bs, keys - i * bs)):
                p = i * bs + slot
                for r in range(rows):
                    if p <= keys - T + r // G:
                        w = scores[r, p]
                        for d in range(hd):
                            acc[r, d] += w * v_pool[block, slot, h, d]
        for r in range(rows):
            t, g = r // G, r % G
            for d in range(hd):
                out[first + t, h * G + g, d] = acc[r, d] * scale[r]


def compile_kernel(cache: bool = True) -> tuple[Callable[..., None], float, bool]:
    """(the compiled `paged_decode`, seconds it took, loaded from the on-disk cache). With `cache`, numba keeps the
    machine code in NUMBA_CACHE_DIR (else __pycache__ beside this file); raises RuntimeError if no such directory is
    writable (a read-only root filesystem): compile again with cache=False."""
    started = time.perf_counter()
    kernel = numba.njit(SIGNATURE, cache=cache, **OPTIONS)(paged_decode)
    return kernel, time.perf_counter() - started, sum(kernel.stats.cache_hits.values()) > 0
