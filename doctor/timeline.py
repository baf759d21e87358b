"""Join records by request id into per-request timelines router → prefill → KV → decode.

Containers' clocks disagree (decode may be seconds behind), so records are never joined by time:
by `request_id`, and KV lines logged outside a request (the decode listener thread) by
`transfer_id`, which the router and prefill log with the request id. Within a request, records are
ordered by hop (client → router → prefill → decode) and then by timestamp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter

from doctor.parse import CLIENT, Record
from stack.common import events

HOPS = ("router", "prefill", "kv", "decode", "done")
_KV_DONE = {events.KV_PRODUCER_SENT, events.KV_CONSUMER_RECEIVED, events.KV_CONSUMER_CLAIMED}


@dataclass
class Timeline:
    """One request's records in hop order; the derived facts are computed once, after the join."""

    request_id: str
    records: list[Record] = field(default_factory=list)

    def events(self, *names: str) -> list[Record]:
        return [r for r in self.records if r.event in names]

    def first(self, *names: str) -> Record | None:
        return next((r for r in self.records if r.event in names), None)

    @cached_property
    def colocated(self) -> bool:
        scheduled = self.first(events.ROUTER_SCHEDULED)
        if scheduled is not None and scheduled[events.MODE] == "colocated":
            return True
        return any(r.service == "engine" for r in self.records)

    @cached_property
    def status(self) -> int | None:
        """What the router answered the client (request_done, else its access line)."""
        done = self.first(events.ROUTER_REQUEST_DONE)
        if done is not None and done[events.STATUS] is not None:
            return done[events.STATUS]
        for r in self.records:
            if r.service == "router" and r.event == events.HTTP_ACCESS and r[events.STATUS] is not None:
                return r[events.STATUS]
        return None

    @cached_property
    def reached(self) -> tuple[str, ...]:
        """The hops this request got to, in path order."""
        hops: list[str] = []
        services = {r.service for r in self.records}
        names = {r.event for r in self.records}
        if "router" in services:
            hops.append("router")
        if "prefill" in services or "engine" in services or names & {events.ROUTER_PREFILL_DONE, events.ROUTER_PREFILL_FINISHED}:
            hops.append("prefill")
        status = self.status
        # A failed leg that the router retried elsewhere still ends well; a cut stream does not.
        cut = any(r[events.MID_STREAM] is True for r in self.events(events.ROUTER_DECODE_FAILED))
        done = self.first(events.ROUTER_REQUEST_DONE)
        answered = status is not None and status < 400 and not cut and not (done is not None and done[events.ERROR])
        # vLLM engines log no per-request lines: a NIXL hand-off (vLLM's params name remote_engine_id) that the router
        # saw answered went through KV and decode (vLLM's own proof is global: its "KV Transfer metrics" lines).
        vllm_handoff = answered and any("remote_engine_id" in (r[events.KV_TRANSFER_PARAMS] or ())
                                        for r in self.events(events.ROUTER_PREFILL_DONE, events.ROUTER_KV_HANDOFF))
        if names & _KV_DONE or vllm_handoff:
            hops.append("kv")
        if "decode" in services or "engine" in services or events.ROUTER_DECODE_FIRST_TOKEN in names or vllm_handoff:
            hops.append("decode")
        if answered:
            hops.append("done")
        return tuple(hops)

    @cached_property
    def complete(self) -> bool:
        """Went all the way: router → prefill → KV → decode → answered (no KV hop when colocated)."""
        reached = self.reached
        if self.first(events.ROUTER_PREFILL_FINISHED) is not None:  # the prefill's one token ended it: no decode leg
            needed: tuple[str, ...] = ("router", "prefill", "done")
        else:
            needed = ("router", "prefill", "decode", "done") if self.colocated else HOPS
        return all(h in reached for h in needed)

    @cached_property
    def stopped_at(self) -> str | None:
        """The last hop reached by a request that did not complete (None when it completed)."""
        if self.complete:
            return None
        reached = [h for h in self.reached if h != "done"]
        return reached[-1] if reached else None

    @property
    def has_service_records(self) -> bool:
        return any(r.service != CLIENT for r in self.records)


_NOT_GENERATION = frozenset({events.HTTP_ACCESS, events.AUTH_ACCEPTED})


def build_timelines(records: list[Record]) -> tuple[dict[str, Timeline], list[Record]]:
    """→ (timelines by request id, records that belong to no request: start-up lines and the like)."""
    timelines: dict[str, Timeline] = {}
    loose: list[Record] = []
    transfer_owner: dict[str, str] = {}
    for r in records:
        if r.request_id != "-":
            timeline = timelines.get(r.request_id)
            if timeline is None:
                timeline = timelines[r.request_id] = Timeline(r.request_id)
            timeline.records.append(r)
            transfer = r.get(events.TRANSFER_ID)
            if transfer:
                transfer_owner[transfer] = r.request_id
        else:
            loose.append(r)
    background: list[Record] = []
    for r in loose:
        owner = transfer_owner.get(r.get(events.TRANSFER_ID) or "")
        if owner is not None:
            timelines[owner].records.append(r)
        else:
            background.append(r)
    # Health probes, /metrics, /v1/models and /v1/usage get request ids too, but only an access line
    # (and an accepted key): they are not generation requests and cannot stop at a hop.
    probes = [rid for rid, t in timelines.items() if all(r.event in _NOT_GENERATION for r in t.records)]
    for rid in probes:
        background.extend(timelines.pop(rid).records)
    order = attrgetter("hop", "ts")
    for timeline in timelines.values():
        timeline.records.sort(key=order)
    return timelines, background
