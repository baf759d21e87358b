"""stack.bench.repeats and spread: arm order per repeat, the host-load guard, median [min–max] and "no difference"."""

from __future__ import annotations

import pytest

from stack.bench import repeats, spread


def test_alternate_order_runs_forward_then_backward() -> None:
    """alternate: A,B,C then C,B,A then A,B,C — each arm runs as often early as late."""
    assert repeats.arm_orders(["a", "b", "c"], 3, "alternate", 0) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_random_order_is_a_seeded_permutation_per_repeat() -> None:
    """random: every repeat a permutation of all arms; the same seed gives the same orders, another seed others."""
    arms = [f"arm{i}" for i in range(6)]
    orders = repeats.arm_orders(arms, 4, "random", seed=7)
    assert all(sorted(o) == arms for o in orders)
    assert orders == repeats.arm_orders(arms, 4, "random", seed=7)
    assert orders != repeats.arm_orders(arms, 4, "random", seed=8)
    assert len({tuple(o) for o in orders}) > 1  # not one order repeated


class Host:
    """A fake host whose load readings are given in advance; sleeping advances its clock."""

    def __init__(self, *loads: float) -> None:
        self.loads, self.now, self.slept = list(loads), 0.0, 0

    def read(self) -> float:
        return self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += 1


def test_guard_waits_for_the_load_to_fall_then_runs_unflagged() -> None:
    """Load 5, 4, then 1.5 on 2 cores: the guard waits two polls and lets the run start, not flagged."""
    host = Host(5.0, 4.0, 1.5)
    guard = repeats.LoadGuard(limit=2.0, policy="refuse", wait_s=60, poll_s=5)
    assert guard.check("run", host.read, host.sleep, lambda: host.now) == (1.5, False)
    assert host.slept == 2


def test_guard_refuses_or_flags_when_the_load_stays_high() -> None:
    """Load stuck at 9 on 2 cores: `refuse` raises HostBusy naming the load and the way out; `flag` runs it flagged."""
    host = Host(9.0)
    refuse = repeats.LoadGuard(limit=2.0, policy="refuse", wait_s=10, poll_s=5)
    with pytest.raises(repeats.HostBusy, match=r"load is 9.00, above 2 .*--on-high-load flag"):
        refuse.check("repeat 1, colocated, 1 req/s", host.read, host.sleep, lambda: host.now)
    flag = repeats.LoadGuard(limit=2.0, policy="flag", wait_s=0)
    assert flag.check("run", host.read, host.sleep, lambda: host.now) == (9.0, True)


def test_guard_limit_defaults_to_the_core_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --max-load the limit is the number of cores."""
    monkeypatch.setattr(repeats.os, "cpu_count", lambda: 6)
    assert repeats.LoadGuard.for_host(None, "flag", 0).limit == 6.0
    assert repeats.LoadGuard.for_host(3.5, "flag", 0).limit == 3.5


def test_spread_is_median_and_range_over_the_repeats_that_measured() -> None:
    """Median and min–max, missing repeats left out; formatted as `median [min–max]`."""
    s = spread.spread([3.0, None, 1.0, 2.0])
    assert (s.median, s.low, s.high, s.n) == (2.0, 1.0, 3.0, 3)
    assert spread.fmt(s, 1) == "2.0 [1.0–3.0]"
    assert spread.spread([None]) is None and spread.fmt(None) == "–"
    assert spread.fmt(spread.spread([4.0])) == "4.0"


def test_ratio_whose_range_crosses_one_is_no_difference() -> None:
    """Paired per repeat: 0.4, 0.5, 0.6 is a 0.50× win; 0.9, 1.1, 1.0 is "no difference"; one repeat gives no range."""
    win = spread.spread(spread.ratios([2.0, 5.0, 3.0], [5.0, 10.0, 5.0]))
    assert spread.fmt_ratio(win) == "0.50× [0.40–0.60]"
    tie = spread.spread(spread.ratios([0.9, 1.1, 2.0], [1.0, 1.0, 2.0]))
    assert tie.crosses(1.0) and spread.fmt_ratio(tie) == "no difference [0.90–1.10×]"
    assert spread.fmt_ratio(spread.spread(spread.ratios([3.0], [2.0]))) == "1.50× (1 repeat)"
    assert spread.ratios([1.0, None, 2.0], [0.0, 1.0, 4.0]) == [None, None, 0.5]  # 0 baseline: no ratio
