"""The compiled kernels (numba): every thin segment of a step against its paged KV, one call per layer
(`paged_decode`), the exponentials of a prefill tile's softmax (`exp_rows`), and a decode batch's weight matmuls
on CPUs where oneMKL does not run its own code (`rows_matmul`, gemm.py).

numba is a long-kept JIT on PyPI (a NumFOCUS project, led by Anaconda): it compiles this plain-loop Python to
machine code with LLVM (its llvmlite wheel carries LLVM), with no C toolchain in the image. Why compiled: a
decode step's attention is some twenty small numpy calls per sequence and layer; at batch 32 their dispatch,
not memory, bounds the step. One call here walks every sequence's block table where the blocks lie in the
pool, a `prange` over the segments spread over the cores; each key and value is read once for the G query
heads of its group (and the T queries of a short segment), and the loops over head_dim are plain float32 loops
LLVM vectorises. A prefill's attention stays numpy's GEMMs over key tiles (attention.py); only each tile's
exp-and-sum comes here, one walk of each row instead of numpy's three passes over the tile. `rows_matmul` multiplies
a few rows by a weight matrix stored transposed, without OpenBLAS's per-call packing of the weights.

This module imports numba and nothing of the engine: the image compiles it into NUMBA_CACHE_DIR on its own
(Dockerfile), and batched_decode.py imports it only when the kernel is wanted. attention.py (numpy) stays
the reference; the tests compare the two.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# The one signature compiled (eagerly, so no call ever compiles on a request; a call with other types raises
# TypeError): q (R, H, hd), K and V pools of one layer (blocks, bs, KV, hd), tables (B, blocks), starts (B,),
# offsets (B + 1,), out (R, H, hd); every array C-contiguous.
SIGNATURE = ("void(float32[:, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], int64[:, ::1], int64[::1], "
             "int64[::1], float32[:, :, ::1])")
# fastmath: the dot products and sums may be reassociated (vectorised); nothing here is inf or nan.
# nogil: the event loop and the KV socket keep running while a step attends.
OPTIONS = {"parallel": True, "fastmath": True, "nogil": True}
# exp_rows: scores (rows, n), shift (rows,), sums (rows,). Not parallel: forward's attention threads each call it on
# their own tiles, and with nogil they run at once. A diagonal tile holds the causal mask's -inf, so fastmath without
# its no-inf/no-nan assumptions: the sums may still be reassociated (vectorised).
EXP_SIGNATURE = "void(float32[:, ::1], float32[::1], float32[::1])"
EXP_OPTIONS = {"fastmath": {"reassoc", "contract", "arcp", "nsz", "afn"}, "nogil": True}
# rows_matmul: x (M, K) with M a multiple of ROW_BLOCK, a weight matrix transposed (N, K), taken read-only (a tied
# lm_head's is the frozen embedding itself; a writable copy converts), out (M, N). Parallel: the weight matmuls
# run one at a time on forward's thread. Like exp_rows, fastmath without no-inf/no-nan: an inf in x gives numpy's
# inf, not whatever an assumption would make of it.
_ROWS = types.Array(types.float32, 2, "C")
MATMUL_SIGNATURE = types.void(_ROWS, types.Array(types.float32, 2, "C", readonly=True), _ROWS)
MATMUL_OPTIONS = {"parallel": True, "fastmath": {"reassoc", "contract", "arcp", "nsz"}, "nogil": True}
ROW_BLOCK = 4  # rows of x per block (the caller pads x to a multiple); 6 columns a block, in the code below
# How a pass walks a segment's blocks: WAYS blocks at once, slot by slot (slot s of blocks i and i + 1, then slot
# s + 1 of both, ...), and before it reads a slot it asks the CPU for the slot PREFETCH_SLOTS further on in the same
# block (or in the block WAYS on, past the end of this one). With the KV of a whole step in memory rather than in the
# L3, a walk of one block at a time kept too few cache misses in flight: on a 2-core Xeon (model 167) a bare walk of
# it that only summed the KV took 0.83x the kernel's time. Two blocks' streams at once, prefetched two slots ahead,
# took a layer of batch-32 decode in 0.74-0.76x the time of one block prefetched two blocks ahead (contexts 800, 8k);
# without the prefetch, two blocks at once gained nothing, and four or eight blocks or other distances were no
# better (docs/engine.md).
WAYS = 2
PREFETCH_SLOTS = 2
LINE_FLOATS = 16  # float32s in a 64-byte cache line


@intrinsic
def _prefetch(typingctx, pool, block, slot, head, d):  # pragma: no cover - compiled
    """Ask the CPU to bring the cache line of pool[block, slot, head, d] into its caches (LLVM's prefetch: read,
    keep in every level); no load, no fault, nothing waits for it."""
    signature = types.void(pool, block, slot, head, d)

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        index = [context.cast(builder, value, kind, types.intp) for value, kind in zip(args[1:], sig.args[1:])]
        pointer = cgutils.get_item_pointer2(context, builder, array.data, cgutils.unpack_tuple(builder, array.shape),
                                            cgutils.unpack_tuple(builder, array.strides), sig.args[0].layout, index,
                                            wraparound=False)
        byte = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]),
                                                  "llvm.prefetch.p0i8")
        # (address, 0: read, 3: keep in every cache level, 1: data cache)
        builder.call(prefetch, [builder.bitcast(pointer, byte), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return signature, codegen


@numba.njit(inline="always")
def prefetch_slot(pool: np.ndarray, block: int, slot: int) -> None:  # pragma: no cover - compiled
    """Prefetch every head's keys (or values) of one slot of a pool block: KV * hd floats, whole cache lines."""
    for h in range(pool.shape[2]):
        for d in range(0, pool.shape[3], LINE_FLOATS):
            _prefetch(pool, block, slot, h, d)


