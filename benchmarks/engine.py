"""Engine micro-benchmarks with ratios to baselines measured in the same run (not a test).

    python -m benchmarks.engine [--model dummy:small] [--prompt 800] [--repeat 3]
    OPENBLAS_NUM_THREADS=1 python -m benchmarks.engine --clock cpu   # one core, CPU time

Sections run in order and share a `Bench` record (_common.py): baselines first (numpy GEMM peak,
memory copy bandwidth, loopback socket bandwidth), then prefill, decode and the KV transfer
(kv_transfer.py, also runnable alone). Add figures by appending a function to `SECTIONS`.
Thread count: whatever numpy/OpenBLAS uses in this process (set OPENBLAS_NUM_THREADS to pin it);
every figure and its baseline use the same one.
"""

from __future__ import annotations

import numpy as np

from benchmarks import _common
from benchmarks._common import Bench, Section, best_time, socket_bandwidth
from benchmarks.kv_transfer import kv_transfer
from stack.engine.kv_cache import KVCache
from stack.engine.model import Model, Segment, forward


def measure_gemm(bench: Bench) -> float:
    """GFLOP/s of a float32 2048^3 numpy matmul, best of `repeat`."""
    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)  # (2048, 2048)
    a @ a  # warm-up
    return 2 * 2048**3 / best_time(lambda: a @ a, bench.repeat, bench.clock) / 1e9


def gemm_peak(bench: Bench) -> None:
    """numpy float32 GEMM at 2048^3: the compute roof for prefill."""
    gflops = measure_gemm(bench)
    bench.baselines["gemm_gflops"] = gflops
    bench.report("numpy GEMM 2048^3 float32", f"{gflops:8.1f} GFLOP/s")


def copy_bandwidth(bench: Bench) -> None:
    """np.copyto of 256 MB, counting read + write traffic: the memory roof for decode."""
    src = np.ones(64 * 2**20, np.float32)  # (64M,) 256 MB, far beyond L3
    dst = np.empty_like(src)
    np.copyto(dst, src)
    seconds = best_time(lambda: np.copyto(dst, src), bench.repeat, bench.clock)
    gbps = 2 * src.nbytes / seconds / 1e9
    bench.baselines["copy_gbps"] = gbps
    bench.report("memory copy bandwidth (read + write)", f"{gbps:8.1f} GB/s")


def prefill_flops(model: Model, T: int) -> float:
    """Useful FLOPs of a T-token prefill: 2 * matmul weights * T, causal attention, last-token lm_head."""
    cfg, w = model.config, model.weights
    layer_params = sum(a.size for layer in w.layers for a in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
    attention = cfg.n_layers * 2 * 2 * cfg.n_heads * cfg.head_dim * T * (T + 1) / 2
    return 2 * layer_params * T + attention + 2 * w.lm_head.size


def prefill(bench: Bench) -> None:
    model, T = bench.model, bench.prompt_tokens
    tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, T)  # (T,)
    cache = KVCache(model.config, T)

    def run() -> None:
        cache.length = 0
        forward(model, [Segment(tokens, cache, 0)])

    run()  # warm-up
    seconds = best_time(run, bench.repeat, bench.clock)
    gflops = prefill_flops(model, T) / seconds / 1e9
    peak = bench.baselines["gemm_gflops"]
    bench.report(f"prefill {T} tokens ({seconds * 1e3:.0f} ms)", f"{T / seconds:8.0f} tok/s")
    bench.report("prefill achieved compute", f"{gflops:8.1f} GFLOP/s", f"{gflops / peak:.2f} x GEMM peak (target >= 0.6)")
    # Load on a shared machine drifts within seconds: pair each prefill with a GEMM run right before it.
    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)  # (2048, 2048)
    ratios = []
    for _ in range(bench.repeat):
        gemm = 2 * 2048**3 / best_time(lambda: a @ a, 1, bench.clock)
        ratios.append(prefill_flops(model, T) / best_time(run, 1, bench.clock) / gemm)
    bench.report("prefill / GEMM, paired runs (median)", f"{float(np.median(ratios)):8.2f}",
                 f"range {min(ratios):.2f}-{max(ratios):.2f} over {bench.repeat} pairs")


