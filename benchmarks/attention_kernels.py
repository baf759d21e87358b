"""One layer's batched decode attention: the engine's numpy path against its compiled kernel, head to head.

A section of `python -m benchmarks.engine`. For the largest decode batch at each context, a layer's attention
over the whole batch (every layer in turn, so the KV comes from memory as in a step), reading every sequence's blocks
where they lie in the pool:
- numpy: attention.py per sequence (`attention.attention`), spread over the cores as `forward` spreads it;
- numba: the engine's kernel (batched_decode.py, kernels.py), one call over the batch, its own cores.
Both are checked equal (1e-4) before they are timed; each is printed against the layer's KV bytes over the
measured copy bandwidth. The decode section times the whole step both ways (--attention).
"""

from __future__ import annotations

import numpy as np

from benchmarks._common import Bench, best_time
from stack.engine import batched_decode
from stack.engine import model as model_module
from stack.engine.attention import attention
from stack.engine.kv_cache import KVCache


def numpy_decode(q: np.ndarray, caches: list[KVCache], layer: int) -> np.ndarray:
    """The engine's numpy path for one layer: per-sequence attention, spread over the cores as `forward` spreads it.
    q (B, H, hd) -> (B, H, hd), query b at the last cached position of caches[b]."""
    out = np.empty_like(q)  # (B, H, hd)
    runs = [c.runs(c.length) for c in caches]

    def attend(group: list[int]) -> None:
        for j in group:
            out[j : j + 1] = attention(q[j : j + 1], caches[j].views(layer, caches[j].length, 0, runs[j]), caches[j].length - 1)

    groups = model_module.attention_groups([c.length for c in caches])
    list(model_module.attention_pool().map(attend, groups)) if len(groups) > 1 else attend(groups[0])
    return out


def kernel_decode(q: np.ndarray, caches: list[KVCache], layer: int) -> np.ndarray:
    """The same through the engine's kernel: one call for the batch. q (B, H, hd) -> (B, H, hd)"""
    out = np.empty_like(q)  # (B, H, hd)
    G = q.shape[1] // caches[0].config.n_kv_heads
    for batch in batched_decode.decode_batches(caches, [c.length - 1 for c in caches], [1] * len(caches), G):
        batched_decode.attend(batch, layer, q, out, model_module.attention_threads())
    return out


def compare(bench: Bench, caches: list[KVCache], label: str) -> None:
    """Time one layer's decode attention over `caches` both ways; print each against its bytes bound."""
    if batched_decode.compiled() is None:
        bench.report(f"{label}: numba kernel", "skipped", "numba does not import (a runtime dependency: reinstall)")
        return
    cfg = bench.model.config
    q = np.random.default_rng(4).standard_normal((len(caches), cfg.n_heads, cfg.head_dim), dtype=np.float32)  # (B, H, hd)
    np.testing.assert_allclose(kernel_decode(q, caches, 0), numpy_decode(q, caches, 0), rtol=1e-4, atol=1e-4)
    layer_bytes = sum(c.length for c in caches) * cfg.kv_bytes_per_token // cfg.n_layers  # K and V of one layer
    bound = layer_bytes / (bench.baselines["copy_gbps"] * 1e9)
    for arm, run in (("numpy", numpy_decode), ("numba", kernel_decode)):
        # Every layer in turn, as a step reads them: one layer timed again and again (52 MB at batch 32 x 800) stays in
        # a large L3 (300 MiB on some Xeons) and ran 1.7x faster than the same layer read from memory.
        seconds = best_time(lambda: [run(q, caches, layer) for layer in range(cfg.n_layers)],  # noqa: B023 - called at once
                            bench.repeat, bench.clock) / cfg.n_layers
        bench.report(f"{label}: {arm} attention, a layer (all {cfg.n_layers} in turn)", f"{seconds * 1e3:8.2f} ms",
                     f"{bound / seconds:.2f} x its KV bytes bound ({bound * 1e3:.2f} ms)")
