"""`python -m doctor explain REQUEST_ID`: one request's path across the services, hop by hop, with durations.

Hops: router queue (router.scheduled's queue_ms: the PD flow took it → scheduled), prefill compute (prefill's engine.prefill_done prefill_ms),
KV push (kv_producer.sent transfer_ms; decode's claim wait), decode first token (KV hand-off → the
router's decode_first_token), stream (first token → router.request_done). Containers' clocks
disagree, so positions come from the router's own timestamps (one clock) and each engine's durations
from its own duration fields, never from subtracting two containers' timestamps.

The picture (PNG or SVG, by the file's suffix) is one bar per hop on a time axis, written with
matplotlib (the dev extra: the doctor runs on the host).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from doctor.parse import Record
from doctor.timeline import Timeline
from stack.common import events

LANES = ("router", "prefill", "kv", "decode")
COLORS = {"router": "#7f7f7f", "prefill": "#1f77b4", "kv": "#ff7f0e", "decode": "#2ca02c"}


@dataclass(frozen=True)
class Hop:
    name: str  # router queue | prefill compute | KV push | decode first token | stream
    lane: str  # router | prefill | kv | decode
    start_ms: float  # from when the request entered the router's PD flow, on the router's clock
    duration_ms: float
    source: str  # the event.field the duration comes from


def _ts(value: str) -> datetime | None:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _start(router: dict[str, Record], t: Timeline) -> tuple[datetime | None, str]:
    """When the request entered the router's PD flow, and the router-queue hop's source: router.scheduled less its queue_ms
    (older routers logged router.request_received instead); else the request's first timestamped line."""
    scheduled, received = router.get(events.ROUTER_SCHEDULED), router.get(events.ROUTER_REQUEST_RECEIVED)
    if received is None and scheduled is not None and scheduled[events.QUEUE_MS] is not None \
            and (when := _ts(scheduled.ts)) is not None:
        return when - timedelta(milliseconds=scheduled[events.QUEUE_MS]), "router.scheduled queue_ms"
    first = received or next((r for r in t.records if r.ts), None)
    return (_ts(first.ts) if first is not None else None), "router.request_received → router.scheduled"


def hops(t: Timeline) -> list[Hop]:
    """The request's hops that its lines show (a failed request has fewer)."""
    router = {r.event: r for r in reversed(t.records) if r.service == "router"}  # first of each event
    t0, queued = _start(router, t)

    def at(event: str) -> float | None:
        r = router.get(event)
        when = _ts(r.ts) if r is not None and t0 is not None else None
        return None if when is None else (when - t0).total_seconds() * 1000

    out: list[Hop] = []
    scheduled = at(events.ROUTER_SCHEDULED)
    if scheduled is not None:
        out.append(Hop("router queue", "router", 0.0, scheduled, queued))
    cursor = scheduled or 0.0
    compute = next((r for r in t.events(events.ENGINE_PREFILL_DONE) if r.service in ("prefill", "engine")), None)
    prefill_done = at(events.ROUTER_PREFILL_DONE)
    if compute is not None and compute[events.PREFILL_MS] is not None:
        out.append(Hop("prefill compute", "prefill", cursor, compute[events.PREFILL_MS],
                       "prefill engine.prefill_done prefill_ms"))
        cursor += compute[events.PREFILL_MS]
    elif prefill_done is not None:
        out.append(Hop("prefill leg", "prefill", cursor, prefill_done - cursor, "router.scheduled → router.prefill_done"))
        cursor = prefill_done
    sent = t.first(events.KV_PRODUCER_SENT)
    if sent is not None and sent[events.TRANSFER_MS] is not None:
        out.append(Hop("KV push", "kv", cursor, sent[events.TRANSFER_MS], "prefill kv_producer.sent transfer_ms"))
        cursor += sent[events.TRANSFER_MS]
    handoff = at(events.ROUTER_KV_HANDOFF) or prefill_done or cursor
    first = at(events.ROUTER_DECODE_FIRST_TOKEN)
    if first is not None:
        out.append(Hop("decode first token", "decode", handoff, max(first - handoff, 0.0),
                       "router.prefill_done → router.decode_first_token"))
    done = at(events.ROUTER_REQUEST_DONE)
    if first is not None and done is not None:
        out.append(Hop("stream", "decode", first, max(done - first, 0.0), "router.decode_first_token → router.request_done"))
    return out


def text(t: Timeline) -> str:
    """The hops, the total, and the request's lines in hop order."""
    found = hops(t)
    done = t.first(events.ROUTER_REQUEST_DONE)
    lines = [f"request {t.request_id}: status {t.status if t.status is not None else '?'}, reached "
             f"{' → '.join(t.reached) or 'nothing'}" + ("" if t.complete else " (did not complete)")]
    for h in found:
        lines.append(f"  {h.name:<19} {h.duration_ms:>9.1f} ms   at +{h.start_ms:.1f} ms   ({h.source})")
    if done is not None and done[events.E2E_MS] is not None:
        lines.append(f"  {'total':<19} {done[events.E2E_MS]:>9.1f} ms   (router.request_done e2e_ms)")
    if found:
        slowest = max(found, key=lambda h: h.duration_ms)
        lines.append(f"slowest hop: {slowest.name} ({slowest.duration_ms:.1f} ms)")
    lines.append("lines:")
    lines.extend(f"  {r.service:<7} {r.ts or '-':<24} {r.event:<26} {r.msg[:100]}" for r in t.records)
    return "\n".join(lines) + "\n"


def picture(t: Timeline, path: Path) -> Path:
    """Write the timeline as a PNG or SVG (by suffix); → the path."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # SVG keeps its labels as text (searchable, testable)
    found = hops(t)
    fig, ax = plt.subplots(figsize=(9, 2.8), dpi=100)
    rows = {lane: i for i, lane in enumerate(reversed(LANES))}
    for h in found:
        ax.barh(rows[h.lane], max(h.duration_ms, 0.05), left=h.start_ms, color=COLORS[h.lane], edgecolor="black")
        ax.text(h.start_ms + h.duration_ms / 2, rows[h.lane], f"{h.name}\n{h.duration_ms:.1f} ms", ha="center",
                va="center", fontsize=7)
    ax.set_yticks(list(rows.values()), list(rows.keys()))
    ax.set_xlabel("ms since the router received the request")
    ax.set_title(f"request {t.request_id} (status {t.status})", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path
