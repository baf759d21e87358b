"""An engine refuses the router's internal key: its key (vLLM: VLLM_API_KEY / --api-key; ours: PD_INTERNAL_KEY) is not
the router's PD_INTERNAL_KEY, so every leg gets 401/403 and the router answers the client 502 internal_key_rejected.

Both sides' evidence: the router's `router.upstream_error` (the engine's status and body) and what it answered, and
the engine's own refusal — vLLM's access line (`"POST /v1/chat/completions HTTP/1.1" 401`), our engine's
`internal_auth.rejected`.
"""

from __future__ import annotations

from doctor import engine_facts
from doctor.engine_lines import VLLM
from doctor.findings import Context, Finding, finding
from stack.common import events

REFUSED = (401, 403)


def check(ctx: Context) -> list[Finding]:
    router = [r for r in ctx.by_event(events.ROUTER_UPSTREAM_ERROR)
              if r.service == "router" and r[events.STATUS] in REFUSED]
    if not router:
        return []
    roles = sorted({r[events.ROLE] or "?" for r in router})
    engines = [r for r in ctx.records if r.service in roles and (
        (r.event == VLLM + "access" and r.data.get("status") in REFUSED and r.data.get("path", "").startswith("/v1"))
        or r.event == events.INTERNAL_AUTH_REJECTED)]
    answered = [r for r in ctx.by_event(events.ROUTER_REQUEST_DONE) if r.request_id in {x.request_id for x in router}]
    ids = [r.request_id for r in router]
    asked = {r.data.get("client_request_id") for r in router} - {None}
    client = [r for r in ctx.client if r.request_id in asked]
    kinds = {role: engine_facts.kind_of(ctx, role) for role in roles}
    return [finding(
        "auth.internal_key_mismatch", "error",
        f"The {' and '.join(roles)} engine(s) refuse the router's internal key (HTTP "
        f"{'/'.join(str(s) for s in sorted({r[events.STATUS] for r in router}))}): "
        f"{len(set(ids))} request(s) failed with 502",
        "The router sends its PD_INTERNAL_KEY as `Authorization: Bearer …` on every engine request; the engine holds "
        "another key, so it refuses every leg. Not the client's key: the router accepted the client, the engine "
        "refused the router. " + (f"The engine's own refusal: {len(engines)} line(s)." if engines else
                                  "The engine logs no line per refusal (run it with its access log to see them)."),
        _fix(ctx, kinds), client[:1] + router[:3] + answered[:1] + engines[:3], ids)]


def _fix(ctx: Context, kinds: dict[str, str]) -> str:
    compare = "compare fingerprints, never the keys: printf %s \"$PD_INTERNAL_KEY\" | sha256sum | cut -c1-12 on both sides"
    parts = []
    for role, kind in kinds.items():
        if kind == "vllm":
            parts.append(f"start the {role} vLLM with VLLM_API_KEY (or --api-key) equal to the router's PD_INTERNAL_KEY")
        else:
            parts.append(f"give the {role} engine the router's PD_INTERNAL_KEY")
    restart = "docker compose up -d router prefill decode" if engine_facts.compose(ctx) else "restart the engines"
    return f"{'; '.join(parts)} ({compare}); {restart}"
