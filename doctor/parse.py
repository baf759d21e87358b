"""Log lines → records: our services' JSON lines, `docker compose logs` prefixes, pasted client errors.

A line may arrive as
    {"ts": …, "service": "prefill", "event": "kv_producer.sent", …}                 raw JSON (our logging)
    router-1  | {"ts": …}                                                            compose v2
    proj_router_1 | 2026-11-29T20:31:55.123456789Z {"ts": …}                         compose v1, --timestamps
    openai.AuthenticationError: Error code: 401 - {'error': …}                       a client error, pasted
Anything else (tracebacks, binary noise, truncated JSON) is counted in `ParseStats.unreadable` and
skipped: one bad line never stops a diagnosis. Service lines are compared with their event's
declaration in stack/common/events.py: a line of an unknown event, or with undeclared or missing
fields (another version of the stack?), is still read, and counted in `ParseStats.undeclared`.
Checks read a record's fields through the declared `Field` constants: `record[events.KV_PORT]`.

Speed: a JSON line costs one `json.loads` plus a few dict lookups; the prefix regex only runs on
lines that do not start with `{`, and client-error patterns only on lines that are not JSON.
"""

from __future__ import annotations

import functools
import json
import json.scanner
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from doctor import engine_lines, signatures
from stack.common import events

SERVICES = ("router", "prefill", "decode", "engine")
CLIENT = "client"
UPSTREAM = "upstream."  # event prefix of a record made from a real engine's failure string (doctor/signatures.py)
# Order of hops inside one request; clocks of different containers disagree, so within a
# request records are ordered by hop first and by timestamp second.
HOP_RANK = {CLIENT: 0, "router": 1, "prefill": 2, "engine": 2, "decode": 3}

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# `router-1  | …` (v2), `proj_router_1 | …` (v1): a container/service name before the bar.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_DOCKER_TS = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:?\d{2})\s")
_INDEX_SUFFIX = re.compile(r"[-_]\d+$")
_REQUEST_ID = re.compile(r"request[ _-]?id[\"']?\s*[:=]\s*[\"']?([A-Za-z0-9_-]{6,})")
# A key in a client's own output (`Illegal header value b'Bearer sk-… '`): findings never show key values.
_SECRET = re.compile(r"(?i)(bearer\s+|x-api-key[\"']?\s*[:=]\s*[\"']?)[^\s'\",}]+")
_STATUS = re.compile(r"(?:Error code:|API Error:|unexpected status|status(?: code)?:?|HTTP)\s*(\d{3})\b")

# Client-side error strings (shared/reference/gateways.md, part B) → a stable kind.
CLIENT_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(pattern))
    for kind, pattern in (
        # httpx/h11 refuse a header value with surrounding whitespace or control bytes before anything is sent.
        ("header_refused", r"Illegal header value|LocalProtocolError|Invalid header value"),
        ("dns_failed", r"Name or service not known|getaddrinfo failed|nodename nor servname|"
                       r"Temporary failure in name resolution|No address associated with hostname"),
        ("oauth_expired", r"OAuth token has expired"),
        ("invalid_grant", r"invalid_grant"),
        ("auth_unresolved", r"Could not resolve authentication method|Invalid API key · Please run /login"),
        ("auth_conflict", r"Auth conflict: "),
        ("env_key_missing", r"Missing environment variable: `?(\w+)`?"),
        ("wire_api_chat", r"\"chat\" wire API|wire_api = \"chat\""),
        ("local_proxy_failed", r"local proxy failed"),
        ("socks_missing", r"Using SOCKS proxy, but the 'socksio' package is not installed"),
        ("stream_disconnected", r"stream disconnected before completion: error sending request"),
        ("stream_incomplete", r"stream closed before response\.completed|stream disconnected before completion"),
        ("choices_keyerror", r"KeyError: ['\"]choices['\"]"),
        ("choices_read", r"Error reading choices\[0\]\.message\.content|reading '0'\)"),
        ("choices_index", r"list index out of range|reading 'index'\)"),
        (
            "connect_failed",
            r"ECONNREFUSED|Connection refused|APIConnectionError|Connection error\.|"
            r"Unable to connect to Anthropic services|Failed to connect to|ConnectError|"
            r"Remote end closed connection|Proxy Error|ProxyError",
        ),
        ("auth_401", r"\b401\b|AuthenticationError|authentication_error|invalid_api_key|Unauthorized"),
        ("rate_429", r"\b429\b|RateLimitError|rate_limit_error"),
        ("http_error", r"(?:Error code:|API Error:|unexpected status)\s*\d{3}"),
    )
)


