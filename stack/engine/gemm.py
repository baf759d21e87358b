"""The weight matmuls: a decode batch's few rows through oneMKL's packed GEMM on an Intel CPU and through our compiled
kernel on others, numpy (OpenBLAS) for the rest; and MKL's GEMM for a prefill's attention tiles when the weights run
on it.

Every step multiplies its N rows of activations by each weight matrix (model.py). With 2 to a few hundred rows
(a decode batch) OpenBLAS's GEMM copies ("packs") every panel of the weight into its kernel's layout on every
call, and that copy costs more than the multiply: on a 2-core AVX-512 Xeon dummy:small's matmuls at 32 rows read
the weights at 7 GB/s, and 2 rows took 3.5x as long as 1 (one row goes through GEMV, which does not pack).
oneMKL packs a matrix once (`cblas_sgemm_pack`) and multiplies by the packed copy any number of times
(`cblas_sgemm_compute`), which is what the CPU backends of vLLM and PyTorch do with oneDNN's prepacked weights.
Figures: docs/engine.md, "Weight matmuls".

- **Which rows**: `MIN_ROWS`..`MAX_ROWS` go to MKL. One row stays on numpy (GEMV reads the weights once; MKL took
  1.12x its time), and so do prefill chunks, where the packing is a small share of the work and the two ran level.
- **Where MKL comes from**: the `mkl` wheel (PyPI), whose `intel-openmp` dependency brings the OpenMP runtime
  of MKL's threads; both put their libraries in the environment's `lib/`. MKL uses as many threads as the
  attention split (`model.attention_threads()`), and its idle threads sleep as soon as a call ends instead of
  spinning 200 ms, OpenMP's default, on the cores the attention kernel needs next (`KMP_BLOCKTIME`).
- **A prefill's attention tiles** (`PackedMatmul.tile`): when the weights run on MKL, attention.py's score tiles
  multiply on it too (unpacked, the pool's strided K and V read in place, one thread per attention thread):
  a 16k prefill in 0.93x the time of the same tiles on OpenBLAS.
- **Numerics**: the same float32 products summed in another order: within 1e-6 relative of numpy, and the engine's
  tests hold a model on MKL to the numpy model and the float64 reference (tests/unit/engine_core/test_gemm.py).
- **Which CPUs** (`gemm: auto`, the default): MKL on Intel's only, as CTranslate2 decides for its MKL backend. On
  other CPUs MKL runs its generic code: on a 2-core AMD EPYC (AVX2) it announced "Intel(R) Architecture processors"
  (`MKL_VERBOSE=1`) where an Intel CPU gets its AVX2 or AVX-512 kernels, and its packed GEMM took 2.5x OpenBLAS's
  time at 8 rows and 1.8x at 32. `gemm: mkl` uses it on any CPU.
- **Elsewhere, the compiled kernel** (`CompiledMatmul`, `gemm: numba`, auto on a CPU not Intel's): numba's
  `kernels.rows_matmul` multiplies 2..MAX_ROWS rows by each weight stored transposed, a copy made at load, so
  nothing is packed per call. On a 2-core Zen 4 EPYC dummy:small's matmuls took 0.6x OpenBLAS's time at 8 rows and
  0.8x at 32. Without numba it is numpy (the `engine.attention` line already warns `numba_missing`).
- **Without either** (`gemm: numpy` in the engine's config.json, `PD_GEMM=numpy`, or no loadable library) every
  matmul is numpy's; MKL wanted and missing logs one `engine.gemm` warning with `reason: mkl_missing`.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import numpy as np

from stack.common import events
from stack.common.logging import log_event
from stack.engine import batched_decode
from stack.engine.config import Gemm
from stack.engine.weights import Weights

GEMM = get_args(Gemm)  # auto (default: mkl on an Intel CPU, numba elsewhere) | mkl | numba | numpy (config `gemm`)
INTEL = "GenuineIntel"  # the CPUID vendor string of the CPUs MKL runs its own kernels on
MIN_ROWS = 2  # one row: OpenBLAS's GEMV (MKL packed took 1.12x its time)
# Past this OpenBLAS's packing is a small share: level at 2,048 rows, MKL 0.87x at 128 on the Xeon, the compiled
# kernel 0.8x at 128 and 0.9x at 256 on the Zen 4 EPYC.
MAX_ROWS = 256
PACK_ROWS = 32  # the row count MKL is told at packing time; the packed copy serves any count (checked in tests)

Matmul = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (rows, k) @ (k, n) -> (rows, n)

_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162  # mkl_cblas.h
_THREADING_INTEL = 0  # mkl_service.h: MKL_THREADING_INTEL, threads from intel-openmp's libiomp5
_C = ctypes.c_int
_P = ctypes.c_void_p


def load_mkl(threads: int) -> ctypes.CDLL | None:
    """oneMKL's single dynamic library from this environment's lib/ (where the `mkl` wheel puts it) or the
    loader's path, set to `threads` OpenMP threads; None when there is none."""
    # Read by intel-openmp when MKL first starts its threads, so set before any call; an operator's value wins.
    # Sleeping at once (0) ran batch-32 decode 1.2-1.3x faster than OpenBLAS on a quiet 2-core Xeon; 1 ms ran level
    # with it and the default 200 ms slower (docs/engine.md, "Weight matmuls").
    os.environ.setdefault("KMP_BLOCKTIME", "0")
    for name in (str(Path(sys.prefix) / "lib" / "libmkl_rt.so.3"), "libmkl_rt.so.3", "libmkl_rt.so.2"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return None
    lib.MKL_Set_Threading_Layer(_THREADING_INTEL)
    lib.MKL_Set_Num_Threads(threads)
    lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
    lib.cblas_sgemm_pack_get_size.argtypes = [_C, _C, _C, _C]
    lib.cblas_sgemm_pack.argtypes = [_C, _C, _C, _C, _C, _C, ctypes.c_float, _P, _C, _P]
    lib.cblas_sgemm_compute.argtypes = [_C, _C, _C, _C, _C, _C, _P, _C, _P, _C, ctypes.c_float, _P, _C]
    lib.cblas_sgemm.argtypes = [_C, _C, _C, _C, _C, _C, ctypes.c_float, _P, _C, _P, _C, ctypes.c_float, _P, _C]
    lib.MKL_Set_Num_Threads_Local.argtypes = [_C]
    return lib


class PackedMatmul:
    """`x @ w` for each weight matrix of one model, through MKL's packed copy of `w` for MIN_ROWS..MAX_ROWS rows.

    The packed copies (as large as the weights) live as long as this object; MKL forbids moving them, and numpy
    never moves an array's buffer.
    """

    def __init__(self, lib: ctypes.CDLL, weights: Weights) -> None:
        self._lib = lib
        self._packed: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}  # id(w) -> (w, packed buffer, its address)
        for matrix in weight_matrices(weights):
            self._pack(matrix)

    def _pack(self, w: np.ndarray) -> None:
        k, n = w.shape  # (k, n) float32: C-contiguous, or the transposed embedding of a tied lm_head
        transposed = not w.flags.c_contiguous and w.T.flags.c_contiguous
        source = w.T if transposed else np.ascontiguousarray(w)  # row-major (n, k) or (k, n)
        size = self._lib.cblas_sgemm_pack_get_size(_B_MATRIX, PACK_ROWS, n, k)
        buffer = np.empty(size + 64, np.uint8)
        address = buffer.ctypes.data + (-buffer.ctypes.data) % 64  # 64-byte aligned, as MKL's own allocator gives
        self._lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS if transposed else _NO_TRANS, PACK_ROWS, n, k, 1.0,
                                   source.ctypes.data, source.shape[1], address)
        self._packed[id(w)] = (w, buffer, address)

    def __call__(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        packed = self._packed.get(id(w))
        if packed is None or not MIN_ROWS <= rows <= MAX_ROWS or x.dtype != np.float32 or not x.flags.c_contiguous:
            return x @ w
        k, n = w.shape
        out = np.empty((rows, n), np.float32)  # (rows, n)
        self._lib.cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, rows, n, k, x.ctypes.data, k, packed[2], n, 0.0,
                                      out.ctypes.data, n)
        return out

    def tile(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """a @ b for a prefill's attention tiles (attention.TileOps): a (rows, k) block of queries or scores, b (k, n)
        a K tile transposed or a V tile, each a strided view of one KV head in the pool, read in place. One MKL
        thread on the calling thread: forward's two attention threads call this at once (docs/engine.md: 0.87x
        OpenBLAS's time on a 16k prefill's tiles). Anything else goes to numpy."""
        rows, k = a.shape
        n = b.shape[1]
        if b.strides[1] == 4 and b.strides[0] >= 4 * n:
            trans, ld = _NO_TRANS, b.strides[0] // 4
        elif b.strides[0] == 4 and b.strides[1] >= 4 * k:
            trans, ld = _TRANS, b.strides[1] // 4
        else:
            return a @ b
        if a.dtype != np.float32 or b.dtype != np.float32 or a.strides[1] != 4 or a.strides[0] < 4 * k or not rows * n * k:
            return a @ b
        out = np.empty((rows, n), np.float32)  # (rows, n)
        previous = self._lib.MKL_Set_Num_Threads_Local(1)
        try:
            self._lib.cblas_sgemm(_ROW_MAJOR, _NO_TRANS, trans, rows, n, k, 1.0, a.ctypes.data, a.strides[0] // 4,
                                  b.ctypes.data, ld, 0.0, out.ctypes.data, n)
        finally:
            self._lib.MKL_Set_Num_Threads_Local(previous)  # the thread's weight matmuls keep MKL's own count
        return out


class CompiledMatmul:
    """`x @ w` for each weight matrix of one model, through the compiled `kernels.rows_matmul` for MIN_ROWS..MAX_ROWS
    rows, which reads the weights transposed: a copy of each made here (a tied lm_head is the embedding, already so).
    """

    def __init__(self, kernel: Callable[..., None], weights: Weights, row_block: int) -> None:
        self._kernel = kernel
        self._row_block = row_block  # kernels.ROW_BLOCK (that module imports numba: not imported here)
        # id(w) -> (w, w transposed and C-contiguous); w is kept so that its id is never another array's
        self._transposed = {id(w): (w, np.ascontiguousarray(w.T)) for w in weight_matrices(weights)}

    def __call__(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        entry = self._transposed.get(id(w))
        if entry is None or not MIN_ROWS <= rows <= MAX_ROWS or x.dtype != np.float32:
            return x @ w
        padded = -(-rows // self._row_block) * self._row_block  # the kernel takes whole blocks of rows
        if padded != rows or not x.flags.c_contiguous:
            whole = np.zeros((padded, x.shape[1]), np.float32)  # (padded, k) C-contiguous, the padding rows 0
            whole[:rows] = x
            x = whole
        out = np.empty((padded, w.shape[1]), np.float32)  # (padded, n)
        batched_decode.launch(self._kernel, x, entry[1], out)
        return out[:rows]


def weight_matrices(weights: Weights) -> list[np.ndarray]:
    """Every matrix `forward` multiplies by: each layer's four, and the lm_head."""
    return [*(m for layer in weights.layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)),
            weights.lm_head]


def cpu_vendor() -> str:
    """This CPU's vendor string as the kernel reports it (GenuineIntel, AuthenticAMD, ...); "unknown" without one."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown"


def resolve(gemm: str, vendor: str) -> str:
    """mkl | numba | numpy: what `gemm` asks for on a CPU of `vendor` (auto: MKL on Intel's, where it runs its own
    kernels; the compiled kernel on others)."""
    assert gemm in GEMM, f"gemm is one of {GEMM}, got {gemm!r}"
    if gemm == "auto":
        return "mkl" if vendor == INTEL else "numba"
    return gemm


def weight_matmul(weights: Weights, gemm: str, threads: int) -> Matmul:
    """The matmul `forward` runs the weights through: MKL's packed GEMM when `gemm` resolves to "mkl" and MKL loads
    (else numpy's, with one `engine.gemm` warning), the compiled kernel for "numba" (numpy's without numba),
    numpy's for "numpy"."""
    kind = resolve(gemm, cpu_vendor())
    if kind == "numpy":
        return np.matmul
    if kind == "numba":
        compiled = batched_decode.compiled()  # None without numba: logged once there (engine.attention, numba_missing)
        if compiled is None:
            return np.matmul
        from stack.engine.kernels import ROW_BLOCK  # numba imports: compiled() said it does

        return CompiledMatmul(compiled.matmul, weights, ROW_BLOCK)
    lib = load_mkl(threads)
    if lib is None:
        log_event(events.ENGINE_GEMM, "oneMKL (libmkl_rt) cannot be loaded: the weight matmuls run on numpy",
                  "WARNING", gemm="numpy", reason="mkl_missing")
        return np.matmul
    return PackedMatmul(lib, weights)


def log_matmuls(matmul: Matmul) -> None:
    """The warm-up's one `engine.gemm` line: what the weight matmuls run on, on which CPU (the doctor reads both)."""
    matmuls, vendor = describe(matmul), cpu_vendor()
    log_event(events.ENGINE_GEMM, f"weight matmuls: {matmuls}, CPU vendor {vendor} (stack/engine/gemm.py)",
              gemm=matmuls, cpu_vendor=vendor)


def tile_matmul(matmul: Matmul) -> Matmul:
    """What a prefill's attention tiles multiply with: MKL's (PackedMatmul.tile) when the weights run on it."""
    return matmul.tile if isinstance(matmul, PackedMatmul) else np.matmul


def describe(matmul: Matmul) -> str:
    """What `matmul` runs on, as the engine.gemm line says it: mkl | numba | numpy."""
    if isinstance(matmul, PackedMatmul):
        return "mkl"
    return "numba" if isinstance(matmul, CompiledMatmul) else "numpy"