@numba.njit(fastmath=True, inline="always")
def exp_shifted(row: np.ndarray, top: float, bits: np.ndarray) -> float:  # pragma: no cover - compiled
    """row (n,) scores -> exp(row - top) in place, `top` at least every score; answers their sum (float64: a 64k-key
    sum keeps its digits). bits (n,) int32 scratch.

    exp as Cephes' expf computes it (x = n ln2 + f, a degree-7 polynomial in f, times 2^n built in the exponent
    bits): numba's np.exp is one libm call per element (the wheel has no vector math library), which was a sixth
    of the decode kernel's time; these loops vectorise. Relative error ~1.2e-7 over [-87, 0] (a float32 ulp), beside
    the rounding of row - top itself: far inside the tests' 1e-4 on logprobs. A score 87 or more below `top` (a
    masked -inf among them) weighs ~1.6e-38, the smallest normal float32's order, instead of 0."""
    n = row.shape[0]
    for p in range(n):
        x = max(row[p] - top, np.float32(-87.0))
        k = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))  # round(x / ln2)
        f = x - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)  # x - k ln2 in two parts, |f| <= ln2/2
        y = np.float32(1.9875691500e-4)
        y = y * f + np.float32(1.3981999507e-3)
        y = y * f + np.float32(8.3334519073e-3)
        y = y * f + np.float32(4.1665795894e-2)
        y = y * f + np.float32(1.6666665459e-1)
        y = y * f + np.float32(5.0000001201e-1)
        row[p] = y * f * f + f + np.float32(1.0)
        bits[p] = (np.int32(k) + np.int32(127)) << np.int32(23)  # 2^k as float32 bits
    powers = bits[:n].view(np.float32)
    total = 0.0
    for p in range(n):
        row[p] *= powers[p]
        total += row[p]
    return total