@dataclass(slots=True)
class Record:
    """One log line that means something: a service event or a recognised client error."""

    service: str  # router | prefill | decode | engine | client
    ts: str  # ISO-8601 as logged ("" when the line had none)
    event: str  # an events.py constant, or client.<kind>
    request_id: str  # "-" when the line belongs to no request
    level: str
    msg: str
    data: dict  # every field of the JSON line (for client lines: kind, status)
    line: str  # the line as read, without the compose prefix: the evidence
    origin: str  # "file:lineno" (or "docker:<service>:lineno", "stdin:lineno")
    hop: int = 4  # position on the request path: HOP_RANK of the service

    def __getitem__(self, field: events.Field) -> Any:
        """`field` of this record's event, which must declare it (None when absent or of another type)."""
        declared = events.ALL.get(self.event)
        assert declared is not None and declared.fields.get(field.name) is field, \
            f"{self.event} declares no field {events.constant_of(field)}: see stack/common/events.py"
        return field.of(self.data)

    def get(self, field: events.Field) -> Any:
        """`field` when this record has it, whatever its event (for scans across events)."""
        return field.of(self.data)


@dataclass
class ParseStats:
    lines: int = 0
    records: int = 0
    unreadable: int = 0
    ignored: int = 0  # readable but not ours (a service's plain traceback line, client output around an error)
    undeclared: int = 0  # read, but its event or fields differ from stack/common/events.py
    compose: int = 0  # lines with a `docker compose logs` prefix: the stack runs under compose
    unreadable_examples: list[str] = field(default_factory=list)
    undeclared_examples: list[str] = field(default_factory=list)

    def merge(self, other: ParseStats) -> None:
        self.lines += other.lines
        self.records += other.records
        self.unreadable += other.unreadable
        self.ignored += other.ignored
        self.undeclared += other.undeclared
        self.compose += other.compose
        self.unreadable_examples.extend(other.unreadable_examples[: 3 - len(self.unreadable_examples)])
        self.undeclared_examples.extend(other.undeclared_examples[: 3 - len(self.undeclared_examples)])


@functools.lru_cache(maxsize=256)
def service_from_name(name: str) -> str:
    """`router-1`, `proj_router_1`, `pd-test-decode-1` → the compose service name."""
    base = _INDEX_SUFFIX.sub("", name)
    last = re.split(r"[-_]", base)[-1]
    return last if last in SERVICES else base


def classify_client_line(text: str) -> tuple[str, dict] | None:
    """The kind of client error a plain line shows (first match wins), with status and env var."""
    for kind, pattern in CLIENT_PATTERNS:
        match = pattern.search(text)
        if match:
            data: dict = {"kind": kind}
            status = _STATUS.search(text)
            if status:
                data["status"] = int(status.group(1))
            if kind == "env_key_missing" and match.group(1):
                data["env_var"] = match.group(1)
            return kind, data
    return None


