"""Real vLLM / NIXL / UCX / SGLang / Mooncake / NCCL failure strings in the engines' logs (doctor/signatures.py).

Every failure signature seen becomes its own finding (id = the signature's id), with the lines that
show it, the upstream cause and fix, and the source the exact string was taken from.
"""

from __future__ import annotations

from doctor.checks import nixl_lease_wait
from doctor.findings import Context, Finding, finding
from doctor.parse import UPSTREAM
from doctor.signatures import SIGNATURES
from stack.common import events

# What the router logs for the same cause: vLLM's lines carry no request id, the router's name the requests it failed.
_ROUTER_SIDE = {"vllm.no_kv_connector": "returned no kv_transfer_params"}


def check(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    # Requests whose prefill token ended them: their blocks wait out the lease by design (vLLM keeps FINISHED_STOPPED
    # blocks for a decode that the router rightly never sends). vLLM names them chatcmpl-<X-Request-ID>-<8 hex>.
    finished = {r.request_id for r in ctx.by_event(events.ROUTER_PREFILL_FINISHED)}
    lease_wait = {r.line for pair in nixl_lease_wait.stalled_pairs(ctx) for r in pair[:2]}
    for sig in SIGNATURES:
        if sig.proof or sig.fact:
            continue
        seen = ctx.by_event(UPSTREAM + sig.id)
        if sig.id == "kv.stranded_on_prefill" and finished:
            seen = [r for r in seen if not any(f"-{rid}-" in r.line for rid in finished)]
        seen = [r for r in seen if r.line not in lease_wait]  # its own finding: a longer lease is not the fix
        if not seen:
            continue
        where = ", ".join(sorted({r.service for r in seen}))
        router = [r for r in ctx.by_event(events.ROUTER_PREFILL_FAILED)
                  if sig.id in _ROUTER_SIDE and _ROUTER_SIDE[sig.id] in (r[events.ERROR] or "")]
        out.append(finding(
            sig.id, sig.severity, f"{sig.title} ({len(seen)} line(s) from {where})",
            f"{sig.cause} (string from {sig.source})", sig.fix, seen + router[:3],
            [r.request_id for r in seen + router]))
    return out


def proofs(ctx: Context) -> list:
    """vLLM's own lines saying KV moved (KV Transfer metrics with successful transfers > 0)."""
    return [r for sig in SIGNATURES if sig.proof for r in ctx.by_event(UPSTREAM + sig.id)]
