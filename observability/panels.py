"""Render the PD overview's key panels as one PNG from Prometheus' query_range data (Grafana cannot run here).

    python -m observability.panels [--prometheus http://127.0.0.1:9090] [--minutes 10] [--out docs/pd-overview.png]

The panels are the dashboard's own (observability/dashboards.py, same PromQL and legends): TTFT and
ITL P50/P99, requests by status, goodput, KV transfer GB/s and P and D utilisation. A host tool
(matplotlib is in the dev extra); exits 1 with a message when Prometheus is unreachable or has no data.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from observability.dashboards import OVERVIEW, Panel

KEY_PANELS = ("TTFT P50 / P99", "ITL P50 / P99", "Requests by status", "Goodput", "KV transfer GB/s", "P and D utilisation")


@dataclass(frozen=True)
class Series:
    legend: str
    times: list[float]  # unix seconds
    values: list[float]


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    """Prometheus /api/v1/query_range result (a list of {metric, values}); raises on an API error."""
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"query {expr!r} failed: {body.get('error')}")
    return body["data"]["result"]


def legend_for(template: str, labels: dict[str, str]) -> str:
    """Grafana's {{label}} legend templating."""
    text = template
    for key, value in labels.items():
        text = text.replace("{{" + key + "}}", value)
    return text


def panel_series(prometheus: str, panel: Panel, start: float, end: float, step: float) -> list[Series]:
    out = []
    for expr, legend in panel.targets:
        for result in query_range(prometheus, expr, start, end, step):
            points = [(float(t), float(v)) for t, v in result["values"] if v not in ("NaN", "+Inf", "-Inf")]
            if points:
                out.append(Series(legend_for(legend, result["metric"]), [t for t, _ in points], [v for _, v in points]))
    return out


def render(data: dict[str, list[Series]], units: dict[str, str], out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(12, 10), constrained_layout=True)
    fig.suptitle(title, fontsize=13)
    for ax, (name, series) in zip(axes.flat, data.items()):
        scale, unit = _scale(units[name], series)
        for s in series:
            ax.plot([datetime.fromtimestamp(t) for t in s.times], [v * scale for v in s.values], label=s.legend, linewidth=1.6)
        ax.set_title(name, fontsize=11)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(_time_locator(mdates, series))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        if series:
            ax.legend(fontsize=8, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def _time_locator(mdates, series: list[Series]):
    """About five ticks on round seconds or minutes (AutoDateLocator repeats labels on short ranges)."""
    times = [t for s in series for t in s.times]
    span = (max(times) - min(times)) if times else 60.0
    step = next((n for n in (5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600) if span / n <= 6), 7200)
    if step < 60:
        return mdates.SecondLocator(bysecond=range(0, 60, step))
    return mdates.MinuteLocator(byminute=range(0, 60, step // 60)) if step < 3600 else mdates.HourLocator()


def _scale(unit: str, series: list[Series]) -> tuple[float, str]:
    """Readable axis units: ms for small seconds, % for ratios."""
    if unit == "s":
        top = max((max(s.values) for s in series if s.values), default=0.0)
        return (1000.0, "ms") if top < 1 else (1.0, "s")
    if unit == "percentunit":
        return 100.0, "%"
    return 1.0, {"reqps": "req/s", "GBs": "GB/s"}.get(unit, unit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    parser.add_argument("--minutes", type=float, default=10, help="time range ending now")
    parser.add_argument("--step", type=float, default=0, help="query step in seconds (default: range/120, at least 1)")
    parser.add_argument("--out", type=Path, default=Path("docs/pd-overview.png"), help="PNG file to write")
    args = parser.parse_args(argv)
    end = time.time()
    start = end - args.minutes * 60
    step = args.step or max(1.0, (end - start) / 120)
    panels = {p.title: p for p in OVERVIEW if p.title in KEY_PANELS}
    try:
        data = {name: panel_series(args.prometheus, panels[name], start, end, step) for name in KEY_PANELS}
    except OSError as exc:
        print(f"error: cannot query Prometheus at {args.prometheus}: {exc} (is `./pd up --observability` running?)", file=sys.stderr)
        return 1
    if not any(data.values()):
        print(f"error: Prometheus at {args.prometheus} has no data for the last {args.minutes} min: send some requests first", file=sys.stderr)
        return 1
    stamp = datetime.fromtimestamp(end).strftime("%Y-%m-%d %H:%M")
    render(data, {name: panels[name].unit for name in KEY_PANELS}, args.out, f"pd-deploy PD overview — last {args.minutes:g} min to {stamp}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
