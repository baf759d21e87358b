"""`doctor advise`: more prefill, more decode, or balanced, from the router's own metrics over a window.

The simplest, advisory form of Dynamo's planner (its SLA mode sizes each pool from TTFT and ITL
targets; docs.nvidia.com/dynamo planner-guide). Prefill and decode each get a *pressure*: how much of
its SLO the phase uses, measured from the router's /metrics between two scrapes.

    prefill pressure = mean prefill leg (router → prefill, KV pushed: pd_router_prefill_seconds) / TTFT SLO
    decode pressure  = the larger of  mean TPOT (pd_router_tpot_seconds) / TPOT SLO
                                 and  mean KV hand-off (decode leg sent → its first chunk) / TTFT SLO

The prefill leg includes the prefill engine's own queue, so it grows when prompts wait for prefill.
Decode runs out in two ways: its batch grows until each step is slow (TPOT), or its batch is full (KV
memory, max_num_seqs) and new requests wait for a place before their first decoded chunk (the hand-off,
which is part of TTFT, hence its budget). A pool whose pressure is over 1 (its SLO missed)
and at least `DOMINANCE` times the other's is the one to grow: more prefill, more decode. Neither over
1: balanced, unless TTFT itself misses its SLO: in PD its parts add up (the prefill leg, the hand-off, the
router's queue), so a window where each part fits the budget alone and the sum does not is `pd_overhead`:
no pool is short, the path is, and more replicas will not bring TTFT under (on a 2-core machine vLLM-CPU's
1P1D missed a 2 s TTFT at 0.5 req/s with both pools idle, where one colocated engine met it:
docs/benchmark.md). Colocated (no prefill leg), the one engine does the prompt too, so TTFT's pressure is
decode's. Both over and close: both. The suggested size is the replicas that bring the pressure to 1
if throughput scales with replicas (`ceil(n × pressure)`, at least n + 1), at most doubling the pool per
step (planners move in steps; run advise again after the change): a starting point, not a promise. TTFT, the KV hand-off, the queue depth and the pools' requests in flight are shown beside it.
SLOs: the router's own (PD_SLO_TTFT_MS / PD_SLO_TPOT_MS, exported as pd_router_slo_*), or given.

Pure functions over parsed scrapes (`window`, `advise`, `findings`); the CLI only scrapes and renders.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from doctor import live
from doctor.errors import DoctorError
from doctor.findings import Finding

DOMINANCE = 1.5  # one side's pressure must be this many times the other's to name it


@dataclass(frozen=True)
class Scrape:
    """One /metrics body at time `at` (seconds): histogram (sum, count) and gauge samples by metric name."""

    at: float
    histograms: dict[str, tuple[float, float]] = field(default_factory=dict)  # summed over label sets
    gauges: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, at: float) -> Scrape:
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        gauges: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if family.type == "histogram" and sample.name.endswith(("_sum", "_count")):
                    sums[family.name][0 if sample.name.endswith("_sum") else 1] += sample.value
                elif family.type in ("gauge", "untyped", "unknown"):
                    gauges[sample.name].append((dict(sample.labels), sample.value))
        return cls(at, {name: (s, c) for name, (s, c) in sums.items()}, dict(gauges))

    def gauge(self, name: str, **labels: str) -> list[float]:
        return [value for have, value in self.gauges.get(name, []) if all(have.get(k) == v for k, v in labels.items())]


@dataclass(frozen=True)
class Window:
    """What the router saw between the first and the last scrape."""

    seconds: float
    requests: int  # first tokens relayed (TTFT observations)
    ttft_s: float | None
    prefill_s: float | None  # mean prefill leg
    handoff_s: float | None  # mean decode leg to its first chunk (KV claim + first token)
    tpot_s: float | None
    queue_depth: float  # mean over the scrapes
    pools: dict[str, int]  # backends up per role
    in_flight: dict[str, float]  # mean requests in flight per backend, per role
    slo_ttft_s: float
    slo_tpot_s: float


def _mean(first: Scrape, last: Scrape, name: str) -> tuple[float | None, int]:
    (s0, c0), (s1, c1) = first.histograms.get(name, (0.0, 0.0)), last.histograms.get(name, (0.0, 0.0))
    count = int(round(c1 - c0))
    return ((s1 - s0) / count if count > 0 else None), count


def window(scrapes: list[Scrape]) -> Window:
    """The window's means from at least two scrapes (histograms: last − first; gauges: averaged over all)."""
    assert len(scrapes) >= 2, f"a window needs two scrapes, got {len(scrapes)}"
    first, last = scrapes[0], scrapes[-1]
    ttft, requests = _mean(first, last, "pd_router_ttft_seconds")
    roles = sorted({labels.get("role", "") for labels, _ in last.gauges.get("pd_router_backend_up", [])} - {""})
    pools = {role: int(sum(last.gauge("pd_router_backend_up", role=role))) for role in roles}
    in_flight = {role: sum(sum(s.gauge("pd_router_backend_in_flight", role=role)) for s in scrapes) / len(scrapes) / max(1, pools[role])
                 for role in roles}
    slo_ttft, slo_tpot = (last.gauge(f"pd_router_slo_{kind}_seconds") for kind in ("ttft", "tpot"))
    return Window(
        seconds=last.at - first.at, requests=requests, ttft_s=ttft,
        prefill_s=_mean(first, last, "pd_router_prefill_seconds")[0], handoff_s=_mean(first, last, "pd_router_kv_handoff_seconds")[0],
        tpot_s=_mean(first, last, "pd_router_tpot_seconds")[0],
        queue_depth=sum(sum(s.gauge("pd_router_queue_depth")) for s in scrapes) / len(scrapes),
        pools=pools, in_flight=in_flight, slo_ttft_s=slo_ttft[0] if slo_ttft else 2.0, slo_tpot_s=slo_tpot[0] if slo_tpot else 0.2)


