"""A backend that is gone: the router answers 503 no_prefill_backend / no_decode_backend.

Relies on the router's http.error (code no_prefill_backend | no_decode_backend), backend.health
(state down, with its reason), discovery.left (a replica of a discover pool that stopped resolving)
and, when read live, the container's state (exited, OOM-killed, exit code).
The vLLM P2pNccl registry mode has its own diagnosis (p2pnccl).
"""

from __future__ import annotations

from doctor import engine_facts
from doctor.findings import Context, Finding, finding
from stack.common import events


def check(ctx: Context) -> list[Finding]:
    registry = any(r[events.VALUE] == "(registry)" for r in ctx.by_event(events.CONFIG_IGNORED) if r.service == "router")
    if registry or ctx.by_event(events.P2PNCCL_JOINED):
        return []
    out: list[Finding] = []
    refused = [r for r in ctx.by_event(events.HTTP_ERROR) if r.service == "router"
               and r[events.CODE] in ("no_prefill_backend", "no_decode_backend")]
    for role in ("prefill", "decode"):
        failed = [r for r in refused if r[events.CODE] == f"no_{role}_backend"]
        if not failed:
            continue
        down = [r for r in ctx.by_event(events.BACKEND_HEALTH) if r[events.ROLE] == role and r[events.STATE] == "down"]
        # A discover pool (replicas.py): a replica that stopped no longer resolves and leaves the pool.
        left = [r for r in ctx.by_event(events.DISCOVERY_LEFT) if r[events.ROLE] == role]
        state = (ctx.docker or {}).get("services", {}).get(role)
        exit_info = (ctx.docker or {}).get("exits", {}).get(role) or {}
        last = [r for r in ctx.records if r.service == role][-2:]
        container = ""
        if state:
            container = f" Its container is {state}"
            if exit_info.get("oom"):
                container += " (OOM-killed)"
            elif exit_info.get("exit_code") not in (None, 0):
                container += f" (exit code {exit_info['exit_code']})"
            container += "."
        reasons = sorted({r[events.REASON] or "?" for r in down})
        # Back up after the last refusal: it was down, it is not now (the router's own health line says so).
        back = [r for r in ctx.by_event(events.BACKEND_HEALTH) if r[events.ROLE] == role and r[events.STATE] == "up"
                and r.ts > failed[-1].ts]
        since = (down[0] if down else failed[0]).ts
        headline = f"The {role} backend was down from {since} to {back[0].ts}" if back else f"No {role} backend is up"
        out.append(finding(
            f"backend.{role}_down", "error",
            f"{headline}: {len(failed)} request(s) got 503 no_{role}_backend",
            f"The router has no healthy {role} engine to send requests to"
            + (f"; it marked it down ({', '.join(reasons)})" if down else "")
            + (f"; {len(left)} replica(s) left the pool (no longer found under {left[-1][events.DISCOVER]}, "
               f"{left[-1][events.REPLICAS]} left)" if left else "") + "." + container
            + (" Exit code 137 / OOM-killed means the kernel killed it for memory." if exit_info.get("oom") or
               exit_info.get("exit_code") == 137 else ""),
            (f"docker compose ps {role}; docker compose logs {role} --tail 50; then docker compose up -d {role} "
             "(if it was OOM-killed: a smaller checkpoint or more memory for the container)") if engine_facts.compose(ctx)
            else f"curl {', '.join(_urls(refused, role)) or f'<the {role} URL>'}/health; read the {role} engine's log "
                 f"(its last lines say why it stopped); start it again",
            failed[:3] + down[:2] + left[-2:] + back[:1] + last, [r.request_id for r in failed]))
    return out


def _urls(refused: list, role: str) -> list[str]:
    """The backends the router named as down in its 503s ("down: http://…")."""
    return sorted({url.rstrip(")") for r in refused if r[events.CODE] == f"no_{role}_backend"
                   for url in r.msg.split() if url.startswith("http")})
