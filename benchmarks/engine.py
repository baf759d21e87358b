"""Engine benchmarks at agent scale, each figure next to its machine bound measured in the same run (not a test).

    python -m benchmarks.engine [--model dummy:small] [--repeat 3] [--quick]
    python -m benchmarks.engine --prefill 1024,4096 --contexts 800 --batches 1,8   # any subset
    python -m benchmarks.engine --prefill 1024 --attention numba,numpy   # decode through both attention arms
    python -m benchmarks.engine --prefill 1024 --gemm mkl,numpy   # decode with both weight-matmul arms

Sections run in order and share a `Bench` record (_common.py): baselines first (numpy GEMM rate, memory copy
bandwidth, memory read bandwidth, the BLAS threadpoolctl sees, loopback socket bandwidth), then
- prefill tok/s of --prefill prompts (default 1k, 4k, 16k, 32k), fed in --chunk token chunks as the scheduler
  does with chunked_prefill, against FLOPs (weights + causal attention) / the GEMM rate;
- decode tok/s at --batches (1, 8, 32) x --contexts (800, 8k), every sequence in its own pool blocks, against
  (weights + the batch's KV) bytes per step / the copy bandwidth (the issue's bound) and / the read bandwidth (the
  roof of a step that only reads); once per --attention arm (numba: the engine's
  compiled kernel, its default; numpy: attention.py) and --gemm arm (auto: the engine's default, mkl on an Intel
  CPU and numba elsewhere; mkl: MKL's packed GEMM; numba: the compiled kernel; numpy: OpenBLAS), the arms of a
  point run back to back;
- peak resident memory of the longest prefill and of the largest batch x context (sampled while it runs);
- attention on one thread vs spread over the cores (paired runs), for the largest decode batch and a prefill;
- one layer's decode attention of the largest batch, numpy vs the engine's compiled kernel (attention_kernels.py);
- the KV transfer (kv_transfer.py), and the GEMM rate again (drift = the machine's load changed).
--quick: prefill 1k and 4k, context 800 only. Thread count: whatever numpy/OpenBLAS uses in this process
(set OPENBLAS_NUM_THREADS to pin it); every figure and its bound use the same one.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TypeVar

from stack.engine import blas_env

blas_env.apply_defaults()  # before numpy loads OpenBLAS: measure the engine's BLAS settings

import numpy as np  # noqa: E402

from benchmarks import _common, attention_kernels  # noqa: E402
from benchmarks._common import Bench, Section, best_time, socket_bandwidth  # noqa: E402
from benchmarks.kv_transfer import kv_transfer  # noqa: E402
from stack.engine import batched_decode, gemm  # noqa: E402
from stack.engine.kv_cache import KVCache, KVPool  # noqa: E402
from stack.engine.model import Model, Segment, attention_threads, forward  # noqa: E402

FULL = {"prefill": [1024, 4096, 16384, 32768], "contexts": [800, 8192], "batches": [1, 8, 32]}
QUICK = {"prefill": [1024, 4096], "contexts": [800], "batches": [1, 8, 32]}
POINTS: dict[str, list[int]] = dict(FULL)  # set from the command line before the sections run
CHUNK = [2048]  # prefill chunk (the scheduler's default max_num_batched_tokens)
ATTENTION = ["numba"]  # decode attention arms (forward's `attention`), set from the command line
GEMM = ["auto"]  # decode weight-matmul arms (the engine config's `gemm`), set from the command line
DECODE_STEPS = 4  # timed decode steps per run
R = TypeVar("R")


# A point's bound is the machine's rate measured right before and right after it, and the ratio is to their mean.
# On a shared 2-core VM the same 2048^3 GEMM ran 1.95x faster at the end of one run than at its start, and the
# copy bandwidth moved 16-22 GB/s within minutes: a rate taken once at the start was no bound for a point timed
# minutes later. A point whose two rates differ by more than STEADY is marked: the machine changed under it.
STEADY = 1.15


@dataclass(frozen=True)
class Bracket:
    """A machine rate (GFLOP/s or GB/s) measured right before and right after one point."""

    before: float
    after: float

    @property
    def rate(self) -> float:
        return (self.before + self.after) / 2

    @property
    def steady(self) -> bool:
        return max(self.before, self.after) <= STEADY * min(self.before, self.after)

    def note(self, name: str, unit: str) -> str:
        mark = "" if self.steady else f"; UNSTEADY (>{STEADY:g}x apart): the machine changed during this point"
        return f"{name} {self.before:.1f} before, {self.after:.1f} after {unit}{mark}"


def bracketed(run: Callable[[], R], *measures: Callable[[], float]) -> tuple[R, list[Bracket]]:
    """`run()`'s result, and each of the rates that bound it measured right before and right after it."""
    before = [measure() for measure in measures]
    result = run()
    return result, [Bracket(rate, measure()) for rate, measure in zip(before, measures, strict=True)]


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


