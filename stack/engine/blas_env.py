"""How the engine's BLAS threads behave: environment defaults that must be set before numpy loads OpenBLAS.

`python -m stack.engine` applies them first thing; so does `benchmarks.engine`, so it measures the engine as it
runs. An operator's own value of either variable wins (setdefault). This module imports nothing that loads numpy.
"""

from __future__ import annotations

import os


def apply_defaults() -> None:
    """Set OPENBLAS_NUM_THREADS and OPENBLAS_THREAD_TIMEOUT unless the environment already has them."""
    # One BLAS thread per core this process may run on (its cpuset in compose). OpenBLAS otherwise starts one per
    # online CPU, and threads beyond the cpuset spin against the other engine (decode batch 1 ran 14x slower with 2
    # threads than with 1 on a busy 2-core machine).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    # An idle OpenBLAS worker spins 2^28 cycles (~0.1 s) by default before it sleeps: through every layer's compiled
    # decode attention, which numba runs on the same cores. 2^18 cycles (~0.1 ms) still bridges the gaps between one
    # step's products: batch-32 decode ran 1.17-1.29x faster, batch 1 level (docs/engine.md). 4 (sleep at once)
    # cost batch 1 10-17%: every product then has to wake the worker.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "18")