@dataclass(frozen=True)
class Advice:
    verdict: str  # more_prefill | more_decode | both | balanced | pd_overhead | no_traffic
    prefill_pressure: float | None
    decode_pressure: float | None
    suggested: dict[str, int]  # role -> replicas (only the roles to grow)


def advise(w: Window, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None) -> Advice:
    """The recommendation for window `w` (SLOs: the given ones, else the router's)."""
    ttft_slo, tpot_slo = ttft_slo_s or w.slo_ttft_s, tpot_slo_s or w.slo_tpot_s
    prefill = w.prefill_s / ttft_slo if w.prefill_s is not None else None
    ttft = w.ttft_s / ttft_slo if w.ttft_s is not None and w.requests else None
    decode_parts = [w.tpot_s / tpot_slo if w.tpot_s is not None else None, w.handoff_s / ttft_slo if w.handoff_s is not None else None,
                    ttft if prefill is None else None]  # colocated: the engine computes the prompt too
    decode = max((part for part in decode_parts if part is not None), default=None)
    if prefill is None and decode is None:
        return Advice("no_traffic", None, None, {})
    p, d = prefill or 0.0, decode or 0.0

    def grow(role: str, pressure: float) -> dict[str, int]:
        n = max(1, w.pools.get(role, 1))
        return {role: min(2 * n, max(n + 1, math.ceil(n * pressure)))}

    if max(p, d) <= 1:
        return Advice("pd_overhead" if ttft is not None and ttft > 1 else "balanced", prefill, decode, {})
    if p >= DOMINANCE * d:
        return Advice("more_prefill", prefill, decode, grow("prefill", p))
    if d >= DOMINANCE * p:
        return Advice("more_decode", prefill, decode, grow("decode", d))
    return Advice("both", prefill, decode, {**grow("prefill", p), **grow("decode", d)})


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _x(pressure: float | None) -> str:
    return "-" if pressure is None else f"{pressure:.2f}"