def measure_copy(bench: Bench) -> float:
    """GB/s of np.copyto of 256 MB, counting read + write traffic, best of `repeat`: the memory roof for decode."""
    src = np.ones(64 * 2**20, np.float32)  # (64M,) 256 MB, far beyond L3
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return 2 * src.nbytes / best_time(lambda: np.copyto(dst, src), bench.repeat, bench.clock) / 1e9


def copy_bandwidth(bench: Bench) -> None:
    gbps = measure_copy(bench)
    bench.baselines["copy_gbps"] = gbps
    bench.report("memory copy bandwidth (read + write)", f"{gbps:8.1f} GB/s")


def measure_read(bench: Bench) -> float:
    """GB/s of a read-only stream of 1 GiB, one slice per attention thread (numpy's bitwise-or reduction only reads,
    and releases the GIL), best of `repeat`: the roof of a decode step, which reads its weights and KV and writes next
    to nothing. The copy counts a write for every byte read, so it overstates how fast the cores can only read."""
    words = np.ones(256 * 2**20, np.int32)  # (256M,) 1 GiB: several times L3 (300 MiB on some Xeons)
    slices = np.array_split(words, attention_threads())
    with ThreadPoolExecutor(len(slices)) as pool:
        def read() -> None:
            list(pool.map(np.bitwise_or.reduce, slices))
        read()
        return words.nbytes / best_time(read, bench.repeat, bench.clock) / 1e9


def read_bandwidth(bench: Bench) -> None:
    gbps = measure_read(bench)  # shown once here; each decode point measures it again around itself
    bench.report(f"memory read bandwidth ({attention_threads()} threads)", f"{gbps:8.1f} GB/s")


