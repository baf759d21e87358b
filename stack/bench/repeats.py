"""How the repeats run: the order of the arms in each repeat, and the host-load guard before every run.

Arms that always run in the same order carry the host's drift into the comparison (a neighbour's job ending halfway
favours the later arms), so each repeat reorders them: `alternate` runs them forward, then backward, and so on;
`random` shuffles them with a seeded generator. Either way the orders are recorded in the report.

A figure taken while other work fills the cores measures the other work. Before every run the guard reads the 1-minute
load average; above the limit (default: the number of cores) it waits for it to fall, then refuses the run
(`refuse`: the experiment stops) or runs it marked as flagged (`flag`: the report shows which figures are suspect).
The wait also lets the load of the arm's own start-up and of its previous load point decay (a 1-minute average falls by
a factor e a minute), so every run starts from a quiet host.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ORDERS = ("alternate", "random")
POLICIES = ("refuse", "flag")


def arm_orders(arms: Sequence[str], repeats: int, mode: str, seed: int) -> list[list[str]]:
    """The arm order of each repeat: `alternate` (forward, backward, …) or `random` (seeded shuffle per repeat)."""
    assert mode in ORDERS, f"order must be one of {ORDERS}, got {mode!r}"
    if mode == "alternate":
        return [list(arms) if r % 2 == 0 else list(reversed(arms)) for r in range(repeats)]
    rng = random.Random(seed)
    orders = []
    for _ in range(repeats):
        order = list(arms)
        rng.shuffle(order)
        orders.append(order)
    return orders


class HostBusy(RuntimeError):
    """The host's load stayed above the limit and the policy is to refuse the run."""


@dataclass(frozen=True)
class LoadGuard:
    """Checks the host's 1-minute load average before a run."""

    limit: float  # a load above this (default: the core count) means other work competes for the cores
    policy: str = "refuse"  # refuse: raise HostBusy; flag: run anyway, marked
    wait_s: float = 120.0  # how long to wait for the load to fall first
    poll_s: float = 5.0

    @classmethod
    def for_host(cls, limit: float | None, policy: str, wait_s: float) -> LoadGuard:
        assert policy in POLICIES, f"policy must be one of {POLICIES}, got {policy!r}"
        return cls(limit if limit is not None else float(os.cpu_count() or 1), policy, wait_s)

    def check(self, what: str, read: Callable[[], float] = lambda: os.getloadavg()[0],
              sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> tuple[float, bool]:
        """(the load before the run, whether the run is flagged); raises HostBusy under `refuse`."""
        deadline = clock() + self.wait_s
        load = read()
        while load > self.limit and clock() < deadline:
            sleep(self.poll_s)
            load = read()
        if load <= self.limit:
            return load, False
        if self.policy == "refuse":
            raise HostBusy(f"{what}: the host's 1-minute load is {load:.2f}, above {self.limit:g} (the core count) after "
                           f"waiting {self.wait_s:g} s; other work shares the cores, so the figures would measure it. "
                           "Run on a quiet machine, or pass --on-high-load flag to run and mark the figures.")
        return load, True
