"""Real vLLM / NIXL / UCX / SGLang / Mooncake / NCCL failure strings in the engines' logs (doctor/signatures.py).

Every failure signature seen becomes its own finding (id = the signature's id), with the lines that
show it, the upstream cause and fix, and the source the exact string was taken from.
"""

from __future__ import annotations

from doctor.findings import Context, Finding, finding
from doctor.parse import UPSTREAM
from doctor.signatures import SIGNATURES


def check(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    for sig in SIGNATURES:
        if sig.proof or sig.fact:
            continue
        seen = ctx.by_event(UPSTREAM + sig.id)
        if not seen:
            continue
        where = ", ".join(sorted({r.service for r in seen}))
        out.append(finding(
            sig.id, sig.severity, f"{sig.title} ({len(seen)} line(s) from {where})",
            f"{sig.cause} (string from {sig.source})", sig.fix, seen,
            [r.request_id for r in seen]))
    return out


def proofs(ctx: Context) -> list:
    """vLLM's own lines saying KV moved (KV Transfer metrics with successful transfers > 0)."""
    return [r for sig in SIGNATURES if sig.proof for r in ctx.by_event(UPSTREAM + sig.id)]
