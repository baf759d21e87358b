"""stack.bench.sweep: each arm climbs the load ladder until one or two points past its knee, and its goodput is read there."""

from __future__ import annotations

import pytest

from stack.bench.sweep import SweepError, SweepPlan, at_point, knee_point, max_goodput


def runs(*attained: float | None, points: tuple[float, ...] = (1, 2, 4, 8, 16)) -> list[dict]:
    """One result per point: SLO attainment as given, goodput = point × attainment (the share served in time)."""
    return [{"sweep_point": p, "slo_attainment": a, "request_goodput": None if a is None else p * a}
            for p, a in zip(points, attained)]


def walk(plan: SweepPlan, attained: list[float | None]) -> list[float]:
    """The points an arm runs when its i-th run attains attained[i]."""
    done: list[dict] = []
    while (point := plan.next_point(done)) is not None:
        done.append({"sweep_point": point, "slo_attainment": attained[len(done)]})
    return [d["sweep_point"] for d in done]


def test_the_ladder_stops_past_knee_points_after_the_first_failing_one() -> None:
    """Attainment 1, 1, 0.5 at 1, 2, 4: with one point past the knee the arm runs 1, 2, 4, 8 and stops."""
    plan = SweepPlan.parse("1,2,4,8,16")
    assert walk(plan, [1.0, 1.0, 0.5, 0.1, 0.0]) == [1, 2, 4, 8]
    assert walk(SweepPlan.parse("1,2,4,8,16", past_knee=2), [1.0, 1.0, 0.5, 0.1, 0.0]) == [1, 2, 4, 8, 16]
    assert walk(SweepPlan.parse("1,2,4,8,16", past_knee=0), [1.0, 0.8, 1.0, 1.0, 1.0]) == [1, 2]


def test_an_arm_that_never_fails_or_has_no_slos_climbs_the_whole_ladder() -> None:
    """No knee (attainment ≥ threshold everywhere, or no SLOs at all): every point runs."""
    plan = SweepPlan.parse("1,2,4")
    assert walk(plan, [1.0, 0.95, 0.9]) == [1, 2, 4]  # 0.9 meets a 0.9 threshold
    assert walk(plan, [None, None, None]) == [1, 2, 4]


def test_knee_and_max_goodput_come_from_the_points_that_met_the_slos() -> None:
    """The knee is the last point before the first failing one; max goodput the best goodput among passing points,
    not the larger goodput a failing point may still show."""
    sweep = runs(1.0, 1.0, 0.95, 0.6, 0.5)  # goodput 1, 2, 3.8, 4.8, 8
    assert knee_point(sweep, 0.9) == 4
    assert max_goodput(sweep, 0.9) == pytest.approx(3.8)
    assert knee_point(runs(0.5, 1.0), 0.9) is None and max_goodput(runs(0.5, 0.4), 0.9) == 0.0
    assert at_point(sweep, 8)["slo_attainment"] == 0.6 and at_point(sweep, 3) is None


@pytest.mark.parametrize("text, message", [("1,x", "not comma-separated numbers"), ("2,1", "strictly ascending"),
                                           ("0,1", "positive"), ("1,1", "strictly ascending")])
def test_bad_ladders_are_refused_by_name(text: str, message: str) -> None:
    """A --sweep that is not positive and strictly ascending is an error naming the flag."""
    with pytest.raises(SweepError, match=message):
        SweepPlan.parse(text)
