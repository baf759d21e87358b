"""Median and range over repeats, ratios paired by repeat, and the rule that a ratio whose range crosses 1.0× is
no difference.

A single run on a shared host says little: the same arm measured three times moves by tens of percent (issue 21: the
two orders of one run gave PD/colocated goodput 1.07× and 1.02×, TTFT P99 0.80× and 0.88×). So every figure is
reported as its median and its range (min–max) over the repeats, and a ratio between two arms is computed per repeat
(both arms ran back to back, under the same load) before taking its median and range. When that range contains 1.0×
the repeats disagree on which arm is ahead: the table says "no difference" instead of a number that reads like a win.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    """One figure over repeats."""

    median: float
    low: float  # min over repeats
    high: float  # max over repeats
    n: int  # repeats that measured it

    def crosses(self, value: float = 1.0) -> bool:
        return self.low <= value <= self.high


def spread(values: Sequence[float | None]) -> Spread | None:
    """Median and range of the measured values (None entries are repeats that did not measure it)."""
    have = [float(v) for v in values if v is not None]
    if not have:
        return None
    return Spread(statistics.median(have), min(have), max(have), len(have))


def ratios(values: Sequence[float | None], baseline: Sequence[float | None]) -> list[float | None]:
    """value / baseline per repeat (None where either is missing or the baseline is 0)."""
    return [v / b if v is not None and b else None for v, b in zip(values, baseline, strict=True)]


def fmt(s: Spread | None, digits: int = 1) -> str:
    """`12.3 [10.1–14.0]` (a single repeat: just the value)."""
    if s is None:
        return "–"
    if s.n == 1:
        return f"{s.median:.{digits}f}"
    return f"{s.median:.{digits}f} [{s.low:.{digits}f}–{s.high:.{digits}f}]"


def fmt_ratio(s: Spread | None) -> str:
    """`0.52× [0.40–0.61]`, or `no difference [0.91–1.08]` when the range crosses 1.0× (one repeat: no range, so no
    verdict either way; shown as the bare ratio)."""
    if s is None:
        return "–"
    if s.n == 1:
        return f"{s.median:.2f}× (1 repeat)"
    if s.crosses(1.0):
        return f"no difference [{s.low:.2f}–{s.high:.2f}×]"
    return f"{s.median:.2f}× [{s.low:.2f}–{s.high:.2f}]"