def blas(bench: Bench) -> None:
    """Which BLAS library, kernel (core type) and thread count numpy runs on, as threadpoolctl sees them."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        bench.report("BLAS", "unknown", "(pip install threadpoolctl to see the kernel)")
        return
    for pool in threadpool_info():
        bench.report(f"{pool.get('internal_api')} {pool.get('version')}", f"{pool.get('num_threads')} threads",
                     f"kernel {pool.get('architecture', '-')}, {pool.get('threading_layer', '-')} threading")


def prefill_flops(model: Model, T: int) -> float:
    """Useful FLOPs of a T-token prefill: 2 * matmul weights * T, causal attention, last-token lm_head."""
    cfg, w = model.config, model.weights
    layer_params = sum(a.size for layer in w.layers for a in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
    attention = cfg.n_layers * 2 * 2 * cfg.n_heads * cfg.head_dim * T * (T + 1) / 2
    return 2 * layer_params * T + attention + 2 * w.lm_head.size


def pool_for(model: Model, tokens: int) -> KVPool:
    return KVPool(model.config, (tokens + 64) * model.config.kv_bytes_per_token, 16)


def prefill_into(model: Model, cache: KVCache, tokens: np.ndarray) -> None:
    """`tokens` through `forward` in CHUNK-sized chunks, as a chunked prefill runs."""
    for lo in range(0, len(tokens), CHUNK[0]):
        forward(model, [Segment(tokens[lo : lo + CHUNK[0]], cache, lo)])


def prefill(bench: Bench) -> None:
    """Prefill tok/s per prompt length against FLOPs / the GEMM rate around it; peak RSS of the longest."""
    model = bench.model
    # Untimed: the first forward compiles the decode kernel (seconds on a host without numba's cache) and starts the
    # attention threads, which the engine does before health says SERVING. With --repeat 1 it would be timed.
    prefill_into(model, KVCache(model.config, 1024), np.zeros(1024, np.int64))
    for T in fitting(model, POINTS["prefill"]):
        tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, T)  # (T,)
        pool = pool_for(model, T)
        runs = 1 if T >= 16384 else bench.repeat  # a 32k prefill takes minutes: its best-of is one run

        def run() -> None:
            cache = pool.allocate(T)
            assert cache is not None
            prefill_into(model, cache, tokens)
            pool.free(cache)

        rss: dict[str, int] = {}
        seconds, (gemm_rate,) = bracketed(sampled(lambda: best_time(run, runs, bench.clock), rss), lambda: measure_gemm(bench))  # noqa: B023
        bound = gemm_rate.rate * 1e9 / prefill_flops(model, T) * T  # tok/s at the GEMM rate
        bench.report(f"prefill {T:>5} tokens, chunk {CHUNK[0]} ({seconds:6.1f} s)", f"{T / seconds:8.0f} tok/s",
                     f"bound {bound:6.0f} tok/s: {T / seconds / bound:.2f} x (goal >= 0.5 at 16k); "
                     + gemm_rate.note("GEMM", "GFLOP/s"))
        if T == max(fitting(model, POINTS["prefill"])):
            bench.report(f"peak RSS of the {T}-token prefill", f"{rss['peak'] / 2**20:8.0f} MiB",
                         f"{rss['before'] / 2**20:.0f} MiB before (model, earlier sections)")


def decode(bench: Bench) -> None:
    """Decode tok/s per batch x context against (weights + KV bytes) / the copy bandwidth around it, and / the read
    bandwidth around it; peak RSS of the largest."""
    model = bench.model
    weight_bytes = model.weights.decode_bytes
    bench.report("decode weight bytes per step", f"{weight_bytes / 1e6:8.1f} MB")
    contexts, batches = fitting(model, POINTS["contexts"], DECODE_STEPS * (bench.repeat + 1)), POINTS["batches"]
    runs_on = {g: gemm.resolve(g, gemm.cpu_vendor()) for g in GEMM}  # auto is mkl or numpy: one packed copy per kind
    built = {kind: gemm.weight_matmul(model.weights, kind, attention_threads()) for kind in set(runs_on.values())}
    matmul_of = {g: built[kind] for g, kind in runs_on.items()}
    for context in contexts:
        source = KVCache(model.config, context)
        prefill_into(model, source, np.random.default_rng(2).integers(0, model.config.vocab_size, context))
        k, v = source.k[:, :context], source.v[:, :context]  # (n_layers, context, KV, hd) each
        for batch, arm, matmuls in ((b, a, g) for b in batches for a in ATTENTION for g in GEMM):
            largest = context == max(contexts) and batch == max(batches) and (arm, matmuls) == (ATTENTION[0], GEMM[0])
            rss: dict[str, int] = {}
            seconds, (copy, read) = bracketed(sampled(lambda: decode_step_seconds(bench, batch, context, k, v, arm, matmul_of[matmuls]), rss),  # noqa: B023
                                              lambda: measure_copy(bench), lambda: measure_read(bench))
            ran = gemm.describe(matmul_of[matmuls])  # numpy too when MKL does not load
            step_bytes = weight_bytes + batch * context * model.config.kv_bytes_per_token
            bound = batch * copy.rate * 1e9 / step_bytes  # tok/s if the step only streamed its bytes
            roof = batch * read.rate * 1e9 / step_bytes  # tok/s if it only read them
            label = matmuls if matmuls == ran else f"{matmuls}={ran}"
            bench.report(f"decode batch {batch:>2}, context {context:>5}, {arm}, {label} ({seconds * 1e3:6.1f} ms/step)",
                         f"{batch / seconds:8.0f} tok/s",
                         f"bound {bound:6.0f} tok/s: {batch / seconds / bound:.2f} x (goal >= 0.5 at batch 32); "
                         f"read roof {roof:6.0f} tok/s: {batch / seconds / roof:.2f} x; "
                         + copy.note("copy", "GB/s") + "; " + read.note("read", "GB/s"))
            if largest:
                bench.report(f"peak RSS of batch {batch} x {context}", f"{rss['peak'] / 2**20:8.0f} MiB",
                             f"{rss['before'] / 2**20:.0f} MiB before; KV {batch * context * model.config.kv_bytes_per_token / 2**20:.0f} MiB")


def decode_caches(bench: Bench, batch: int, context: int, k: np.ndarray, v: np.ndarray) -> list[KVCache]:
    """`batch` sequences that each hold a copy of `k`, `v` in their own pool blocks (the pool is sized for them: the
    tables are long consecutive runs, as after a quiet admission), with room for the timed steps."""
    room = context + DECODE_STEPS * (bench.repeat + 1)
    pool = pool_for(bench.model, batch * (room + 16))
    caches = []
    for _ in range(batch):  # copy the prefilled context instead of prefilling `batch` times
        cache = pool.allocate(room)
        assert cache is not None
        cache.k[:, :context], cache.v[:, :context] = k, v
        cache.set_length(context)
        caches.append(cache)
    return caches


def decode_step_seconds(bench: Bench, batch: int, context: int, k: np.ndarray, v: np.ndarray, attention: str,
                        matmul: gemm.Matmul | None = None) -> float:
    """Best wall time of one decode step over `decode_caches`, attending with `attention` (numba | numpy), the
    weights multiplied by `matmul` (default: the engine's, as `gemm: auto` picks it)."""
    model = bench.model if matmul is None else replace(bench.model, matmul=matmul)
    caches = decode_caches(bench, batch, context, k, v)
    tokens = np.zeros(1, np.int64)  # (1,)

    def step() -> None:
        forward(model, [Segment(tokens, c, c.length) for c in caches], attention=attention)

    step()  # warm-up
    return best_time(lambda: [step() for _ in range(DECODE_STEPS)], bench.repeat, bench.clock) / DECODE_STEPS


def attention_split(bench: Bench) -> None:
    """Attention's tasks on one thread vs spread over the process's cores (model.attention_groups), for the largest
    decode batch at the first context and the second prefill point, in alternating paired runs so a drifting load on
    a shared machine hits both alike (median of the pairs)."""
    from stack.engine import model as model_module

    measured = model_module.attention_threads  # swapped per run below, restored at the end
    threads = measured()
    if threads == 1:
        bench.report("attention split", "skipped", "one core (or OPENBLAS_NUM_THREADS=1): nothing to split over")
        return
    model = bench.model
    context, batch = fitting(model, POINTS["contexts"], DECODE_STEPS * (bench.repeat + 1))[0], max(POINTS["batches"])
    T = fitting(model, POINTS["prefill"])[min(1, len(POINTS["prefill"]) - 1)]
    source = KVCache(model.config, context)
    prefill_into(model, source, np.random.default_rng(2).integers(0, model.config.vocab_size, context))
    tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, T)  # (T,)

    def prefill_seconds() -> float:
        return best_time(lambda: prefill_into(model, KVCache(model.config, T), tokens), 1, bench.clock)

    arms = {f"decode batch {batch}, context {context}, {ATTENTION[0]}": lambda: decode_step_seconds(
                bench, batch, context, source.k[:, :context], source.v[:, :context], ATTENTION[0]),
            f"prefill {T} tokens": prefill_seconds}
    try:
        for label, seconds in arms.items():
            one, split = [], []
            for _ in range(bench.repeat):
                model_module.attention_threads = lambda: 1  # type: ignore[assignment]
                one.append(seconds())
                model_module.attention_threads = lambda: threads  # type: ignore[assignment]
                split.append(seconds())
            bench.report(f"{label}: attention on {threads} threads", f"{float(np.median(np.array(one) / np.array(split))):8.2f} x",
                         "one thread's time / split time (paired median)")
    finally:
        model_module.attention_threads = measured  # type: ignore[assignment]