def decode(bench: Bench) -> None:
    """Decode steps at batch 1, 8, 32, at a ~prompt_tokens context and at a short one.

    Two memory roofs: weights only (the target: batch 1 >= 0.5 of it) and weights + the KV cache
    every sequence reads per step, which dominates at long contexts and large batches.
    """
    model, bw = bench.model, bench.baselines["copy_gbps"] * 1e9
    weight_bytes = model.weights.decode_bytes
    bound = bw / weight_bytes  # steps/s if only weight reads counted
    bench.report("decode weight bytes per step", f"{weight_bytes / 1e6:8.1f} MB", f"weights-only bound {bound:.0f} steps/s")
    for context in (bench.prompt_tokens, 32):
        for batch in (1, 8, 32):
            seconds = decode_step_seconds(bench, batch, context)
            kv_bound = batch * bw / (weight_bytes + batch * context * model.config.kv_bytes_per_token)
            ratio = f"{batch / seconds / kv_bound:.2f} x weights+KV bound"
            if batch == 1 and context == bench.prompt_tokens:
                ratio = f"{1 / seconds / bound:.2f} x weights-only bound (target >= 0.5); " + ratio
            bench.report(f"decode batch {batch:>2}, context {context:>4} ({seconds * 1e3:5.1f} ms/step)",
                         f"{batch / seconds:8.0f} tok/s", ratio)


def decode_split(bench: Bench) -> None:
    """The decode batch's attention on one thread vs split over the process's cores (model.attention_groups), in
    alternating paired runs so a drifting load on a shared machine hits both alike (median of the pairs)."""
    from stack.engine import model as model_module

    measured = model_module.attention_threads  # swapped per run below, restored at the end
    threads = measured()
    if threads == 1:
        bench.report("decode attention split", "skipped", "one core (or OPENBLAS_NUM_THREADS=1): nothing to split over")
        return
    bw, weight_bytes = bench.baselines["copy_gbps"] * 1e9, bench.model.weights.decode_bytes
    for batch in (8, 32):
        context = bench.prompt_tokens
        kv_bound = batch * bw / (weight_bytes + batch * context * bench.model.config.kv_bytes_per_token)
        one, split = [], []
        for _ in range(bench.repeat):
            model_module.attention_threads = lambda: 1  # type: ignore[assignment]
            one.append(decode_step_seconds(bench, batch, context, steps=4))
            model_module.attention_threads = lambda: threads  # type: ignore[assignment]
            split.append(decode_step_seconds(bench, batch, context, steps=4))
        model_module.attention_threads = measured  # type: ignore[assignment]
        speedup = float(np.median(np.array(one) / np.array(split)))
        bench.report(f"decode batch {batch:>2}, context {context}, attention on {threads} threads",
                     f"{batch / min(split):8.0f} tok/s",
                     f"{batch / min(split) / kv_bound:.2f} x weights+KV bound; {speedup:.2f} x one thread (paired median)")


def decode_step_seconds(bench: Bench, batch: int, context: int, steps: int = 8) -> float:
    """Best wall time of one decode step over `batch` sequences that each hold `context` tokens."""
    model = bench.model
    source = KVCache(model.config, context)
    forward(model, [Segment(np.random.default_rng(2).integers(0, model.config.vocab_size, context), source, 0)])
    caches = []
    for _ in range(batch):  # clone the prefilled context instead of prefilling `batch` times
        cache = KVCache(model.config, context + steps * (bench.repeat + 1))
        cache.k[:, :context], cache.v[:, :context], cache.length = source.k, source.v, context
        caches.append(cache)
    tokens = np.zeros(1, np.int64)  # (1,)

    def step() -> None:
        forward(model, [Segment(tokens, c, c.length) for c in caches])

    step()  # warm-up
    return best_time(lambda: [step() for _ in range(steps - 1)], bench.repeat, bench.clock) / (steps - 1)


def stability(bench: Bench) -> None:
    """GEMM again at the end: on a shared machine a large drift means the ratios above are unreliable."""
    drift = measure_gemm(bench) / bench.baselines["gemm_gflops"]
    bench.report("GEMM at end / GEMM at start", f"{drift:8.2f}", "(far from 1.0: the machine's load changed)")


# Append a section (a function taking the `Bench`) to add figures; baselines run first.
SECTIONS: list[Section] = [gemm_peak, copy_bandwidth, socket_bandwidth, prefill, decode, decode_split, kv_transfer, stability]


if __name__ == "__main__":
    _common.main(__spec__.name, "engine", __doc__.splitlines()[0], SECTIONS)
