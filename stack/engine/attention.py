"""Causal grouped-query attention over paged KV, in bounded memory (an online softmax over key tiles).

A segment's keys arrive as runs: (K, V, first position) views of consecutive pool blocks
(`KVCache.views`), read where they lie. Each run is cut into tiles of at most `KEY_BLOCK` keys and
the softmax is merged tile by tile (running row max, rescaled sums and outputs, as FlashAttention),
so a query block's scores never exceed (QUERY_BLOCK * G, KEY_BLOCK): a 32k-token prompt never holds
an n x n matrix. One tile and one run give exactly the plain softmax.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

# Queries per attention block: bounds the score tile and lets causal blocks skip the keys of later blocks;
# also the unit of work the forward spreads over the cores.
QUERY_BLOCK = 128
# Keys per score tile of a query block: (QUERY_BLOCK * G, KEY_BLOCK) float32 scores at most (2 MiB at G = 2).
KEY_BLOCK = 2048
# Below this many query rows per KV head (decode), one batched K @ Q^T over all heads is used:
# per-head calls would cost more in numpy overhead, and OpenBLAS streams the strided cache several
# times faster in that orientation when the query side is that thin.
THIN_QUERIES = 64
# Keys per tile on the thin path: its scores are a few rows per head, so tiles can be long.
THIN_KEY_BLOCK = 16384

Runs = list[tuple[np.ndarray, np.ndarray, int]]  # (K (S_i, KV, hd), V (S_i, KV, hd), first position) per run
State = tuple[np.ndarray, np.ndarray, np.ndarray]  # row max (..., 1), row sum (..., 1), unnormalised output (..., hd)
# kernels.exp_rows: scores (rows, n) -> exp(scores - shift[:, None]) in place, their row sums into sums (rows,)
ExpRows = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class TileOps:
    """What a query block's score tiles are computed with: numpy alone (NUMPY, the reference), or forward's faster
    parts: MKL's GEMM for the tiles when the weights run on it (gemm.tile_matmul), the compiled exp (kernels.exp_rows)."""

    matmul: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul  # (rows, k) @ (k, n), b a strided pool view
    exp_rows: ExpRows | None = None


NUMPY = TileOps()


def attention(q: np.ndarray, runs: Runs, start_pos: int, ops: TileOps = NUMPY) -> np.ndarray:
    """Causal attention of T queries at positions [start_pos, start_pos + T) over the keys of `runs`,
    which cover positions [0, start_pos + T). (T, H, hd), runs -> (T, H, hd)

    Query head h uses KV head h // (H // KV) (HF repeat_kv): the G = H // KV queries of a group are
    stacked so each KV head needs one matmul per tile against only the keys the queries can see.
    `ops`: what the query blocks' tiles are computed with (TileOps; decode-sized work is numpy's).
    """
    T, H, hd = q.shape
    G = H // runs[0][0].shape[1]
    q = q * np.float32(hd**-0.5)  # (T, H, hd) scaled copy
    if T * G < THIN_QUERIES:
        return attend_thin(q, runs, start_pos, G)
    out = np.empty((T, H, hd), np.float32)  # (T, H, hd)
    for a in range(0, T, QUERY_BLOCK):
        b = min(T, a + QUERY_BLOCK)
        out[a:b] = attend_block(q[a:b], runs, start_pos + a, G, ops)
    return out