def numba_decode(bench: Bench) -> None:
    """One layer's attention of the largest decode batch, numpy path vs the engine's compiled kernel (attention_kernels.py)."""
    model, batch = bench.model, max(POINTS["batches"])
    for context in fitting(model, POINTS["contexts"], DECODE_STEPS * (bench.repeat + 1)):
        source = KVCache(model.config, context)
        prefill_into(model, source, np.random.default_rng(2).integers(0, model.config.vocab_size, context))
        caches = decode_caches(bench, batch, context, source.k[:, :context], source.v[:, :context])
        attention_kernels.compare(bench, caches, f"batch {batch} x {context}")


def fitting(model: Model, points: list[int], slack: int = 0) -> list[int]:
    """The points the model's context holds (dummy:tiny stops at 512)."""
    return [p for p in points if p + slack <= model.config.max_seq_len]


@contextmanager
def rss_peak(interval_s: float = 0.01) -> Iterator[dict[str, int]]:
    """Resident bytes before and at the peak of the block, sampled from /proc/self/statm every `interval_s`."""
    page = os.sysconf("SC_PAGE_SIZE")

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    out = {"before": resident(), "peak": resident()}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval_s):
            out["peak"] = max(out["peak"], resident())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield out
    finally:
        done.set()
        sampler.join()
        out["peak"] = max(out["peak"], resident())


