"""Requests refused for what the client sent: which field, how many, what the router said, and the fix.

The router checks a body against its API's contract before any engine sees it (stack/protocol/) and answers a 4xx
in the API's own shape: a body that is not JSON (`invalid_json`: the message says where it breaks; `NaN` and
`Infinity` are not JSON), a required field missing, a field of the wrong type or value, a parameter the API or the
served backend does not take, a body past the size limit (413), one that never arrived whole (408), an encoding it
does not read (415). Each is logged as the router's `http.bad_request` with its code and the field (`param`).

An engine can refuse a request the contract let through (a value only the engine checks); the router passes that on
as the client's 400 only when prefill and decode agree, and logs the engine's body as `router.upstream_error`. Those
are a finding of their own, a generic one: a diagnosis that knows the engine's words (tool calling off, a window too
small) explains them first. Codes other diagnoses own (model_not_found, context_length_exceeded, a 404 route) are
left to them.
"""

from __future__ import annotations

from collections import Counter

from doctor.findings import Context, Finding, finding
from doctor.parse import Record
from stack.common import events

# The statuses of a request refused for its own content (not auth 401/403, not limits 429: auth_401 has those).
_REFUSED = frozenset({400, 408, 413, 415, 422})
# Codes another diagnosis names with a more specific cause and fix.
_OWNED = frozenset({"model_not_found", "context_length_exceeded"})
# What to do about each code: the client's side first, the router's setting where one moves the line.
_FIX = {
    "invalid_json": "send the body as one UTF-8 JSON object (Content-Type: application/json); the message says where it "
                    "breaks. NaN, Infinity and numbers past a double are not JSON (RFC 8259): send null or a finite value",
    "json_too_deep": "flatten the body: it nests deeper than the router reads (stack/common/safe_json.py MAX_DEPTH)",
    "json_number_too_long": "send the number as a string or with fewer digits (stack/common/safe_json.py)",
    "request_too_large": "shorten the conversation (Claude Code: /compact), or raise max_body_bytes in "
                         "router/settings.toml [server] and docker compose up -d router",
    "body_timeout": "the client (or a proxy between) announced a body and stopped sending it: check the client's "
                    "network and proxy; body_timeout_ms in router/settings.toml [server] bounds the wait",
    "unsupported_content_encoding": "send the body uncompressed (no Content-Encoding)",
}
_FIX_FIELD = ("correct the field the message names in the client's request ({fields}); docs/gateway.md lists what "
              "each API takes and what the backend serving it can do")


def check(ctx: Context) -> list[Finding]:
    engine_refused = {r.request_id for r in ctx.by_event(events.ROUTER_UPSTREAM_ERROR)
                      if 400 <= (r[events.STATUS] or 0) < 500}
    refused = list({r.request_id: r for r in ctx.by_event(events.HTTP_BAD_REQUEST)
                    if r.service == "router" and r[events.STATUS] in _REFUSED and r[events.CODE] not in _OWNED
                    and r.request_id not in ("", "-")}.values())
    out = []
    by_router = [r for r in refused if r.request_id not in engine_refused]
    if by_router:
        out.append(_finding(ctx, "client_request.refused", by_router,
                            "the router refused {n} request(s) for what the client sent ({kinds})",
                            "The router checked each body against its API before any engine saw it and answered a 4xx "
                            "in the API's shape; the stack is working, the client's request is not what the API takes. "
                            "The router's words for the first: {first}"))
    by_engine = [r for r in refused if r.request_id in engine_refused]
    if by_engine:
        out.append(_finding(ctx, "client_request.engine_refused", by_engine,
                            "the engines refused {n} request(s) the router's checks let through ({kinds})",
                            "Prefill and decode both refused the request with a 4xx and the router passed their answer "
                            "on as the client's error (router.upstream_error holds the engine's body). A value only the "
                            "engine checks, or a limit of the engine's configuration. The router's words for the first: "
                            "{first}"))
    return out


def _finding(ctx: Context, fid: str, refused: list[Record], title: str, cause: str) -> Finding:
    kinds = Counter((r[events.CODE] or str(r[events.STATUS]), r.data.get("param")) for r in refused)
    named = ", ".join(f"{code}{f' ({param})' if param else ''} ×{n}" for (code, param), n in kinds.most_common(4))
    codes = list(dict.fromkeys(code for code, _ in kinds))
    fields = ", ".join(dict.fromkeys(str(p) for _, p in kinds if p)) or "see the message"
    fixes = list(dict.fromkeys(_FIX.get(code, _FIX_FIELD.format(fields=fields)) for code in codes))
    shown = {r.request_id for r in refused[:2]}  # the engine's body for the first of them
    evidence = refused[:3] + [r for r in ctx.by_event(events.ROUTER_UPSTREAM_ERROR) if r.request_id in shown]
    # nothing got through in the window: the client cannot work as it is, whoever is at fault
    return finding(fid, "error" if ctx.nothing_completed else "warning", title.format(n=len(refused), kinds=named),
                   cause.format(first=refused[0].msg), "; ".join(fixes), evidence, [r.request_id for r in refused])
