"""The summary when nothing is wrong: how many requests went router → prefill → KV → decode."""

from __future__ import annotations

from doctor.findings import Context, Finding, finding


def check(ctx: Context) -> list[Finding]:
    complete = [t for t in ctx.timelines.values() if t.complete]
    pd = [t for t in complete if not t.colocated]
    colocated = len(complete) - len(pd)
    if not ctx.timelines:
        title = f"healthy: no requests in the logs ({', '.join(sorted(ctx.services_seen())) or 'no service'} logged)"
    else:
        title = f"healthy: {len(pd)} requests went router → prefill → KV → decode"
        if colocated:
            title += f", {colocated} router → engine (colocated)"
    return [finding("healthy", "ok", title, "No diagnosis found a problem in the logs or the client configuration.",
                    "nothing to fix", request_ids=[t.request_id for t in complete[:20]])]