@numba.njit(inline="always")
def prefetch_ahead(pool: np.ndarray, table: np.ndarray, i: int, slot: int) -> None:  # pragma: no cover - compiled
    """Before a pass reads slot `slot` of block table[i]: prefetch the slot PREFETCH_SLOTS further on in the same
    block, or in the block WAYS on (the next the walk reads in that place). Past the table's last entry it asks for
    its last block again: harmless (a table's padding is block 0 anyway)."""
    ahead = slot + PREFETCH_SLOTS
    bs = pool.shape[1]
    if ahead < bs:
        prefetch_slot(pool, table[i], ahead)
    else:
        prefetch_slot(pool, table[min(i + WAYS, table.shape[0] - 1)], ahead - bs)


@numba.njit(fastmath=True, inline="always")
def score_key(qg: np.ndarray, k_pool: np.ndarray, block: int, slot: int, p: int, seen: np.ndarray,
              scores: np.ndarray, top: np.ndarray) -> None:  # pragma: no cover - compiled
    """Key p (k_pool[block, slot]) against every query row: scores[:, :, p], and top (KV, rows) each row's running
    maximum over the keys it sees (p < seen[r]), so the softmax needs no pass of its own for it."""
    for h in range(k_pool.shape[2]):
        for r in range(qg.shape[1]):
            dot = np.float32(0)
            for d in range(k_pool.shape[3]):
                dot += qg[h, r, d] * k_pool[block, slot, h, d]
            scores[h, r, p] = dot
            if p < seen[r] and dot > top[h, r]:  # always seen for a decode token: the branch predicts
                top[h, r] = dot


@numba.njit(fastmath=True, inline="always")
def add_value(acc: np.ndarray, v_pool: np.ndarray, block: int, slot: int, p: int, seen: np.ndarray,
              scores: np.ndarray) -> None:  # pragma: no cover - compiled
    """Value p (v_pool[block, slot]) into every row that sees it, weighted by its softmax numerator."""
    for h in range(v_pool.shape[2]):
        for r in range(acc.shape[1]):
            if p < seen[r]:
                w = scores[h, r, p]
                for d in range(v_pool.shape[3]):
                    acc[h, r, d] += w * v_pool[block, slot, h, d]


def exp_rows(scores: np.ndarray, shift: np.ndarray, sums: np.ndarray) -> None:  # pragma: no cover - compiled
    """A prefill tile's softmax numerator: scores (rows, n) -> exp(scores - shift[:, None]) in place, sums (rows,)
    their row sums; shift (rows,) the rows' running maxima (attention.online_softmax).

    numpy spends three passes over the whole tile on this (subtract, exp, sum, each in place); here it is one
    walk of each row, which stays in the L1. The row maxima stay numpy's: its reduction is vectorised and numba's
    `max` loop is not (measured 75 against 650 us for a 256 x 2048 tile)."""
    bits = np.empty(scores.shape[1], np.int32)  # (n,) exp_shifted's scratch
    for r in range(scores.shape[0]):
        sums[r] = exp_shifted(scores[r], shift[r], bits)


