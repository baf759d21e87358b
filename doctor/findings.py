"""Findings and the context every check reads (the checks and their registry: doctor/checks/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Iterable

from doctor import engine_lines, stackfacts
from doctor.environment import Environment
from doctor.parse import CLIENT, ParseStats, Record
from doctor.timeline import Timeline, build_timelines

SEVERITIES = ("ok", "warning", "error")
EVIDENCE_MAX = 6  # evidence lines kept per finding; the request ids say where the rest are


@dataclass(frozen=True)
class Evidence:
    service: str
    ts: str
    line: str

    @classmethod
    def of(cls, record: Record) -> Evidence:
        return cls(record.service, record.ts, record.line)


@dataclass(frozen=True)
class Finding:
    id: str  # stable, e.g. "auth.unknown_key"
    severity: str  # ok | warning | error
    title: str  # one line
    cause: str  # why it happens, in a sentence or two
    fix: str  # a command or the config to write
    evidence: tuple[Evidence, ...] = ()
    request_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.severity in SEVERITIES, f"bad severity {self.severity!r}"


def finding(id: str, severity: str, title: str, cause: str, fix: str,
            records: Iterable[Record] = (), request_ids: Iterable[str] = ()) -> Finding:
    """Build a Finding from records: evidence in hop order (router → prefill → decode), deduplicated."""
    seen: set[str] = set()
    chosen: list[Record] = []
    records, request_ids = list(records), list(request_ids)
    # The X-Request-ID a client sent is named too, after the router's id (its lines carry it as client_request_id).
    client = {r.request_id: r.data["client_request_id"] for r in records if isinstance(r.data.get("client_request_id"), str)}
    request_ids = [*request_ids, *(client[i] for i in request_ids if i in client)]
    for r in sorted(records, key=lambda r: (r.hop, r.ts)):
        if r.line not in seen:
            seen.add(r.line)
            chosen.append(r)
    chosen = _spread(chosen, EVIDENCE_MAX)
    ids = tuple(dict.fromkeys(i for i in request_ids if i and i != "-"))
    return Finding(id, severity, title, cause, fix, tuple(Evidence.of(r) for r in chosen), ids)


def _spread(records: list[Record], limit: int) -> list[Record]:
    """Keep at most `limit` records but at least one per service when there are more."""
    if len(records) <= limit:
        return records
    per_service: dict[str, list[Record]] = {}
    for r in records:
        per_service.setdefault(r.service, []).append(r)
    kept: list[Record] = [group[0] for group in per_service.values()]
    for r in records:
        if len(kept) >= limit:
            break
        if r not in kept:
            kept.append(r)
    return sorted(kept, key=lambda r: (r.hop, r.ts))


@dataclass
class Context:
    """What every check reads: records, timelines, start-up lines, client errors, the environment."""

    records: list[Record]
    timelines: dict[str, Timeline]
    background: list[Record]  # service lines outside any request (start-up, listeners, health)
    client: list[Record]  # recognised client errors (pasted, stdin, --client-log)
    env: Environment
    stats: ParseStats = field(default_factory=ParseStats)
    docker: dict | None = None  # live facts when read from a compose project: {"project", "services"}
    focus: str | None = None  # --request-id: the router's id of the one request asked about (narrow)
    _by_event: dict[str, list[Record]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # Checks ask for events by name many times; one pass builds the index.
        for r in self.records:
            bucket = self._by_event.get(r.event)
            if bucket is None:
                self._by_event[r.event] = [r]
            else:
                bucket.append(r)

    @classmethod
    def build(cls, records: list[Record], env: Environment, stats: ParseStats | None = None,
              docker: dict | None = None) -> Context:
        engine_lines.fix_years(records)
        engine_lines.join_requests(records)
        service_records = [r for r in records if r.service != CLIENT]
        timelines, background = build_timelines(service_records)
        client = [r for r in records if r.service == CLIENT]
        return cls(records, timelines, background, client, env, stats or ParseStats(), docker)

    def timeline(self, request_id: str) -> Timeline | None:
        """A request's timeline by the router's id or by the X-Request-ID its client sent (the router names every
        request itself and logs the client's as client_request_id: stack.common.errors)."""
        found = self.timelines.get(request_id)
        if found is None:
            found = next((t for t in self.timelines.values()
                          if any(r.data.get("client_request_id") == request_id for r in t.records)), None)
        return found

    def narrow(self, request_id: str) -> Context | None:
        """One request's timeline plus the lines outside any request (start-up facts, listeners)."""
        timeline = self.timeline(request_id)
        if timeline is None:
            return None
        request_id = timeline.records[0].request_id if timeline.records else request_id
        return Context(timeline.records + self.background + self.client, {request_id: timeline}, self.background,
                       self.client, self.env, self.stats, self.docker, focus=request_id)

    def by_event(self, *names: str) -> list[Record]:
        """Records of these events: read order for one event, timestamp order across several."""
        if len(names) == 1:
            return list(self._by_event.get(names[0], ()))
        return sorted((r for name in names for r in self._by_event.get(name, ())), key=attrgetter("ts"))

    @property
    def nothing_completed(self) -> bool:
        """No request in the window went all the way: whatever failed, such a window is never a pass."""
        return not any(t.complete for t in self.timelines.values())

    @property
    def facts(self) -> stackfacts.StackFacts:
        """The real service/network/file names of the stack (live project, else the shipped compose.yaml)."""
        return stackfacts.from_docker(self.docker)

    def services_seen(self) -> set[str]:
        return {r.service for r in self.records if r.service != CLIENT}

    def client_kinds(self, *kinds: str) -> list[Record]:
        wanted = {f"client.{k}" for k in kinds}
        return [r for r in self.client if r.event in wanted]


def worst(findings: Iterable[Finding]) -> str:
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return max((f.severity for f in findings), key=order.__getitem__, default="ok")
