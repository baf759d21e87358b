"""An engine's life in the window: its engine core died (vLLM's EngineCore / EngineDeadError lines), it restarted
(a second start-up banner in one service's log), and when it was down — "was down from T1 to T2" once it came back.

The requests it cut are joined: the router's failed legs to that engine (router.decode_failed / prefill_failed /
upstream_error / http.error no_*_backend), and vLLM's lines naming a request (chatcmpl-<id>).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from doctor import engine_facts
from doctor.engine_lines import VLLM
from doctor.findings import Context, Finding, finding
from doctor.parse import Record
from stack.common import events

CLOCK_SLACK_S = 2.0
_LEG_FAILED = (events.ROUTER_DECODE_FAILED, events.ROUTER_PREFILL_FAILED, events.ROUTER_UPSTREAM_ERROR)


def failed_legs(ctx: Context, role: str, since: str = "", until: str = "~") -> list[Record]:
    """The router's lines of legs to `role` that failed between two times (the router's clock)."""
    out = []
    for r in ctx.by_event(*_LEG_FAILED, events.HTTP_ERROR):
        if r.service != "router" or not since <= r.ts <= until:
            continue
        if r.event == events.HTTP_ERROR:
            if r[events.CODE] == f"no_{role}_backend":
                out.append(r)
        elif (r.event == events.ROUTER_UPSTREAM_ERROR and r[events.ROLE] == role) or \
                (r.event == events.ROUTER_DECODE_FAILED and role == "decode") or \
                (r.event == events.ROUTER_PREFILL_FAILED and role == "prefill"):
            out.append(r)
    return out


def _unasked_deaths(ctx: Context, service: str) -> list[Record]:
    """vLLM's fatal lines that no stop asked for: a SIGTERM'd engine core also ends in EngineDeadError."""
    out, stopping = [], False
    for r in ctx.records:
        if r.service != service:
            continue
        if r.event == VLLM + "banner":
            stopping = False
        elif r.event == VLLM + "shutdown":
            stopping = True
        elif r.event == VLLM + "fatal" and not stopping:
            out.append(r)
    return out


def _went_down(ctx: Context, service: str, ts: str) -> str:
    """When the service went down before its start-up at `ts`: its first shutdown line since its last start, else
    its last timed line (a kill leaves no shutdown line)."""
    before = [r for r in ctx.records if r.service == service and r.ts and r.ts < ts]
    last_start = max((r.ts for r in before if r.event == VLLM + "banner"), default="")
    shutdown = [r.ts for r in before if r.event == VLLM + "shutdown" and r.ts >= last_start]
    return min(shutdown) if shutdown else max((r.ts for r in before), default="")


def _earlier(ts: str, seconds: float) -> str:
    """`ts` moved back: the router and the engine stamp one event a little apart (and vLLM to the second only)."""
    try:
        moved = datetime.fromisoformat(ts.replace("Z", "+00:00")) - timedelta(seconds=seconds)
    except ValueError:
        return ts
    return moved.strftime("%Y-%m-%dT%H:%M:%S")


def check(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    runs = engine_facts.starts(ctx)
    for service in engine_facts.ENGINES:
        fatal = _unasked_deaths(ctx, service)
        starts = runs.get(service, [])
        role = "decode" if service == "decode" else "prefill"
        restart = len(starts) > 1
        down_from = down_to = ""
        until = "~"  # no restart: every failure since it died
        if restart:
            second = starts[-1]
            down_from = fatal[0].ts if fatal else _went_down(ctx, service, second.ts)
            down_to = second.ready_ts or second.ts
            # the router sends to it again only once its health check saw it up
            back = [r.ts for r in ctx.by_event(events.BACKEND_HEALTH)
                    if r[events.ROLE] == role and r[events.STATE] == "up" and r.ts >= down_from]
            until = max([down_to, *back[:1]])
        if not fatal and not restart:
            continue
        cut = failed_legs(ctx, role, since=_earlier(fatal[0].ts if fatal else down_from, CLOCK_SLACK_S), until=until)
        cut_ids = [r.request_id for r in cut] + [r.request_id for r in fatal if r.request_id != "-"]
        if ctx.focus is not None and ctx.focus not in cut_ids:
            continue  # asked about one request: an engine's life in the logs that did not touch it is not its cause
        if fatal:
            when = f"was down from {fatal[0].ts} to {down_to}" if restart else f"died at {fatal[0].ts} and did not come back"
            out.append(finding(
                "engine.fatal", "error",
                f"{service}'s engine core died (vLLM EngineCore): {service} {when}; {len(set(cut_ids))} request(s) failed",
                f"vLLM's engine core process on {service} died (a fatal error, or killed: OOM, a signal); its API "
                "server fails the requests in flight with EngineDeadError (HTTP 500) and shuts down, so later requests "
                "find no engine. The lines just above the first one shown name the root cause.",
                _restart_fix(ctx, service, "EngineCore|EngineDeadError|Error|Traceback"),
                fatal[:3] + cut[:3] + (starts[-1].records[:1] if restart else []), cut_ids))
        elif restart:
            stopped = [r for r in ctx.by_event(VLLM + "shutdown") if r.service == service and r.ts == down_from]
            out.append(finding(
                "engine.restarted", "error" if cut else "warning",
                f"{service} restarted: it was down from {down_from or '?'} to {down_to} (a second start-up in its log); "
                f"{len(set(cut_ids))} request(s) failed meanwhile",
                f"{service} stopped (its last line before the restart at {down_from or '?'}) and started again "
                f"(serving at {down_to}). Streams it was serving were cut; requests in the gap had no {role} engine. "
                "It serves again now: nothing is down.",
                f"find why {service} stopped (its lines before {down_from or 'the second start-up'}; a kill, OOM or "
                f"a deploy); retry the cut requests. {_restart_fix(ctx, service, 'Shutting down|Error|Killed')}",
                cut[:3] + starts[0].records[:1] + stopped[:1] + starts[-1].records[:1], cut_ids))
    return out


def _restart_fix(ctx: Context, service: str, pattern: str) -> str:
    read = engine_facts.logs_command(ctx, service, pattern)
    if engine_facts.compose(ctx):
        return f"{read}; then docker compose up -d {service}"
    command = "vllm serve" if engine_facts.kind_of(ctx, service) == "vllm" else "python -m stack.engine"
    return f"{read}; then start the {service} engine again (its {command} command)"