def attend_block(q: np.ndarray, runs: Runs, first: int, G: int, ops: TileOps = NUMPY) -> np.ndarray:
    """Scaled queries at positions [first, first + c), one KV head (G query heads) at a time, tile by tile.
    (c, H, hd), runs -> (c, H, hd)"""
    c, H, hd = q.shape
    tiles = [(k, v, causal_mask(first, c, pos, len(k))) for k, v, pos in key_tiles(runs, first + c, KEY_BLOCK)]
    out = np.empty((c, H, hd), np.float32)  # (c, H, hd)
    for h in range(H // G):
        group = slice(h * G, (h + 1) * G)
        qh = q[:, group].reshape(c * G, hd)  # (c*G, hd), row = (query, group member)
        state = None
        for k, v, mask in tiles:
            scores = ops.matmul(qh, k[:, h].T)  # (c*G, n)
            if mask is not None:
                scores.reshape(c, G, -1)[...] += mask
            state = online_softmax(state, scores, v[:, h], ops)
        out[:, group] = finish(state).reshape(c, G, hd)
    return out


def attend_thin(q: np.ndarray, runs: Runs, first: int, G: int) -> np.ndarray:
    """Few scaled queries (decode) at positions [first, first + T), all KV heads in one batched matmul per tile.
    (T, H, hd), runs -> (T, H, hd)"""
    T, H, hd = q.shape
    KV = H // G
    qt = q.reshape(T, KV, G, hd).transpose(1, 3, 0, 2).reshape(KV, hd, T * G)  # (KV, hd, T*G)
    state = None
    for k, v, pos in key_tiles(runs, first + T, THIN_KEY_BLOCK):
        scores = np.ascontiguousarray((k.transpose(1, 0, 2) @ qt).transpose(0, 2, 1))  # (KV, T*G, n)
        mask = causal_mask(first, T, pos, len(k))
        if mask is not None:
            scores.reshape(KV, T, G, -1)[...] += mask
        state = online_softmax(state, scores, v.transpose(1, 0, 2))
    out = finish(state)  # (KV, T*G, hd)
    return out.reshape(KV, T, G, hd).transpose(1, 0, 2, 3).reshape(T, H, hd)


def key_tiles(runs: Runs, end: int, size: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """The keys of `runs` before position `end` in tiles of at most `size`: (K, V, first position), in order."""
    for k, v, pos in runs:
        for a in range(0, min(len(k), end - pos), size):
            b = min(len(k), end - pos, a + size)
            yield k[a:b], v[a:b], pos + a


def causal_mask(first: int, T: int, pos: int, n: int) -> np.ndarray | None:
    """(T, 1, n) additive mask of keys [pos, pos + n) for queries [first, first + T): -inf where the key comes
    after the query; None when every key is visible to every query."""
    if pos + n - 1 <= first:
        return None
    later = (pos + np.arange(n))[None, :] > (first + np.arange(T))[:, None]  # (T, n)
    return np.where(later, np.float32(-np.inf), np.float32(0))[:, None, :]


def online_softmax(state: State | None, scores: np.ndarray, v: np.ndarray, ops: TileOps = NUMPY) -> State:
    """Fold one tile into the running softmax; `scores` (..., rows, n) is overwritten. v: (..., n, hd).

    The first tile of every row holds key 0, which every query sees: row maxima are finite from the start.
    """
    tile_max = scores.max(axis=-1, keepdims=True)  # (..., rows, 1)
    new_max = tile_max if state is None else np.maximum(state[0], tile_max)  # (..., rows, 1)
    sums = exp_shifted(scores, new_max, ops.exp_rows)  # (..., rows, 1)
    if state is None:
        return new_max, sums, ops.matmul(scores, v)
    row_max, old_sums, acc = state
    rescale = np.exp(row_max - new_max)  # (..., rows, 1) how much the earlier tiles shrink
    return new_max, old_sums * rescale + sums, acc * rescale + ops.matmul(scores, v)


def exp_shifted(scores: np.ndarray, shift: np.ndarray, exp_rows: ExpRows | None) -> np.ndarray:
    """scores (..., rows, n) -> exp(scores - shift) in place; answers their sums (..., rows, 1). shift (..., rows, 1)."""
    if exp_rows is None or scores.ndim != 2:
        scores -= shift
        np.exp(scores, out=scores)
        return scores.sum(axis=-1, keepdims=True)
    sums = np.empty(shift.shape, np.float32)  # (rows, 1)
    exp_rows(scores, shift.reshape(-1), sums.reshape(-1))
    return sums


def finish(state: State | None) -> np.ndarray:
    """The normalised output (..., rows, hd) of a folded softmax."""
    assert state is not None, "attention needs at least one key"
    _, sums, acc = state
    return acc / sums
