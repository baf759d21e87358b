"""Requests that failed (or never finished) and that no diagnosis explained: never a silent "healthy".

Decided after every other diagnosis: any request with router lines that did not complete and whose id
no finding carries is counted here, by the status the router answered, with its lines as evidence.
An error when any of them got a 5xx, a 4xx decode answered after prefill accepted the request (the stack's
failure), or when no request in the window completed (a window where every request failed never exits 0);
any other 4xx is a warning (the client's request, most likely). A request the client itself abandoned
(router.client_disconnected) is no failure; `healthy` counts it among those that did not complete.
"""

from __future__ import annotations

from collections import Counter

from doctor.findings import Context, Finding, finding
from stack.common import events


_ENGINE_FAILED = (events.ROUTER_UPSTREAM_ERROR, events.ROUTER_DECODE_FAILED)


def check(ctx: Context, explained: set[str]) -> list[Finding]:
    failed = [t for t in ctx.timelines.values()
              if t.request_id not in explained and not t.complete and any(r.service == "router" for r in t.records)
              and t.first(events.ROUTER_CLIENT_DISCONNECTED) is None  # the client chose to leave: not a failure
              and ((t.status or 0) >= 400 or t.first(events.ROUTER_REQUEST_DONE) is not None)]
    if not failed:
        return []
    statuses = Counter(str(t.status or "?") for t in failed)
    evidence = []
    for t in failed[:4]:
        bad = [r for r in t.records if r.level in ("WARNING", "ERROR", "CRITICAL")]
        evidence += (bad or t.records)[:2] + t.events(events.ROUTER_REQUEST_DONE)[:1]
    # the stack's own failure: a 5xx, or a 4xx decode answered for a request prefill had accepted (prefill and decode
    # disagree: not the client's request)
    server_side = any((t.status or 500) >= 500 or (t.first(events.ROUTER_PREFILL_DONE) is not None
                                                  and t.first(*_ENGINE_FAILED) is not None) for t in failed)
    return [finding(
        "request.unexplained", "error" if server_side or ctx.nothing_completed else "warning",
        f"{len(failed)} request(s) failed for a reason no diagnosis knows (status "
        + ", ".join(f"{s} ×{n}" for s, n in sorted(statuses.items())) + ")",
        "These requests did not complete, and none of the doctor's diagnoses recognised why; the evidence lines "
        "are their router and engine lines.",
        "python -m doctor explain <request id> for one of them; docker compose logs router prefill decode --since 10m",
        evidence, [t.request_id for t in failed])]
