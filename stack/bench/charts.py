"""Latency and goodput against load, one line per arm: the median over the repeats, the band their min–max."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stack.bench import report, spread, summary, sweep

PANELS = (("request_goodput", "goodput (req/s meeting every SLO)", "Goodput"),
          ("p99_ttft_ms", "TTFT P99 (ms)", "Time to first token"),
          ("p99_tpot_ms", "TPOT P99 (ms)", "Time per output token"),
          ("p99_itl_ms", "ITL P99 (ms)", "Inter-token latency"))


def series(grouped: Mapping[int, Sequence[Mapping[str, Any]]], key: str) -> tuple[list[float], list[spread.Spread]]:
    """(load points, the figure's spread at each) over the repeats that ran the point."""
    points = sorted({float(r["sweep_point"]) for rs in grouped.values() for r in rs})
    rows = [(p, spread.spread([(sweep.at_point(rs, p) or {}).get(key) for rs in grouped.values()])) for p in points]
    have = [(p, s) for p, s in rows if s is not None]
    return [p for p, _ in have], [s for _, s in have]


def load_chart(runs: Sequence[Mapping[str, Any]], path: Path, axis: str, title: str = "") -> Path:
    """PNG: goodput and the P99 latencies against the load point, per arm (median line, min–max band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4.2))
    for arm, grouped in summary.by_arm(runs).items():
        for ax, (key, _, _) in zip(axes, PANELS):
            points, spreads = series(grouped, key)
            if not points:
                continue
            line, = ax.plot(points, [s.median for s in spreads], marker="o", label=arm)
            ax.fill_between(points, [s.low for s in spreads], [s.high for s in spreads], color=line.get_color(), alpha=0.15)
    for ax, (key, ylabel, heading) in zip(axes, PANELS):
        ax.set_xlabel(f"offered load ({axis})")
        ax.set_ylabel(ylabel)
        ax.set_title(heading)
        if key != "request_goodput":
            ax.set_yscale("log")  # tails past the knee grow by orders of magnitude
            ax.yaxis.set_major_formatter(ScalarFormatter())  # 300, not 3×10²
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel with no figure (no --goodput SLOs) has no lines to name
            ax.legend(fontsize="small")
    return report.save_figure(fig, path, title)
