"""Colocated-vs-disaggregated report: Markdown tables and PNG charts from result dicts.

Pure functions over the dicts `serve.benchmark` returns (with per-request lists), for one load point of one repeat
(compare's detail section); the figures over repeats are stack/bench/summary.py's. The wide table divides the last
arm by the first.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

Result = Mapping[str, Any]

LATENCY_ROWS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
STATS = (("mean", "mean"), ("median", "median"), ("p99", "P99"))


def _ratio(value: float | None, baseline: float | None) -> str:
    if value is None or not baseline:
        return "–"
    return f"{value / baseline:.2f}×"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def comparison_table(results: Mapping[str, Result]) -> str:
    """Markdown: one column per stack plus `<last> / <first>` ratios (latencies in ms)."""
    names = list(results)
    first, last = results[names[0]], results[names[-1]]
    header = f"| Metric | {' | '.join(names)} | {names[-1]} / {names[0]} |"
    lines = [header, "|---" * (len(names) + 2) + "|"]

    def add(label: str, key: str, digits: int = 1) -> None:
        values = [r.get(key) for r in results.values()]
        cells = " | ".join(_fmt(v, digits) for v in values)
        lines.append(f"| {label} | {cells} | {_ratio(last.get(key), first.get(key))} |")

    for metric, name in LATENCY_ROWS:
        for stat, stat_label in STATS:
            if f"{stat}_{metric}_ms" in first:
                add(f"{name} {stat_label} (ms)", f"{stat}_{metric}_ms")
    if first.get("request_goodput") is not None:
        add("Goodput (req/s)", "request_goodput", 3)
        add("SLO attainment (good / sent)", "slo_attainment", 3)
    add("Request throughput (req/s)", "request_throughput", 3)
    add("Output throughput (tok/s)", "output_throughput", 1)
    add("Completed", "completed", 0)
    add("Failed", "failed", 0)
    return "\n".join(lines)


def cache_table(results: Mapping[str, Result]) -> str:
    """Markdown: per arm, the prompt tokens the engines served from their prefix caches (router /metrics) and how the
    router placed the legs (cache_aware decisions)."""
    lines = ["| Arm | prompt tokens | cached | hit rate | routing decisions |", "|---|---|---|---|---|"]
    for name, result in results.items():
        cache = result.get("router_cache") or {}
        decisions = ", ".join(f"{k} {int(v)}" for k, v in sorted((cache.get("affinity_decisions") or {}).items())) or "–"
        rate = cache.get("hit_rate")
        lines.append(f"| {name} | {_fmt(cache.get('prompt_tokens'), 0)} | {_fmt(cache.get('cached_tokens'), 0)} | "
                     f"{'–' if rate is None else f'{100 * rate:.0f} %'} | {decisions} |")
    return "\n".join(lines)


def per_request_samples(result: Result) -> dict[str, np.ndarray]:
    """TTFT, TPOT, E2EL per completed request and pooled ITL, in ms, from the detailed lists."""
    ok = [i for i, error in enumerate(result["errors"]) if not error]
    ttft = np.array([result["ttfts"][i] for i in ok]) * 1000
    latency = np.array([result["latencies"][i] for i in ok]) * 1000
    outputs = np.array([result["output_lens"][i] for i in ok])
    multi = outputs > 1
    tpot = (latency[multi] - ttft[multi]) / (outputs[multi] - 1)
    itl = np.array([gap for i in ok for gap in result["itls"][i]]) * 1000
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2el": latency}


def save_figure(fig, path: Path, title: str) -> Path:
    """Title, layout and write one figure as PNG, then free it."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def comparison_chart(results: Mapping[str, Result], path: Path, title: str = "") -> Path:
    """PNG: CDFs of TTFT, TPOT and ITL per stack, and P99 bars side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    samples = {name: per_request_samples(r) for name, r in results.items()}
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, (metric, label) in zip(axes, LATENCY_ROWS[:3]):
        for name, s in samples.items():
            values = np.sort(s[metric])
            if values.size:
                ax.plot(values, np.arange(1, values.size + 1) / values.size, label=name)
        ax.set_xscale("log")  # latencies span orders of magnitude; tails matter
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap on short ranges
        ax.set_xlabel(f"{label} (ms, log scale)")
        ax.set_ylabel("fraction of samples ≤ x")
        ax.set_title(f"{label} CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    bar_ax = axes[3]
    width = 0.8 / len(results)
    for k, (name, r) in enumerate(results.items()):
        p99 = [r.get(f"p99_{m}_ms") or 0.0 for m, _ in LATENCY_ROWS[:3]]
        bar_ax.bar(np.arange(3) + k * width, p99, width, label=name)
    bar_ax.set_xticks(np.arange(3) + width * (len(results) - 1) / 2, [label for _, label in LATENCY_ROWS[:3]])
    bar_ax.set_yscale("log")
    bar_ax.set_ylabel("P99 (ms, log scale)")
    bar_ax.set_title("P99 latency")
    bar_ax.legend()
    return save_figure(fig, path, title)
