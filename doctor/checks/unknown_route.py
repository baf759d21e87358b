"""404s for paths the router does not serve: a client base URL with /v1 twice or without it, or a route it lacks.

A client builds each request's URL from its base URL: the OpenAI SDKs and Codex append `/chat/completions` (so
their base URL must end in /v1), the Anthropic SDK and Claude Code append `/v1/messages` (so theirs must not).
Get it wrong and every request of that client is a 404 for `/v1/v1/messages` or `/chat/completions`, which the
router logs as aiohttp's own 404: `http.bad_request` status 404 with no code and the message "Not Found: METHOD
PATH" (the error middleware's). Claude Code's probe of the same base URL asks for /v1/api/hello. A 404 the API
answers itself carries a code (`model_not_found`: model_name.py).
"""

from __future__ import annotations

import re
from collections import Counter

from doctor.findings import Context, Finding, finding
from doctor.parse import Record
from stack.common import events

_NOT_FOUND = re.compile(r"^Not Found: (\S+) (\S+)")
# What clients append to a base URL that should have ended in /v1.
_API_TAILS = ("/chat/completions", "/completions", "/messages", "/messages/count_tokens", "/responses", "/models")
# Claude Code's connection probe (/api/hello) under a base URL ending in /v1: the same mistake as /v1/v1/messages.
_PROBE_UNDER_V1 = "/v1/api/hello"
_SERVED = "/v1/chat/completions, /v1/completions, /v1/messages, /v1/responses, /v1/models"
# Each kind of 404: (finding id, severity, "a path …", cause, fix).
_KINDS = {
    "twice": ("route.base_url_v1_twice", "error", "with /v1 twice",
              "The client's base URL ends in /v1 and the client appends /v1/… itself: the Anthropic SDK and Claude Code "
              "add /v1/messages to ANTHROPIC_BASE_URL.",
              "ANTHROPIC_BASE_URL=http://<router>:8080 (no /v1) for Claude Code and the Anthropic SDK, in the shell or "
              "in ~/.claude/settings.json's env block; OpenAI clients keep /v1 (OPENAI_BASE_URL=http://<router>:8080/v1)"),
    "short": ("route.base_url_no_v1", "error", "without /v1",
              "The client's base URL lacks /v1: the OpenAI SDKs and Codex append /chat/completions (or /responses, "
              "/models) to it.",
              "OPENAI_BASE_URL=http://<router>:8080/v1 (or base_url=… in the client); Claude Code and the Anthropic SDK "
              "take the URL without /v1"),
    "other": ("route.not_found", "warning", "that the router does not serve",
              f"The client called a path this router does not serve; it serves {_SERVED} (and /health, /metrics, "
              "/v1/usage, /api/hello).",
              "point the client at one of those routes"),
}


def check(ctx: Context) -> list[Finding]:
    kinds: dict[str, list[tuple[Record, str]]] = {}
    for record in ctx.by_event(events.HTTP_BAD_REQUEST):
        match = _NOT_FOUND.match(record.msg)
        if record.service != "router" or record[events.STATUS] != 404 or record[events.CODE] or match is None:
            continue
        route, path = f"{match.group(1)} {match.group(2)}", match.group(2)
        twice = path.startswith("/v1/v1/") or path == _PROBE_UNDER_V1
        kind = "twice" if twice else "short" if path in _API_TAILS else "other"
        kinds.setdefault(kind, []).append((record, route))
    out = []
    for kind, (fid, severity, which, cause, fix) in _KINDS.items():
        hits = kinds.get(kind)
        if hits:
            routes = Counter(route for _, route in hits)
            named = ", ".join(f"{route} ×{n}" for route, n in routes.most_common(4))
            out.append(finding(fid, severity, f"{len(hits)} request(s) got 404 for a path {which} ({named})", cause, fix,
                               [r for r, _ in hits[:3]], [r.request_id for r, _ in hits]))
    return out

