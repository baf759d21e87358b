"""Engines on a slow path: decode attention or weight matmuls that fell back to numpy, or oneMKL on a CPU it runs
its generic code on.

Each of our engines says at warm-up what its decode attention and its weight matmuls run on (`engine.attention`,
`engine.gemm`: stack/engine/batched_decode.py and gemm.py). Three of those lines name a path slower than the one
the image ships, and nothing else shows it: requests still succeed, only slower.
- attention numpy, reason numba_missing: numba did not import, so a decode batch's attention is some twenty numpy
  calls per sequence and layer instead of one compiled call (2-4x the kernel's time at batch 32, docs/engine.md),
  and on a CPU that is not Intel's the weight matmuls run on OpenBLAS instead of the compiled kernel;
- gemm numpy, reason mkl_missing: MKL was wanted (an Intel CPU, or `gemm: mkl`) and libmkl_rt did not load;
- gemm mkl on a CPU whose vendor is not GenuineIntel (`PD_GEMM=mkl` or `gemm: mkl`): MKL runs its generic code
  there; on an AMD EPYC a decode step of 8 sequences took 1.9x OpenBLAS's time.
A numpy path the operator chose (reason configured, `PD_GEMM=numpy`) is not a finding.
"""

from __future__ import annotations

from doctor import engine_facts
from doctor.findings import Context, Finding, finding
from doctor.parse import Record
from stack.common import events

INTEL = "GenuineIntel"  # CPUID's vendor string: gemm auto picks MKL on it, numba elsewhere (stack/engine/gemm.py; not imported: numpy)

# The fallbacks: (event, reason, finding id, what runs instead, why it is slower, the package to reinstall, more fix).
_FALLBACKS = (
    (events.ENGINE_ATTENTION, "numba_missing", "engine.attention_numpy",
     "decode attention on numpy: numba did not import",
     "numba is a runtime dependency; without it each decode step's attention is some twenty numpy calls per sequence "
     "and layer instead of one compiled call, 2-4x slower at a batch of 32 (docs/engine.md). The engine's line names "
     "the import error.",
     "numba", ""),
    (events.ENGINE_GEMM, "mkl_missing", "engine.gemm_mkl_missing",
     "weight matmuls on numpy: oneMKL (libmkl_rt) did not load",
     "MKL was wanted (the CPU is Intel's, or gemm: mkl) and the mkl wheel's library is not in the engine's "
     "environment, so a decode batch's matmuls re-pack every weight on each call (docs/engine.md, \"Weight matmuls\").",
     "mkl", "; or set PD_GEMM=numpy to choose OpenBLAS on purpose"),
)


def check(ctx: Context) -> list[Finding]:
    found = []
    for event, reason, finding_id, what, cause, package, more in _FALLBACKS:
        fell_back = [r for r in ctx.by_event(event) if r[events.REASON] == reason]
        if fell_back:
            fix = _rebuild(ctx, package) + more
            found.append(finding(finding_id, "warning", f"{_who(fell_back)} {what}", cause, fix, fell_back))
    generic = [r for r in ctx.by_event(events.ENGINE_GEMM)
               if r[events.GEMM] == "mkl" and r[events.CPU_VENDOR] not in (None, INTEL)]
    if generic:
        vendors = ", ".join(sorted({r[events.CPU_VENDOR] for r in generic}))
        restart = "docker compose up -d prefill decode" if engine_facts.compose(ctx) else "restart the engines"
        found.append(finding(
            "engine.gemm_mkl_generic", "warning",
            f"{_who(generic)} weight matmuls on oneMKL with a CPU of vendor {vendors}, where MKL runs its generic code",
            "MKL picks its vectorised kernels on Intel CPUs only; elsewhere it runs code for any x86-64 CPU "
            "(MKL_VERBOSE=1 says \"Intel(R) Architecture processors\"). On an AMD EPYC a decode step of 8 sequences "
            "took 1.9x, and of 32 1.2x, OpenBLAS's time. gemm: mkl (or PD_GEMM=mkl) forces it.",
            "remove PD_GEMM from .env (or set PD_GEMM=auto; gemm: auto in the engine's config.json), which picks "
            f"the compiled kernel (numba) on this CPU; {restart}", generic))
    return found


def _who(records: list[Record]) -> str:
    services = sorted({r.service for r in records})
    return " and ".join(services) + (" engine's" if len(services) == 1 else " engines'")


def _rebuild(ctx: Context, package: str) -> str:
    image = "./pd build && docker compose up -d prefill decode" if engine_facts.compose(ctx) else \
        f"pip install -e . in the engine's environment (pyproject.toml lists {package})"
    return f"reinstall the engine's dependencies: {image}"