def parse_lines(
    lines: Iterable[str], origin: str, service_hint: str | None = None, client_source: bool = False
) -> tuple[list[Record], ParseStats]:
    """Parse one source. `service_hint` names the service when the source is one container's log;
    `client_source` marks a client's own output (every recognisable line is a client error)."""
    records: list[Record] = []
    stats = ParseStats()
    # The C scanner behind json.loads, without its wrapper: one call per line.
    scan = json.scanner.make_scanner(json.JSONDecoder())
    append = records.append
    prefixes: dict[str, str | None] = {}  # raw prefix text → service (None: not a compose prefix)
    hop_rank = HOP_RANK.get
    declared_events = events.ALL.get
    for lineno, raw in enumerate(lines, 1):
        text = raw.rstrip("\r\n")
        if not text or text.isspace():
            continue
        stats.lines += 1
        service = service_hint
        if text[0] != "{":
            if "\x1b" in text:
                text = _ANSI.sub("", text)
            bar = text.find("|")
            if bar > 0:
                head = text[:bar]
                prefixed = prefixes.get(head, "")
                if prefixed == "":  # first time this prefix is seen: is it a container name?
                    name = head.strip()
                    prefixed = prefixes[head] = service_from_name(name) if _NAME.fullmatch(name) else None
                if prefixed is not None:
                    service = prefixed
                    stats.compose += 1
                    text = text[bar + 2:] if text[bar + 1:bar + 2] == " " else text[bar + 1:]
            if text[:1].isdigit():
                stamp = _DOCKER_TS.match(text)
                if stamp:
                    text = text[stamp.end():]
        if text[:1] == "{":
            try:
                obj, end = scan(text, 0)
            except (ValueError, StopIteration):
                obj, end = None, 0
            if isinstance(obj, dict) and "event" in obj and (end == len(text) or text[end:].isspace()):
                who = obj.get("service") or service or "?"
                event = obj["event"]
                append(Record(who, obj.get("ts") or "", event, obj.get("request_id") or "-",
                              obj.get("level") or "", obj.get("msg") or "", obj, text, f"{origin}:{lineno}",
                              hop_rank(who, 4)))
                if event == events.LOG and (sig := signatures.match(obj.get("msg") or "")) is not None:
                    append(_signature_record(sig, who, obj.get("ts") or "", obj.get("request_id") or "-", text,
                                             f"{origin}:{lineno}"))
                declared = declared_events(event)
                keys = obj.keys()
                if declared is None or not (keys <= declared.line_keys and keys >= declared.required):
                    _undeclared(stats, declared, event, keys, f"{origin}:{lineno}")
                continue
            if obj is None or end != len(text):  # truncated or corrupt JSON: not a client error either
                stats.unreadable += 1
                if len(stats.unreadable_examples) < 3:
                    stats.unreadable_examples.append(f"{origin}:{lineno}: {text[:80]!r}")
                continue
        where = f"{origin}:{lineno}"
        if not client_source and (sig := signatures.match(text)) is not None:
            append(_signature_record(sig, service if service in SERVICES else "engine", "", "-", text, where))
            continue
        if service in SERVICES and (fact := engine_lines.parse(text, service)) is not None:
            ts, event, level, data = fact
            text = engine_lines.redact(text)
            append(Record(service, ts, event, "-", level, text[:300], data, text, where, hop_rank(service, 4)))
            continue
        record = _client_record(text, where) if (client_source or service in (None, CLIENT)) else None
        if record is not None:
            append(record)
        elif client_source or (service in SERVICES and text.isprintable()):
            stats.ignored += 1  # a service's plain output (traceback, banner): not an event
        else:
            stats.unreadable += 1
            if len(stats.unreadable_examples) < 3:
                stats.unreadable_examples.append(f"{where}: {text[:80]!r}")
    stats.records = len(records)
    return records, stats


def _undeclared(stats: ParseStats, declared: events.Event | None, event: str, keys: Iterable[str], where: str) -> None:
    stats.undeclared += 1
    if len(stats.undeclared_examples) < 3:
        if declared is None:
            stats.undeclared_examples.append(f"{where}: unknown event {event!r}")
        else:
            undeclared, missing = declared.problems(set(keys) - events.BASE_KEYS)
            stats.undeclared_examples.append(f"{where}: {event}" + (f" undeclared {', '.join(undeclared)}" if undeclared else "")
                                             + (f" missing {', '.join(missing)}" if missing else ""))


def _client_record(text: str, where: str) -> Record | None:
    if text.lstrip().startswith('File "'):  # a traceback frame: `line 401` is a line number, not a status
        return None
    found = classify_client_line(text)
    if found is None:
        return None
    kind, data = found
    text = _SECRET.sub(r"\1<redacted>", text)
    rid = _REQUEST_ID.search(text)
    return Record(CLIENT, "", f"client.{kind}", rid.group(1) if rid else "-", "ERROR", text.strip()[:300], data,
                  text.strip(), where, HOP_RANK[CLIENT])


def _signature_record(sig: signatures.Signature, service: str, ts: str, request_id: str, text: str,
                      where: str) -> Record:
    return Record(service, ts, UPSTREAM + sig.id, request_id, "ERROR" if sig.severity == "error" else "WARNING",
                  text.strip()[:300], {"signature": sig.id}, text.strip(), where, HOP_RANK.get(service, 4))
