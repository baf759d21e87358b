"""Which segments of a step the compiled kernel attends (kernels.py), and the one call per layer that does it.

A step's thin segments (T * G < THIN_QUERIES: every decode token, and a short prompt tail) that share a KV
pool, at least MIN_SEGMENTS of them, form one `DecodeBatch`: their rows of the step's queries, block tables and start positions as arrays,
built once per step (the tables are the same in every layer). `attend` runs the kernel over a batch for one
layer; the kernel spreads its (segment, KV head) tasks over `threads` cores itself, replacing forward's
thread-pool split for those segments. Longer segments (prefill chunks) keep attention.py's numpy path, with
the exponentials of each score tile compiled (kernels.exp_rows, which forward hands to attention.py).

`compiled()` compiles the kernels (or loads them from numba's cache) the first time it is asked, at the model's load
when the weight matmuls use them (gemm.py) or at the engine's warm-up, before health says SERVING; without numba
it logs a warning and answers None, and the engine stays on numpy. The warm-up logs which attention runs
(`log_attention`).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, get_args

import numpy as np

from stack.common import events
from stack.common.logging import log_event
from stack.engine import attention as attn_kernels
from stack.engine.config import Attention
from stack.engine.kv_cache import KVCache, KVPool

if TYPE_CHECKING:  # kernels imports numba, which only compiled() may import
    from stack.engine.kernels import Compiled

ATTENTION = get_args(Attention)  # the kernel (default) | attention.py, the reference (engine config `attention`)
# numba's threading layers, the first that loads. oneTBB (the `tbb` wheel, a dependency; also MKL's): a parallel
# launch takes ~3 us, and its idle workers sleep after a short spin instead of spinning against BLAS's. The
# workqueue layer, in every numba wheel, wakes its sleeping workers on every launch: ~95 us a launch on a 2-core
# VM, 3 ms of a decode step's 41 launches (8 attention, 33 weight matmuls). omp (the system's libgomp, which the
# image does not have) is last: numba wants all three named, and workqueue always loads. workqueue aborts the
# process on two concurrent launches, hence one launch at a time (two engines' step threads in one test process;
# an engine has one step thread).
THREADING_LAYERS = ["tbb", "workqueue", "omp"]
TBB_LIBRARY = "libtbb.so.12"  # the tbb wheel's, in the environment's lib/: not on the loader's path, so loaded here
_LAUNCH = threading.Lock()
# Thin segments a pool needs in a step before the kernel takes them. A lone decode is one (segment, KV head) task
# per KV head, too few to spread, while numpy's K @ q streams its cache through BLAS: measured on a quiet 2-core
# machine (benchmarks.engine --attention numba,numpy), batch 1 ran 0.79x vs numpy's 0.85x of its bound at context
# 800 and 0.38x vs 0.56x at 8k, while batch 8 ran 0.48x vs 0.31x and batch 32 at 8k 0.40x vs 0.25x.
MIN_SEGMENTS = 2


@dataclass(frozen=True)
class DecodeBatch:
    """Thin segments of one step that share a pool, as the arrays the kernel reads."""

    pool: KVPool
    segments: tuple[int, ...]  # their indices in the step
    rows: np.ndarray  # (R,) int64 their query rows in the step's (N, H, hd) queries, segment by segment
    offsets: np.ndarray  # (B + 1,) int64 segment b's queries are rows [offsets[b], offsets[b+1]) of the kernel's
    tables: np.ndarray  # (B, blocks) int64 block tables, cut to the blocks the step reads (0-padded)
    starts: np.ndarray  # (B,) int64 start_pos of each


def decode_batches(caches: list[KVCache], starts: list[int], lengths: list[int], group_size: int) -> list[DecodeBatch]:
    """The thin ones of a step's segments (segment j: `lengths[j]` new tokens at `starts[j]` in `caches[j]`, its
    queries the next rows of the step's), grouped by pool (an engine has one; tests build private ones)."""
    offsets = np.cumsum([0, *lengths])  # (segments + 1,) row where each segment's queries start
    by_pool: dict[int, list[int]] = {}
    for j, (cache, T) in enumerate(zip(caches, lengths)):
        if T * group_size < attn_kernels.THIN_QUERIES:
            by_pool.setdefault(id(cache.pool), []).append(j)
    batches = []
    for members in (m for m in by_pool.values() if len(m) >= MIN_SEGMENTS):
        pool = caches[members[0]].pool
        blocks = [pool.blocks_for(starts[j] + lengths[j]) for j in members]
        tables = np.zeros((len(members), max(blocks)), np.int64)  # (B, blocks)
        for i, (j, n) in enumerate(zip(members, blocks)):
            tables[i, :n] = caches[j].table[:n]
        rows = np.concatenate([np.arange(offsets[j], offsets[j + 1], dtype=np.int64) for j in members])  # (R,)
        own = np.cumsum([0, *(lengths[j] for j in members)]).astype(np.int64)  # (B + 1,)
        first = np.array([starts[j] for j in members], np.int64)  # (B,)
        batches.append(DecodeBatch(pool, tuple(members), rows, own, tables, first))
    return batches


