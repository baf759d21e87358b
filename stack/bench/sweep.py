"""The load sweep of one arm: raise the load until its SLO attainment falls below a threshold, then a few points more.

An arm's goodput means something only where its SLOs start to fail: below its knee every arm serves all it is sent,
goodput equals the offered load and compares nothing. So each arm walks the same ascending ladder of load points
(request rates, or agent sessions) and stops `past_knee` points after the first one whose SLO attainment (the share
of sent requests meeting every SLO) is below `threshold` (DistServe's 90 %). Pure functions over the result dicts
`serve.benchmark` returns, with `slo_attainment` and `sweep_point` added by compare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Result = Mapping[str, Any]

DEFAULT_THRESHOLD = 0.9  # DistServe: goodput is the highest load at which ≥ 90 % of requests meet their SLOs
DEFAULT_PAST_KNEE = 1  # points run beyond the knee, to show the fall


class SweepError(ValueError):
    """A `--sweep` that is not an ascending list of positive numbers."""


@dataclass(frozen=True)
class SweepPlan:
    """The ladder every arm climbs and when it stops."""

    points: tuple[float, ...]  # ascending load points (req/s or sessions)
    threshold: float = DEFAULT_THRESHOLD  # SLO attainment below this is past the knee
    past_knee: int = DEFAULT_PAST_KNEE  # points still run after the first one below the threshold

    @classmethod
    def parse(cls, text: str, threshold: float = DEFAULT_THRESHOLD, past_knee: int = DEFAULT_PAST_KNEE) -> SweepPlan:
        try:
            points = tuple(float(p) for p in text.split(","))
        except ValueError:
            raise SweepError(f"--sweep: {text!r} is not comma-separated numbers") from None
        if not all(p > 0 for p in points) or list(points) != sorted(set(points)):
            raise SweepError(f"--sweep: {text!r} must be positive and strictly ascending")
        if not 0 < threshold <= 1:
            raise SweepError(f"--knee-attainment must be in (0, 1], got {threshold}")
        if past_knee < 0:
            raise SweepError(f"--past-knee must be >= 0, got {past_knee}")
        return cls(points, threshold, past_knee)

    def next_point(self, done: Sequence[Result]) -> float | None:
        """The next load point for an arm that has run `done` (in ladder order), or None when it is finished:
        the ladder is exhausted, or `past_knee` points ran after the first one below the threshold."""
        knee = first_failing(done, self.threshold)
        if knee is not None and len(done) - 1 - knee >= self.past_knee:
            return None
        return self.points[len(done)] if len(done) < len(self.points) else None


def attainment(result: Result) -> float | None:
    """The share of sent requests that met every SLO (None when the run had no SLOs)."""
    return result.get("slo_attainment")


def first_failing(results: Sequence[Result], threshold: float) -> int | None:
    """Index of the first point whose SLO attainment is below `threshold` (None: all met it, or no SLOs)."""
    return next((i for i, r in enumerate(results) if (a := attainment(r)) is not None and a < threshold), None)


def knee_point(results: Sequence[Result], threshold: float) -> float | None:
    """The highest load point at or below which every point met the threshold (None: the first point already failed)."""
    failing = first_failing(results, threshold)
    passed = results if failing is None else results[:failing]
    return float(passed[-1]["sweep_point"]) if passed else None


def max_goodput(results: Sequence[Result], threshold: float) -> float:
    """The arm's goodput at its SLOs: the highest request goodput of a point meeting the attainment threshold
    (0 when none did: the arm fails its SLOs at the lowest load tried)."""
    met = [r.get("request_goodput") or 0.0 for r in results if (a := attainment(r)) is not None and a >= threshold]
    return max(met, default=0.0)


def at_point(results: Sequence[Result], point: float) -> Result | None:
    """The run of one load point, if the arm ran it."""
    return next((r for r in results if float(r["sweep_point"]) == point), None)