def paged_decode(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, tables: np.ndarray, starts: np.ndarray,
                 offsets: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """Causal GQA attention of B short segments over paged KV. q (R, H, hd) scaled queries, segment b's are rows
    [offsets[b], offsets[b+1]) at positions starts[b], starts[b]+1, …; k_pool, v_pool (blocks, bs, KV, hd) one
    layer of the pool; tables (B, blocks) each segment's block table -> out (R, H, hd). Query t of segment b sees
    positions [0, starts[b] + t] (its own included: forward wrote its K/V first). Query head h uses KV head
    h // G (HF repeat_kv).

    One task per segment, all its KV heads: a slot's keys of every head lie together in the pool (KV * hd floats),
    so a task reads whole runs of memory. A task per (segment, KV head) read a quarter of each run and was 1.4x
    slower at 2 segments and 2x at 32 (docs/engine.md). Both passes walk WAYS blocks at once (see WAYS)."""
    bs, KV, hd = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    G = q.shape[1] // KV
    for b in prange(starts.shape[0]):
        first, T = offsets[b], offsets[b + 1] - offsets[b]
        rows = T * G  # query rows of a KV head's group: row t*G + g is query t, head h*G + g
        keys = starts[b] + T  # keys the last query sees
        seen = np.empty(rows, np.int64)  # (rows,) keys row r sees: [0, starts[b] + t] (causal; a decode token: all)
        qg = np.empty((KV, rows, hd), np.float32)  # (KV, rows, hd) the queries by KV head, contiguous
        for t in range(T):
            for g in range(G):
                seen[t * G + g] = starts[b] + t + 1
        for h in range(KV):
            for t in range(T):
                for g in range(G):
                    for d in range(hd):
                        qg[h, t * G + g, d] = q[first + t, h * G + g, d]
        table = tables[b]
        blocks = (keys + bs - 1) // bs
        scores = np.empty((KV, rows, keys), np.float32)  # (KV, rows, keys): 2 MiB for a decode token at 64k keys
        top = np.full((KV, rows), -np.inf, np.float32)  # (KV, rows) each row's largest score
        for i in range(0, blocks, WAYS):  # each key read once for every row of its group
            for slot in range(bs):
                for w in range(min(WAYS, blocks - i)):
                    p = (i + w) * bs + slot
                    if p < keys:
                        prefetch_ahead(k_pool, table, i + w, slot)
                        score_key(qg, k_pool, table[i + w], slot, p, seen, scores, top)
        scale = np.empty((KV, rows), np.float32)  # (KV, rows) 1 / softmax denominator
        bits = np.empty(keys, np.int32)  # (keys,) exp_shifted's scratch
        for h in range(KV):
            for r in range(rows):
                scale[h, r] = 1.0 / exp_shifted(scores[h, r, : seen[r]], top[h, r], bits)
        acc = np.zeros((KV, rows, hd), np.float32)  # (KV, rows, hd) unnormalised output
        for i in range(0, blocks, WAYS):  # each value read once for every row that sees it, in the same order
            for slot in range(bs):
                for w in range(min(WAYS, blocks - i)):
                    p = (i + w) * bs + slot
                    if p < keys:
                        prefetch_ahead(v_pool, table, i + w, slot)
                        add_value(acc, v_pool, table[i + w], slot, p, seen, scores)
        for h in range(KV):
            for r in range(rows):
                t, g = r // G, r % G
                for d in range(hd):
                    out[first + t, h * G + g, d] = acc[h, r, d] * scale[h, r]


def rows_matmul(x: np.ndarray, wt: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out = x @ wt.T for a decode batch's few rows: x (M, K) float32 with M a multiple of ROW_BLOCK, wt (N, K) a
    weight matrix transposed (each output column's weights contiguous), out (M, N).

    OpenBLAS's GEMM copies every panel of the weights into its kernel's layout on each call; at 8 to 32 rows that
    copy costs as much as the multiply. Here each 4 x 6 block of out is 24 dot products over k, in 24 scalar
    accumulators: LLVM vectorises the k loop (16 floats a step with AVX-512) with every accumulator in a register,
    so a vector of x serves 6 FMAs and one of the weights 4, and the weights are read once per 4 rows, in place. The
    sums end in a horizontal add per accumulator. The blocks of 6 columns are spread over the cores; the last N % 6
    columns go 4 x 1. On a 2-core Zen 4 EPYC dummy:small's 33 matrices took 0.6x OpenBLAS's time at 8 rows and 0.8x
    at 32 (docs/engine.md)."""
    M, K = x.shape
    N = wt.shape[0]
    for b in prange((N + 5) // 6):  # one parallel launch a call: each costs the workers' wake-up
        n = b * 6
        if n + 6 > N:  # the last N % 6 columns, 4 x 1
            for c in range(n, N):
                for r in range(0, M, 4):
                    a0 = a1 = a2 = a3 = np.float32(0)
                    for k in range(K):
                        w = wt[c, k]
                        a0 += x[r, k] * w; a1 += x[r + 1, k] * w; a2 += x[r + 2, k] * w; a3 += x[r + 3, k] * w  # noqa: E702
                    out[r, c], out[r + 1, c], out[r + 2, c], out[r + 3, c] = a0, a1, a2, a3
            continue
        for r in range(0, M, 4):
            a00 = a01 = a02 = a03 = a04 = a05 = np.float32(0)
            a10 = a11 = a12 = a13 = a14 = a15 = np.float32(0)
            a20 = a21 = a22 = a23 = a24 = a25 = np.float32(0)
            a30 = a31 = a32 = a33 = a34 = a35 = np.float32(0)
            for k in range(K):
                w0, w1, w2, w3, w4, w5 = wt[n, k], wt[n + 1, k], wt[n + 2, k], wt[n + 3, k], wt[n + 4, k], wt[n + 5, k]
                x0, x1, x2, x3 = x[r, k], x[r + 1, k], x[r + 2, k], x[r + 3, k]
                a00 += x0 * w0; a01 += x0 * w1; a02 += x0 * w2; a03 += x0 * w3; a04 += x0 * w4; a05 += x0 * w5  # noqa: E702
                a10 += x1 * w0; a11 += x1 * w1; a12 += x1 * w2; a13 += x1 * w3; a14 += x1 * w4; a15 += x1 * w5  # noqa: E702
                a20 += x2 * w0; a21 += x2 * w1; a22 += x2 * w2; a23 += x2 * w3; a24 += x2 * w4; a25 += x2 * w5  # noqa: E702
                a30 += x3 * w0; a31 += x3 * w1; a32 += x3 * w2; a33 += x3 * w3; a34 += x3 * w4; a35 += x3 * w5  # noqa: E702
            out[r, n], out[r, n + 1], out[r, n + 2], out[r, n + 3], out[r, n + 4], out[r, n + 5] = a00, a01, a02, a03, a04, a05
            out[r + 1, n], out[r + 1, n + 1], out[r + 1, n + 2] = a10, a11, a12
            out[r + 1, n + 3], out[r + 1, n + 4], out[r + 1, n + 5] = a13, a14, a15
            out[r + 2, n], out[r + 2, n + 1], out[r + 2, n + 2] = a20, a21, a22
            out[r + 2, n + 3], out[r + 2, n + 4], out[r + 2, n + 5] = a23, a24, a25
            out[r + 3, n], out[r + 3, n + 1], out[r + 3, n + 2] = a30, a31, a32
            out[r + 3, n + 3], out[r + 3, n + 4], out[r + 3, n + 5] = a33, a34, a35


@dataclass(frozen=True)
class Compiled:
    """The compiled kernels: `decode` (paged_decode), `exp_rows` and `matmul` (rows_matmul); what compiling them
    took."""

    decode: Callable[..., None]
    exp_rows: Callable[..., None]
    matmul: Callable[..., None]
    seconds: float
    cached: bool  # loaded from numba's on-disk cache


def compile_kernel(cache: bool = True) -> Compiled:
    """Compile `paged_decode`, `exp_rows` and `rows_matmul`. With `cache`, numba keeps the machine code in NUMBA_CACHE_DIR (else
    __pycache__ beside this file); raises RuntimeError if no such directory is writable (a read-only root
    filesystem): compile again with cache=False."""
    started = time.perf_counter()
    decode = numba.njit(SIGNATURE, cache=cache, **OPTIONS)(paged_decode)
    tile = numba.njit(EXP_SIGNATURE, cache=cache, **EXP_OPTIONS)(exp_rows)
    matmul = numba.njit(MATMUL_SIGNATURE, cache=cache, **MATMUL_OPTIONS)(rows_matmul)
    cached = all(sum(kernel.stats.cache_hits.values()) > 0 for kernel in (decode, tile, matmul))
    return Compiled(decode, tile, matmul, time.perf_counter() - started, cached)
