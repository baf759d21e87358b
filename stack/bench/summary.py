"""The experiment's tables: per engine, each arm's max goodput at its SLOs and its P99s at a common load, as median
[min–max] over the repeats, each arm's ratios to the best colocated arm, the goals, and `doctor advise`'s verdict
at each load point next to the arm that measured best there.

Input: every run's result dict, with `stack` (the arm), `repeat`, `sweep_point`, `slo_attainment` and `advise` set by
compare. Arms named `vllm:…` are the vLLM-CPU engine, the others the numpy engine; ratios stay within an engine.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from stack.bench import spread, sweep
from stack.bench.spread import Spread

Result = Mapping[str, Any]
P99S = (("p99_ttft_ms", "TTFT P99 (ms)"), ("p99_tpot_ms", "TPOT P99 (ms)"), ("p99_itl_ms", "ITL P99 (ms)"))
# The goals for PD against the best colocated arm: (figure, label, direction, target ratio).
GOALS = (("p99_ttft_ms", "TTFT P99", "<=", 0.5), ("p99_itl_ms", "ITL P99", "<=", 0.5), ("goodput", "Goodput", ">=", 1.5))
Figures = dict[str, dict[str, list[float | None]]]  # arm -> figure -> value per repeat


def engine_of(arm: str) -> str:
    return "vllm" if arm.startswith("vllm:") else "numpy"


def shape_of(arm: str) -> str:
    """`colocated-x2` of `vllm:colocated-x2:cache@0/1`."""
    return arm.removeprefix("vllm:").partition("@")[0].partition(":")[0]


def is_colocated(arm: str) -> bool:
    return shape_of(arm).startswith("colocated")


def by_arm(runs: Sequence[Result]) -> dict[str, dict[int, list[Result]]]:
    """arm -> repeat -> its sweep, in ascending load."""
    grouped: dict[str, dict[int, list[Result]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        grouped[run["stack"]][int(run["repeat"])].append(run)
    return {arm: {r: sorted(rs, key=lambda x: float(x["sweep_point"])) for r, rs in reps.items()} for arm, reps in grouped.items()}


def repeats_of(runs: Sequence[Result]) -> list[int]:
    return sorted({int(r["repeat"]) for r in runs})


def median_at(grouped: Mapping[int, Sequence[Result]], point: float, key: str) -> float | None:
    s = spread.spread([(sweep.at_point(rs, point) or {}).get(key) for rs in grouped.values()])
    return None if s is None else s.median


def common_load(runs: Sequence[Result], arms: Sequence[str], threshold: float) -> float | None:
    """The load at which all `arms` are compared: the highest point every arm ran where each one's median SLO
    attainment met the threshold; else (one arm fails everywhere) the lowest point they all ran."""
    grouped = by_arm(runs)
    shared = None
    for arm in arms:
        points = {float(r["sweep_point"]) for rs in grouped.get(arm, {}).values() for r in rs}
        shared = points if shared is None else shared & points
    if not shared:
        return None
    met = [p for p in sorted(shared)
           if all((median_at(grouped[a], p, "slo_attainment") or 0.0) >= threshold for a in arms)]
    return met[-1] if met else min(shared)


def figures(runs: Sequence[Result], threshold: float, common: float | None) -> Figures:
    """Per arm, per repeat: max goodput at the SLOs, the knee load, and the P99s at the common load."""
    repeats = repeats_of(runs)
    out: Figures = {}
    for arm, grouped in by_arm(runs).items():
        sweeps = [grouped.get(r) for r in repeats]
        at_common = [sweep.at_point(s, common) if s and common is not None else None for s in sweeps]
        out[arm] = {"goodput": [sweep.max_goodput(s, threshold) if s else None for s in sweeps],
                    "knee": [sweep.knee_point(s, threshold) if s else None for s in sweeps],
                    # 1.0 where the ladder reached a point past the knee; 0.0 where it ended first (a lower bound)
                    "knee_seen": [float(sweep.first_failing(s, threshold) is not None) if s else None for s in sweeps],
                    # A run that completed nothing has no latencies (vLLM's summary reports 0 ms for them).
                    **{key: [r.get(key) if r and r.get("completed") else None for r in at_common] for key, _ in P99S}}
    return out


def best_colocated(figs: Figures, arms: Sequence[str]) -> str | None:
    """The colocated arm a user would pick: highest median max goodput, then lowest median TTFT P99."""
    def rank(arm: str) -> tuple[float, float]:
        good, ttft = spread.spread(figs[arm]["goodput"]), spread.spread(figs[arm]["p99_ttft_ms"])
        return (good.median if good else 0.0, -(ttft.median if ttft else float("inf")))
    return max((a for a in arms if is_colocated(a) and a in figs), key=rank, default=None)


def arm_table(figs: Figures, arms: Sequence[str], unit: str) -> str:
    """Markdown: arms × {max goodput at SLO, knee load, P99 TTFT / TPOT / ITL at the common load}."""
    head = ["Arm", "Max goodput at SLO (req/s)", f"Knee ({unit})", *(label for _, label in P99S)]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    short = []
    for arm in arms:
        f = figs[arm]
        seen = [x for x in f["knee_seen"] if x is not None]
        mark = "" if all(seen) else " †"
        if mark:
            short.append(f"{arm} ({len(seen) - int(sum(seen))} of {len(seen)})")
        cells = [spread.fmt(spread.spread(f["goodput"]), 3) + mark, spread.fmt(spread.spread(f["knee"]), 2) + mark,
                 *(spread.fmt(spread.spread(f[key]), 1) for key, _ in P99S)]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    if short:
        lines += ["", f"† The ladder ended before SLO attainment fell below the threshold in some repeats ({', '.join(short)}): "
                  "that knee and max goodput are lower bounds; extend --sweep."]
    return "\n".join(lines)


def ratio(figs: Figures, arm: str, baseline: str, key: str) -> Spread | None:
    """`arm`'s figure over `baseline`'s, paired by repeat: median and range."""
    return spread.spread(spread.ratios(figs[arm][key], figs[baseline][key]))


def ratio_table(figs: Figures, arms: Sequence[str], baseline: str) -> str:
    """Markdown: each arm's ratios to `baseline` (latency: below 1 is better; goodput: above 1 is better)."""
    keys = (("goodput", "Max goodput"), *((k, label.replace(" (ms)", "")) for k, label in P99S))
    lines = ["| Arm | " + " | ".join(label for _, label in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for arm in arms:
        if arm != baseline:
            lines.append(f"| {arm} | " + " | ".join(spread.fmt_ratio(ratio(figs, arm, baseline, k)) for k, _ in keys) + " |")
    return "\n".join(lines)


def goal_lines(figs: Figures, baseline: str, arm: str) -> list[str]:
    """One line per goal: met only if the whole range of the paired ratio meets it; missed if none of it does."""
    lines = []
    for key, label, direction, target in GOALS:
        s = ratio(figs, arm, baseline, key)
        if s is None:
            lines.append(f"- {label}: not measured")
            continue
        meets = (lambda x: x <= target) if direction == "<=" else (lambda x: x >= target)
        verdict = "met" if meets(s.low) and meets(s.high) else "missed" if not (meets(s.low) or meets(s.high)) else "not shown (the range straddles the goal)"
        lines.append(f"- {label}: {arm} / {baseline} = {spread.fmt_ratio(s)} (goal {direction} {target}×): {verdict}")
    return lines


def winner(runs_at: Mapping[str, Sequence[float | None]]) -> str:
    """The arm with the highest median goodput at one load point; "no difference" when its paired ratio to the runner
    -up crosses 1.0× over the repeats."""
    ranked = sorted(((spread.spread(v), arm) for arm, v in runs_at.items()), key=lambda x: x[0].median if x[0] else -1, reverse=True)
    ranked = [(s, a) for s, a in ranked if s is not None]
    if not ranked:
        return "–"
    if len(ranked) == 1:
        return ranked[0][1]
    (first_spread, first), (second_spread, second) = ranked[0], ranked[1]
    if second_spread.high == 0 < first_spread.low:
        return first  # the runner-up met no SLO at this load in any repeat: no ratio, but no doubt either
    paired = spread.spread(spread.ratios(runs_at[first], runs_at[second]))
    if paired is None or (paired.n > 1 and paired.crosses(1.0)) or paired.median == 1.0:
        return f"no difference ({first} ≈ {second})"
    return first


def advice_table(runs: Sequence[Result], arms: Sequence[str], unit: str) -> str:
    """Markdown: per load point, the measured winner (goodput) and `doctor advise`'s verdict on each arm (the most
    common over the repeats, with its count)."""
    grouped = by_arm(runs)
    repeats = repeats_of(runs)
    points = sorted({float(r["sweep_point"]) for arm in arms for rs in grouped.get(arm, {}).values() for r in rs})
    lines = [f"| Load ({unit}) | Measured winner (goodput) | " + " | ".join(f"advise on {a}" for a in arms) + " |",
             "|---" * (len(arms) + 2) + "|"]
    for point in points:
        at = {a: [(sweep.at_point(grouped.get(a, {}).get(r, []), point) or {}) for r in repeats] for a in arms}
        goodputs = {a: [run.get("request_goodput") for run in rows] for a, rows in at.items() if any(rows)}
        verdicts = []
        for a in arms:
            seen = Counter((run.get("advise") or {}).get("verdict") for run in at[a] if run)
            seen.pop(None, None)
            verdicts.append(" ".join(f"{v} ({n}/{sum(seen.values())})" for v, n in seen.most_common(1)) or "–")
        lines.append(f"| {point:g} | {winner(goodputs)} | " + " | ".join(verdicts) + " |")
    return "\n".join(lines)


def engine_section(runs: Sequence[Result], engine: str, threshold: float, unit: str) -> list[str]:
    """The markdown of one engine: arm table, ratios to the best colocated arm, goals, advise vs winner."""
    arms = list(dict.fromkeys(r["stack"] for r in runs if engine_of(r["stack"]) == engine))
    if not arms:
        return []
    mine = [r for r in runs if r["stack"] in arms]
    common = common_load(mine, arms, threshold)
    figs = figures(mine, threshold, common)
    at = "–" if common is None else f"{common:g} {unit}"
    out = [f"## {engine}", "", f"Common load for the P99s: {at} (the highest load every arm served at ≥ {threshold:.0%} "
           "SLO attainment, by median). Figures: median [min–max] over the repeats.", "", arm_table(figs, arms, unit), ""]
    best = best_colocated(figs, arms)
    if best is not None:
        out += [f"### Ratios to the best colocated arm ({best}), paired by repeat", "", ratio_table(figs, arms, best), ""]
        for arm in (a for a in arms if not is_colocated(a)):
            out += [f"Goals for {arm} against {best}:", "", *goal_lines(figs, best, arm), ""]
    out += ["### doctor advise at each load, next to the measured winner", "", advice_table(mine, arms, unit), ""]
    return out
