"""One router's figures over another's from a peers-harness run, paired by repeat: median [min–max], with the load.

    python -m benchmarks.peers_ratios RUN.json [--target pd-deploy] [--over smg]

RUN.json is what `benchmarks.router_peers … --out RUN.json` wrote. The harness's table (`report.py`) gives each
router's mean and range; a ratio needs its two arms from the same repeat, because on a small VM a repeat moves every
router's figures together (docs/router-performance.md). For each mode (plain, PD) and each figure the issue sets a
target for (CPU µs a request at concurrency 32, µs a paced and a burst stream chunk, added p50 at concurrency 1 over
the direct plain baseline of the same repeat, as report.py computes it), this prints the median of the per-repeat
ratios and their range, and the 1-minute load average each repeat of `--target` started at. A range that crosses
1.0× is no difference; a figure taken at a load above the core count is no result.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

Run = dict[tuple[int, str, str], dict[str, Any]]


def load(path: Path) -> Run:
    """The run's results by (repeat, target, mode)."""
    return {(r["rep"], r["target"], r["mode"]): r for r in json.loads(path.read_text())["results"]}


def figure(run: Run, rep: int, target: str, mode: str, name: str) -> float | None:
    """One figure of one arm in one repeat, or None when the arm did not run."""
    result = run.get((rep, target, mode))
    if result is None:
        return None
    if name == "added p50 c=1":
        base = run.get((rep, "direct", "plain"))
        return None if base is None else result["seq"]["p50_ms"] - base["seq"]["p50_ms"]
    return {"CPU µs/req": result["c32"]["cpu_us_per_req"], "µs/chunk paced": result["paced"]["cpu_us_per_chunk"],
            "µs/chunk burst": result["burst"]["cpu_us_per_chunk"]}[name]


FIGURES = ("CPU µs/req", "µs/chunk paced", "µs/chunk burst", "added p50 c=1")


def ratios(run: Run, target: str, over: str) -> list[tuple[str, str, list[float], list[float]]]:
    """(mode, figure, the per-repeat ratios, target's loads) for every figure both arms have."""
    reps = sorted({rep for rep, _, _ in run})
    out = []
    for mode in ("plain", "pd"):
        for name in FIGURES:
            pairs = [(figure(run, rep, target, mode, name), figure(run, rep, over, mode, name), rep) for rep in reps]
            kept = [(a / b, run[(rep, target, mode)]["loadavg"]) for a, b, rep in pairs if a is not None and b]
            if kept:
                out.append((mode, name, [r for r, _ in kept], [load for _, load in kept]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers_ratios", description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the JSON benchmarks.router_peers wrote (--out)")
    parser.add_argument("--target", default="pd-deploy", help="the numerator's arm")
    parser.add_argument("--over", default="smg", help="the denominator's arm")
    args = parser.parse_args(argv)
    rows = ratios(load(args.run), args.target, args.over)
    if not rows:
        parser.error(f"no repeat of {args.run} has both {args.target!r} and {args.over!r}")
    print(f"{args.target} over {args.over}, paired by repeat: median [min–max]")
    for mode, name, values, loads in rows:
        print(f"  {mode:<5} {name:<15} {statistics.median(values):5.2f}× [{min(values):.2f}–{max(values):.2f}]"
              f"   {len(values)} repeats, load {min(loads):.2f}–{max(loads):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
