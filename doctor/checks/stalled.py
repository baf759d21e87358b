"""Requests that stopped at a hop (router → prefill → KV → decode) that no other diagnosis explained.

The article's own symptom: "only prefill has log lines, decode is silent — usually the KV port".
"""

from __future__ import annotations

from collections import Counter

from doctor.findings import Context, Finding, finding

NEXT = {"router": "prefill", "prefill": "the KV transfer", "kv": "decode", "decode": "the answer"}


def check(ctx: Context, explained: set[str]) -> list[Finding]:
    stopped = [t for t in ctx.timelines.values()
               if t.request_id not in explained and t.stopped_at is not None and (t.status or 0) < 400
               and "router" in t.reached]
    if not stopped:
        return []
    by_hop = Counter(t.stopped_at for t in stopped)
    evidence = [t.records[-1] for t in stopped[:4]]
    hop, n = by_hop.most_common(1)[0]
    return [finding(
        "request.stopped", "warning",
        f"{len(stopped)} request(s) stopped before completing ("
        + ", ".join(f"at {h} ×{c}" for h, c in by_hop.items()) + ")",
        f"Most stopped at {hop} and never reached {NEXT.get(hop, 'the next hop')}; no error line says why. They "
        "may still be running, or a service's logs were not collected.",
        "python -m doctor diagnose --request-id <id> -v; docker compose logs prefill decode --since 10m",
        evidence, [t.request_id for t in stopped])]
