"""The diagnoses: one module each with a pure `check(ctx) -> list[Finding]`, and the registry that runs them.

A new diagnosis is its module plus one `Check` line in `REGISTRY` (the order reports are printed in,
router side first). `healthy` and `stalled` are not in it: they are decided after the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from doctor.checks import auth_401, choices_parse, healthy, kv_transfer, local_proxy, oauth, p2pnccl, stalled
from doctor.findings import Context, Finding


@dataclass(frozen=True)
class Check:
    id: str
    summary: str
    run: Callable[[Context], list[Finding]]


REGISTRY: tuple[Check, ...] = (
    Check("auth", "401s, missing router key, quota vs rate limit", auth_401.check),
    Check("local_proxy", "client cannot reach the router (proxy variables, base URL, router down)", local_proxy.check),
    Check("oauth", "Claude Code / Codex configured for OAuth instead of the router key", oauth.check),
    Check("choices", "error bodies, failed decodes, empty choices, streams without [DONE]", choices_parse.check),
    Check("kv_transfer", "KV port mismatch, unreachable KV port, buffer too small, timeouts, model mismatch",
          kv_transfer.check),
    Check("p2pnccl", "vLLM P2pNccl engines not registered with the router, dropped, or pinging another format",
          p2pnccl.check),
)
STALLED = "stalled"  # the id `--check` selects the stalled-request diagnosis by


def run_checks(ctx: Context, only: Iterable[str] = ()) -> list[Finding]:
    """Run the registered checks; add stalled requests nobody explained; say healthy when clean."""
    wanted = set(only)
    results: list[Finding] = []
    for check in REGISTRY:
        if not wanted or check.id in wanted:
            results.extend(check.run(ctx))
    if not wanted or STALLED in wanted:
        explained = {rid for f in results for rid in f.request_ids}
        results.extend(stalled.check(ctx, explained))
    if not any(f.severity != "ok" for f in results):
        results.extend(healthy.check(ctx))
    return results