def sampled(fn: Callable[[], R], rss: dict[str, int]) -> Callable[[], R]:
    """`fn`, with the resident memory of its own run (not of the rates measured around it) put in `rss` (rss_peak)."""
    def run() -> R:
        with rss_peak() as peak:
            result = fn()
        rss.update(peak)
        return result
    return run


def stability(bench: Bench) -> None:
    """GEMM again at the end: on a shared machine a large drift means the ratios above are unreliable."""
    drift = measure_gemm(bench) / bench.baselines["gemm_gflops"]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    bench.report("GEMM at end / GEMM at start", f"{drift:8.2f}", f"(far from 1.0: the load changed); load average {load}")


# Append a section (a function taking the `Bench`) to add figures; baselines run first.
SECTIONS: list[Section] = [gemm_peak, copy_bandwidth, read_bandwidth, blas, socket_bandwidth, prefill, decode, attention_split, numba_decode,
                           kv_transfer, stability]


def arms(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """A parser of comma-separated arms, each one of `choices`."""
    def parse(text: str) -> list[str]:
        chosen = text.split(",")
        if not chosen or any(arm not in choices for arm in chosen):
            raise argparse.ArgumentTypeError(f"arms are {', '.join(choices)}, got {text!r}")
        return chosen
    return parse


def points(argv: list[str]) -> list[str]:
    """Read this benchmark's own flags into POINTS / CHUNK; the rest go to the shared CLI."""
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--quick", action="store_true", help="prefill 1k and 4k, context 800 only")
    parser.add_argument("--prefill", type=ints, help="prompt lengths, comma-separated")
    parser.add_argument("--contexts", type=ints, help="decode contexts, comma-separated")
    parser.add_argument("--batches", type=ints, help="decode batch sizes, comma-separated")
    parser.add_argument("--chunk", type=int, default=CHUNK[0], help="prefill chunk in tokens")
    parser.add_argument("--attention", type=arms(batched_decode.ATTENTION), default=ATTENTION,
                        help="decode attention arms, comma-separated: numba (the engine's kernel, default), numpy")
    parser.add_argument("--gemm", type=arms(gemm.GEMM), default=GEMM,
                        help="decode weight-matmul arms, comma-separated: auto (the engine's default), mkl, numba, numpy")
    args, rest = parser.parse_known_args(argv)
    POINTS.update(QUICK if args.quick else FULL)
    POINTS.update({key: getattr(args, key) for key in ("prefill", "contexts", "batches") if getattr(args, key)})
    CHUNK[0] = args.chunk
    ATTENTION[:] = args.attention
    GEMM[:] = args.gemm
    print(f"points: prefill {POINTS['prefill']}, decode contexts {POINTS['contexts']} x batches {POINTS['batches']}, "
          f"chunk {CHUNK[0]}, attention {ATTENTION}, gemm {GEMM}")
    return rest


if __name__ == "__main__":
    _common.main(__spec__.name, "engine", __doc__.splitlines()[0], SECTIONS, points(sys.argv[1:]))
