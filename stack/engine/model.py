"""A Llama-family decoder in numpy: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

One `forward` serves both phases over a flattened ragged batch (like vLLM): the new tokens of every
segment go through the matmuls together as one (N, dim) matrix (BLAS spreads them over the cores; a decode
batch's rows go through oneMKL's packed weights, gemm.py);
attention reads each segment's keys where they lie in the paged pool (attention.py). Its work is cut
into tasks (a decode segment, or a block of QUERY_BLOCK queries of a prefill) that a large step
spreads over the process's cores (`attention_groups`): a decode batch's attention reads every
sequence's whole cache, and a long prompt's is quadratic, so either is worth both cores. With
`attention="numba"` (the default) the thin segments (decode) skip those tasks: one compiled call per
layer attends them all (batched_decode.py, kernels.py), spread over the same cores. Prefill is
one segment with T = len(prompt) (or a chunk of it), decode is many T = 1 segments, and a colocated
step mixes both in one call. The `Model` holds no per-request state.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from threadpoolctl import ThreadpoolController

from stack.engine import attention as attn_kernels
from stack.engine import batched_decode, gemm
from stack.engine.checkpoint import DUMMY_CONFIGS, dummy_weights, load_checkpoint
from stack.engine.errors import CheckpointError, TokenRangeError
from stack.engine.kv_cache import KVCache
from stack.engine.tokenizer import Tokenizer, dummy_tokenizer
from stack.engine.weights import ModelConfig, Weights, fingerprint

__all__ = ["Model", "ModelConfig", "Segment", "Weights", "forward", "load_model"]


@dataclass(frozen=True)
class Model:
    """Everything `load_model` returns; shared read-only by all requests."""

    name: str  # what /v1/models reports: "dummy:small" or the checkpoint directory name
    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer
    fingerprint: str  # hash of config + weights; a KV cache only moves between equal fingerprints
    matmul: gemm.Matmul = np.matmul  # (rows, k) @ a weight matrix: numpy, or MKL's packed GEMM (gemm.py)


@dataclass
class Segment:
    """One sequence's share of a step: T new tokens written at cache positions [start_pos, start_pos+T)."""

    tokens: np.ndarray  # (T,) int
    cache: KVCache
    start_pos: int


def load_model(source: str, seed: int = 0, matmuls: str = "auto") -> Model:
    """Load "dummy:tiny" | "dummy:small" (seeded random weights, the dummy BPE tokenizer) or an HF checkpoint directory;
    `matmuls` is the engine config's `gemm` (gemm.py)."""
    if source.startswith("dummy:"):
        size = source.removeprefix("dummy:")
        if size not in DUMMY_CONFIGS:
            raise CheckpointError(f"{source}: unknown dummy size; choose one of {sorted(DUMMY_CONFIGS)}")
        config = DUMMY_CONFIGS[size]
        weights, tokenizer, name = dummy_weights(config, seed), dummy_tokenizer(), source
    else:
        config, weights, tokenizer = load_checkpoint(source)
        name = source.rstrip("/").rsplit("/", 1)[-1]
    matmul = gemm.weight_matmul(weights, matmuls, attention_threads())
    return Model(name, config, weights, tokenizer, fingerprint(config, weights), matmul)


