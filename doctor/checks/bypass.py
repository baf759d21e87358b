"""Clients that talk to an engine directly (a published engine port), not through the router.

Two shapes. Engines that hold PD_INTERNAL_KEY (every ./pd and compose stack) refuse such a caller with
401 internal_key_required and log internal_auth.rejected with its address: `engine.bypass_refused`.
Engines without the key serve it: a request an engine served that has no router line and is no PD leg
never went through the router (no key check, no limits, no PD): `engine.bypassed_router`. That relies
on engine.request_received (pd_leg null) and on the router's lines being collected (without them
every engine request would look like this). When read live, the engines' published ports are named.
"""

from __future__ import annotations

from doctor.findings import Context, Finding, finding
from stack.common import events

ENGINES = ("prefill", "decode")


def check(ctx: Context) -> list[Finding]:
    return _refused(ctx) + _served(ctx)


def _published(ctx: Context) -> dict[str, list[str]]:
    return {s: p for s, p in ((ctx.docker or {}).get("published") or {}).items() if s in ENGINES and p}


def _refused(ctx: Context) -> list[Finding]:
    # refusals of the router's own legs (its PD_INTERNAL_KEY is not the engine's) are internal_key's finding
    router_refused = {r[events.ROLE] for r in ctx.by_event(events.ROUTER_UPSTREAM_ERROR) if r[events.STATUS] in (401, 403)}
    refused = [r for r in ctx.by_event(events.INTERNAL_AUTH_REJECTED)
               if r.service in ENGINES and r.service not in router_refused]
    if not refused:
        return []
    peers = sorted({r[events.PEER] or "?" for r in refused})
    services = sorted({r.service for r in refused})
    where = "; ".join(f"{s} publishes {', '.join(p)}" for s, p in _published(ctx).items())
    return [finding(
        "engine.bypass_refused", "warning",
        f"{len(refused)} call(s) to {', '.join(services)} without the router's internal key were refused (401) "
        f"from {', '.join(peers)}",
        "A client (or a script) calls an engine directly instead of the router; the engine answers only its "
        "router (Authorization: Bearer <PD_INTERNAL_KEY>), so that client gets 401 internal_key_required."
        + (f" {where}." if where else ""),
        f"point the client at the router ({ctx.env.router_url}/v1) with the unified key; "
        f"find it by its address ({', '.join(peers)})"
        + (f"; remove the published port of {' '.join(sorted(_published(ctx)))}" if where else ""),
        refused[:4], [r.request_id for r in refused])]


def _served(ctx: Context) -> list[Finding]:
    if "router" not in ctx.services_seen() and "router" not in ((ctx.docker or {}).get("services") or {}):
        return []
    # Start from the engine requests that are no PD leg (rare on a PD stack), then look for a router line.
    candidates = dict.fromkeys(r.request_id for r in ctx.by_event(events.ENGINE_REQUEST_RECEIVED)
                               if r.service in ENGINES and r[events.PD_LEG] is None)
    direct = [t for rid in candidates if (t := ctx.timelines.get(rid)) is not None
              and not any(r.service == "router" for r in t.records)]
    if not direct:
        return []
    by_service: dict[str, int] = {}
    evidence = []
    for t in direct:
        first = t.first(events.ENGINE_REQUEST_RECEIVED)
        by_service[first.service] = by_service.get(first.service, 0) + 1
        evidence += t.events(events.ENGINE_REQUEST_RECEIVED, events.HTTP_ACCESS)[:2]
    published = _published(ctx)
    where = "; ".join(f"{s} publishes {', '.join(p)}" for s, p in published.items())
    services = ", ".join(f"{s} ×{n}" for s, n in by_service.items())
    fix_services = " ".join(sorted(published or by_service))
    return [finding(
        "engine.bypassed_router", "error",
        f"{len(direct)} request(s) went straight to an engine, not through the router ({services})",
        "These requests have engine lines but no router line and are no PD leg: a client reached the engine "
        "directly (no key check, no limits, no prefill/decode split; decode without KV recomputes)."
        + (f" {where}." if where else "") + " The engines do not log the caller's address.",
        f"remove the published port of {fix_services} (ports: in your compose override; compose.yaml only "
        f"exposes 8000), docker compose up -d {fix_services}; point clients at the router "
        f"({ctx.env.router_url}/v1)",
        evidence, [t.request_id for t in direct])]