_TITLES = {
    "more_prefill": "prefill-bound: add prefill replicas",
    "more_decode": "decode-bound: add decode replicas",
    "both": "both pools miss their SLO: add prefill and decode replicas",
    "balanced": "balanced: both pools meet their SLO",
    "pd_overhead": "TTFT misses its SLO though neither pool does: the PD path's parts add up; more replicas will not help",
    "no_traffic": "no requests in the window: nothing to advise on",
}


def findings(advice: Advice, w: Window, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None) -> list[Finding]:
    """The advice as one doctor finding: the verdict as title, the numbers behind it as cause, the scale command as fix."""
    ttft_slo, tpot_slo = ttft_slo_s or w.slo_ttft_s, tpot_slo_s or w.slo_tpot_s
    pools = ", ".join(f"{role} {n}" for role, n in sorted(w.pools.items())) or "none up"
    in_flight = ", ".join(f"{role} {v:.1f}" for role, v in sorted(w.in_flight.items()))
    cause = (f"over {w.seconds:.0f} s ({w.requests} first tokens): prefill leg {_ms(w.prefill_s)} of a {_ms(ttft_slo)} TTFT SLO "
             f"(pressure {_x(advice.prefill_pressure)}); decode: TPOT {_ms(w.tpot_s)} of a {_ms(tpot_slo)} TPOT SLO, "
             f"KV hand-off {_ms(w.handoff_s)} (pressure {_x(advice.decode_pressure)}); TTFT {_ms(w.ttft_s)}, "
             f"router queue {w.queue_depth:.1f}; replicas up: {pools}; in flight per replica: {in_flight or '-'}.")
    if advice.suggested:
        sizes = {**w.pools, **advice.suggested}
        fix = (f"./pd scale prefill={sizes.get('prefill', 1)} decode={sizes.get('decode', 1)}   (Kubernetes: "
               + "; ".join(f"kubectl -n pd-deploy scale deployment/{role} --replicas={n}" for role, n in sorted(advice.suggested.items()))
               + "); then run `doctor advise` again under the same load")
    elif advice.verdict == "pd_overhead":
        fix = (f"shorten the path: the KV hand-off ({_ms(w.handoff_s)}) is the part PD adds; `python -m doctor diagnose` names a slow "
               "KV transport (NIXL over TCP, a lease wait). Or serve colocated (`./pd colocated`), where the prompt costs one engine's "
               "prefill and no hand-off; measure both under this load with `python -m stack.bench compare`")
    elif advice.verdict == "no_traffic":
        fix = "run it while the stack serves its usual load, or with a longer --window"
    else:
        fix = "nothing to change; the larger pressure is the pool to grow first when load rises"
    severity = "warning" if advice.suggested or advice.verdict == "pd_overhead" else "ok"
    return [Finding(f"advise.{advice.verdict}", severity, _TITLES[advice.verdict], cause, fix)]


def text(found: Finding) -> str:
    """The advice for a terminal: verdict, the numbers behind it, and what to run."""
    return f"{found.title}\n  numbers: {found.cause}\n  {'run' if found.severity != 'ok' else 'so'}: {found.fix}\n"


def scrape_metrics(url: str, seconds: float, interval: float) -> list:
    """The router's /metrics every `interval` s for `seconds` (at least two scrapes), parsed for doctor.advise."""
    scrapes = []
    deadline = time.monotonic() + seconds
    while True:
        try:
            with live.request(f"{url}/metrics", None) as response:
                scrapes.append(Scrape.parse(response.read().decode(), time.monotonic()))
        except (OSError, ValueError) as exc:
            raise DoctorError(f"cannot read {url}/metrics: {exc} (is the router up? --router-url)") from None
        if len(scrapes) >= 2 and time.monotonic() >= deadline:
            return scrapes
        time.sleep(max(0.0, min(interval, deadline - time.monotonic())))