def forward(model: Model, segments: list[Segment], all_logits: bool = False,
            on_layer: Callable[[int], None] | None = None, attention: str = "numba") -> np.ndarray | list[np.ndarray]:
    """Run one step. Writes each segment's K/V into its cache and advances `cache.length`.

    `on_layer(i)` is called once layer i's K/V of every segment are written (a PD prefill streams them).
    `attention`: "numba" attends the thin (decode) segments with the compiled kernel when numba imports, and gives
    the other segments' score tiles its compiled exp; "numpy" runs every segment through attention.py alone (the
    reference). Those tiles' GEMMs run on MKL when the weights do (model.matmul; gemm.tile_matmul).

    Returns (len(segments), vocab) logits of each segment's last token, or with `all_logits` a list
    of (T, vocab) arrays, one per segment. Raises `TokenRangeError` for ids outside the vocabulary.
    """
    cfg, w, mm = model.config, model.weights, model.matmul
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    assert segments, "forward needs at least one segment"
    tokens = np.concatenate([np.asarray(s.tokens, dtype=np.int64).reshape(-1) for s in segments])  # (N,)
    if tokens.min(initial=0) < 0 or tokens.max(initial=0) >= cfg.vocab_size:
        bad = int(tokens[(tokens < 0) | (tokens >= cfg.vocab_size)][0])
        raise TokenRangeError(f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
    lengths = [len(np.asarray(s.tokens).reshape(-1)) for s in segments]
    offsets = np.cumsum([0, *lengths])  # (len(segments)+1,) row where each segment starts
    for s, T in zip(segments, lengths, strict=True):
        assert T > 0, "a segment needs at least one token"
        assert s.start_pos <= s.cache.length, f"start_pos {s.start_pos} skips past cache length {s.cache.length}"
        assert s.start_pos + T <= s.cache.capacity, (
            f"{s.start_pos + T} positions exceed cache capacity {s.cache.capacity}"
        )
    assert len({id(s.cache) for s in segments}) == len(segments), "a cache may appear once per step"
    positions = np.concatenate([np.arange(s.start_pos, s.start_pos + T) for s, T in zip(segments, lengths)])  # (N,)
    rotation = rope_rotation(cfg, positions)  # (N, 1, hd/2) complex64
    N = len(tokens)
    assert attention in batched_decode.ATTENTION, f"attention is one of {batched_decode.ATTENTION}, got {attention!r}"
    kernels = batched_decode.compiled() if attention == "numba" else None
    batches = batched_decode.decode_batches([s.cache for s in segments], [s.start_pos for s in segments], lengths,
                                            H // KV) if kernels is not None else []
    tile_ops = attn_kernels.TileOps(gemm.tile_matmul(mm), kernels.exp_rows if kernels is not None else None)  # prefill tiles
    kernel_segments = {j for batch in batches for j in batch.segments}
    tasks = [task for task in attention_tasks(segments, lengths, H // KV) if task[0] not in kernel_segments]  # numpy's work
    runs = [s.cache.runs(s.start_pos + T) for s, T in zip(segments, lengths)]  # block runs, the same in every layer
    groups = attention_groups([(hi - lo) * (segments[j].start_pos + hi) for j, lo, hi in tasks])

    x = w.tok_embeddings[tokens]  # (N, dim)
    for layer_index, layer in enumerate(w.layers):
        h = rms_norm(x, layer.attn_norm, cfg.norm_eps)  # (N, dim)
        qkv = mm(h, layer.wqkv)  # (N, (H + 2*KV) * hd)
        qk = rope(qkv[:, : (H + KV) * hd].reshape(N, H + KV, hd), rotation)  # (N, H + KV, hd)
        q, k = qk[:, :H], qk[:, H:]  # (N, H, hd), (N, KV, hd)
        v = qkv[:, (H + KV) * hd :].reshape(N, KV, hd)  # (N, KV, hd)
        for j, s in enumerate(segments):
            s.cache.write(layer_index, s.start_pos, k[offsets[j] : offsets[j + 1]], v[offsets[j] : offsets[j + 1]], runs[j])
        attn = np.empty((N, H, hd), np.float32)  # (N, H, hd)

        def attend(group: list[int], layer_index: int = layer_index, q: np.ndarray = q, attn: np.ndarray = attn) -> None:
            for t in group:
                j, lo, hi = tasks[t]
                s, first = segments[j], segments[j].start_pos + lo
                rows = slice(offsets[j] + lo, offsets[j] + hi)
                attn[rows] = attn_kernels.attention(q[rows], s.cache.views(layer_index, s.start_pos + hi, 0, runs[j]), first,
                                                    tile_ops)

        for batch in batches:  # the kernel spreads its own tasks over the cores
            batched_decode.attend(batch, layer_index, q, attn, attention_threads())
        if len(groups) == 1:
            attend(groups[0])
        else:  # numpy releases the GIL inside each product and ufunc: the groups run on separate cores
            with blas_per_thread():
                list(attention_pool().map(attend, groups))
        if on_layer is not None:
            on_layer(layer_index)
        x += mm(attn.reshape(N, H * hd), layer.wo)  # (N, dim)
        h = rms_norm(x, layer.mlp_norm, cfg.norm_eps)  # (N, dim)
        x += mm(swiglu(mm(h, layer.w_gate_up)), layer.w_down)  # (N, dim)
    for s, T in zip(segments, lengths):
        s.cache.length = s.start_pos + T

    if all_logits:
        logits = mm(rms_norm(x, w.norm, cfg.norm_eps), w.lm_head)  # (N, vocab)
        return [logits[lo:hi] for lo, hi in zip(offsets[:-1], offsets[1:])]
    last = x[offsets[1:] - 1]  # (len(segments), dim)
    return mm(rms_norm(last, w.norm, cfg.norm_eps), w.lm_head)  # (len(segments), vocab)


# A decode batch's attention reads every sequence's whole KV cache (at batch 32 and 800 tokens, 4x the weights)
# and a long prompt's grows with its square: split over the cores this process may use once the step has enough
# tasks that the split outweighs its cost.
PARALLEL_MIN_SEGMENTS = 8  # tasks (decode segments, prefill query blocks)
PARALLEL_MIN_KEYS = 4096  # query-key pairs per layer over the step


@lru_cache(maxsize=1)
def attention_threads() -> int:
    """Cores for attention: the process's CPU affinity (a cpuset-pinned engine: its cpuset), capped by
    OPENBLAS_NUM_THREADS when set, as the matmuls are."""
    cores = len(os.sched_getaffinity(0))
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "").strip()
    return max(1, min(cores, int(blas))) if blas.isdigit() and int(blas) > 0 else cores


@lru_cache(maxsize=1)
def attention_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(attention_threads(), thread_name_prefix="attention")


@lru_cache(maxsize=1)
def blas_controller() -> ThreadpoolController:
    """numpy's BLAS, found once (threadpoolctl, scikit-learn's library for exactly this): OpenBLAS, or BLIS in a numpy
    built on it. Not oneMKL, which only gemm.py calls, outside attention, with its thread count set at load; its count
    is OpenMP's, per thread (an attention thread read 2 while the step thread had limited it to 1)."""
    return ThreadpoolController().select(internal_api=["openblas", "blis"])


def blas_per_thread() -> AbstractContextManager[object]:
    """While attention's groups run on their own threads, each BLAS product on its caller's core only.

    BLAS's thread count is one setting for the process, sized for the weight matmuls (all cores). Left so,
    two attention threads each spread every small product over both cores: four threads on two cores. One
    layer of a 16k prefill's attention ran at 49 GFLOP/s that way and at 95-118 GFLOP/s with one BLAS
    thread per attention thread (docs/engine.md). Costs ~10 us a layer; the setting is back on exit.
    """
    return blas_controller().limit(limits=1)


def attention_tasks(segments: list[Segment], lengths: list[int], group_size: int) -> list[tuple[int, int, int]]:
    """(segment index, first query, end query) of each unit of attention work: a whole thin segment (decode),
    else one per QUERY_BLOCK queries."""
    tasks = []
    for j, T in enumerate(lengths):
        step = T if T * group_size < attn_kernels.THIN_QUERIES else attn_kernels.QUERY_BLOCK
        tasks += [(j, lo, min(T, lo + step)) for lo in range(0, T, step)]
    return tasks


def attention_groups(keys: list[int]) -> list[list[int]]:
    """Task indices per attention thread, balanced by query-key pairs (largest first onto the lightest group);
    one group when the step is too small to be worth splitting or there is one core."""
    threads = attention_threads()
    if threads == 1 or len(keys) < PARALLEL_MIN_SEGMENTS or sum(keys) < PARALLEL_MIN_KEYS:
        return [list(range(len(keys)))]
    groups: list[list[int]] = [[] for _ in range(threads)]
    load = [0] * threads
    for j in sorted(range(len(keys)), key=lambda j: -keys[j]):
        lightest = load.index(min(load))
        groups[lightest].append(j)
        load[lightest] += keys[j]
    return groups


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """(N, dim), (dim,) -> (N, dim)"""
    ms = np.einsum("nd,nd->n", x, x)[:, None] / np.float32(x.shape[-1])  # (N, 1) mean square
    return x * (weight / np.sqrt(ms + np.float32(eps)))  # (N, dim)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """(hd/2,) float64 frequencies theta^(-2j/hd), rescaled as HF's "llama3" rope_type when configured:
    long wavelengths slowed by `factor`, short ones kept, a smooth blend in between."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(half, dtype=np.float64) * 2 / cfg.head_dim))  # (hd/2,)
    if cfg.rope_scaling is None:
        return inv_freq
    factor, low_freq_factor, high_freq_factor, original_len = cfg.rope_scaling
    wavelen = 2 * np.pi / inv_freq  # (hd/2,)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)  # (hd/2,)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq  # (hd/2,)
    scaled = np.where(wavelen > original_len / low_freq_factor, inv_freq / factor, blended)  # (hd/2,)
    return np.where(wavelen < original_len / high_freq_factor, inv_freq, scaled)  # (hd/2,)


def rope_rotation(cfg: ModelConfig, positions: np.ndarray) -> np.ndarray:
    """(N,) positions -> (N, 1, head_dim/2) complex64 e^(i * pos * inv_freq) (HF frequencies)."""
    inv_freq = rope_inv_freq(cfg)  # (hd/2,)
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]  # (N, hd/2)
    return np.exp(1j * angles).astype(np.complex64)[:, None, :]  # (N, 1, hd/2)


def rope(x: np.ndarray, rotation: np.ndarray) -> np.ndarray:
    """RoPE on interleaved heads (see weights.py): pair (x[2j], x[2j+1]) is HF's (x[j], x[j+hd/2]),
    so rotate-half is a complex multiply. (N, heads, hd), (N, 1, hd/2) -> (N, heads, hd)"""
    pairs = x.view(np.complex64)  # (N, heads, hd/2); needs only the last axis contiguous
    return (pairs * rotation).view(np.float32)  # (N, heads, hd)


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """(N, 2*hidden) -> (N, hidden): silu(gate) * up."""
    hidden = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :hidden], gate_up[:, hidden:]  # (N, hidden) each
    # silu(g) = g * sigmoid(g), with sigmoid via tanh: no overflow warnings for large |g|
    out = np.tanh(gate * np.float32(0.5))  # (N, hidden)
    out += np.float32(1)
    out *= np.float32(0.5)
    out *= gate
    out *= up
    return out
