"""The summary when nothing is wrong: how many requests went router → prefill → KV → decode, and how many did not.

"healthy" needs requests that completed; a window with no request at all is "quiet" (ok, exit 0).
"""

from __future__ import annotations

from doctor.findings import Context, Finding, finding


def check(ctx: Context) -> list[Finding]:
    complete = [t for t in ctx.timelines.values() if t.complete]
    pd = [t for t in complete if not t.colocated]
    colocated = len(complete) - len(pd)
    if not complete:
        states = (ctx.docker or {}).get("services") or {}
        seen = ", ".join(f"{s} {state}" for s, state in sorted(states.items())) or \
            ", ".join(sorted(ctx.services_seen())) or "no service"
        return [finding("quiet", "ok", f"quiet: no completed request in the window ({seen})",
                        "No request finished in the logs read, and nothing failed; send one to test the path "
                        "(python -m doctor verify).", "nothing to fix")]
    title = f"healthy: {len(pd)} requests went router → prefill → KV → decode"
    if colocated:
        title += f", {colocated} router → engine (colocated)"
    others = len(ctx.timelines) - len(complete)
    if others:
        title += f"; {others} did not complete"
    return [finding("healthy", "ok", title, "No diagnosis found a problem in the logs or the client configuration.",
                    "nothing to fix", request_ids=[t.request_id for t in complete[:20]])]