def attend(batch: DecodeBatch, layer: int, q: np.ndarray, out: np.ndarray, threads: int) -> None:
    """out[batch.rows] = causal attention of q[batch.rows] over layer `layer` of the batch's KV, on `threads`
    cores. q, out: (N, H, hd), unscaled queries (scaled here as attention.attention scales them)."""
    import numba

    kernels = compiled()
    assert kernels is not None, "attend needs the compiled kernel: check compiled() first"
    hd = q.shape[-1]
    scaled = q[batch.rows] * np.float32(hd**-0.5)  # (R, H, hd) a contiguous copy
    result = np.empty_like(scaled)  # (R, H, hd)
    with _LAUNCH:
        numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))  # per calling thread
        kernels.decode(scaled, batch.pool.k[layer], batch.pool.v[layer], batch.tables, batch.starts, batch.offsets, result)
    out[batch.rows] = result


@lru_cache(maxsize=1)
def compiled() -> Compiled | None:
    """The compiled kernels (compiled, or loaded from numba's cache, on the first call), on oneTBB's threads where
    the tbb wheel loads; or None when numba cannot be imported (logged once as a warning: the engine runs
    attention.py and numpy's matmuls)."""
    try:
        import numba

        from stack.engine import kernels
    except ImportError as exc:
        log_event(events.ENGINE_ATTENTION, f"numba cannot be imported ({exc}): decode attention and the weight matmuls run on numpy",
                  "WARNING", attention="numpy", reason="numba_missing")
        return None
    _load_tbb()  # for the tbb layer, ours or an operator's NUMBA_THREADING_LAYER=tbb
    if "NUMBA_THREADING_LAYER" not in os.environ:  # an operator's choice wins
        numba.config.THREADING_LAYER = "default"  # the first of the priority list that loads
        numba.config.THREADING_LAYER_PRIORITY = THREADING_LAYERS
    try:
        done = kernels.compile_kernel(cache=True)
    except RuntimeError:  # no writable cache directory (a read-only root filesystem): compile in memory
        done = kernels.compile_kernel(cache=False)
    return done


def launch(kernel: Callable[..., None], *args: np.ndarray) -> None:
    """Run one of the compiled parallel kernels (the weight matmuls' rows_matmul): one launch at a time in the process,
    as attend's, for workqueue's sake."""
    with _LAUNCH:
        kernel(*args)


def log_attention(attention: str) -> None:
    """The warm-up's one `engine.attention` line: the kernel (how it was loaded, on which of numba's threading
    layers), or numpy as configured. Nothing more when the kernel is wanted and numba is missing: compiled() has
    warned already."""
    if attention == "numpy":
        log_event(events.ENGINE_ATTENTION, "decode attention: numpy (attention: numpy)", attention="numpy", reason="configured")
        return
    done = compiled()
    if done is None:
        return
    import numba

    layer = numba.threading_layer()  # started by compiling (or loading) the parallel kernels
    how = "loaded from numba's cache" if done.cached else "compiled"
    log_event(events.ENGINE_ATTENTION, f"decode attention: the numba kernel, {how} in {done.seconds * 1000:.0f} ms, "
              f"on numba's {layer} threads", attention="numba", kernel_ms=round(done.seconds * 1000, 1),
              kernel_cached=done.cached, threading_layer=layer)


def _load_tbb() -> None:
    """Load the tbb wheel's library by path, so that numba's tbb layer finds it; without it numba takes workqueue."""
    try:
        ctypes.CDLL(os.path.join(sys.prefix, "lib", TBB_LIBRARY), mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pass
