"""401s and limits: no/malformed/unknown key, the router started without its key, quota vs rate limit.

Relies on router events auth.key_missing (start-up), auth.rejected (reason, header),
limit.quota_exhausted (used, quota), limit.rate_limited (limit, current, maximum) and on client
401 lines (`Error code: 401`, `API Error: 401`, `unexpected status 401`).
"""

from __future__ import annotations

from collections import Counter

from doctor.checks.client_view import conflict_values, never_left
from doctor.findings import Context, Finding, finding
from stack.common import events

DEFAULT_KEY_ENV = "TAOTOKEN_API_KEY"
CLIENT_KEY_VARS = ("TAOTOKEN_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN")


def key_env_name(ctx: Context) -> str:
    for r in ctx.by_event(events.AUTH_KEY_MISSING):
        if r[events.ENV_VAR]:
            return r[events.ENV_VAR]
    return DEFAULT_KEY_ENV


def check(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    rejected: dict[str, list] = {}
    for r in ctx.by_event(events.AUTH_REJECTED):
        rejected.setdefault(r[events.REASON] or "unknown", []).append(r)
    key_var = key_env_name(ctx)

    missing_key = ctx.by_event(events.AUTH_KEY_MISSING) + rejected.pop("no_keys_configured", [])
    if missing_key:
        out.append(finding(
            "auth.router_key_missing", "error",
            f"The router started without its key: ${key_var} is not set inside the router container",
            f"The router reads its unified key from the environment variable {key_var} at start; it was unset or "
            "empty in the container, so every request is rejected with 401. Usually the variable is missing "
            "from .env next to compose.yaml, or the stack was started before it was added.",
            f"echo '{key_var}=<your key>' >> .env && docker compose up -d router\n"
            f"check: docker compose exec router sh -c 'test -n \"${key_var}\" && echo set || echo MISSING'",
            missing_key, [r.request_id for r in missing_key]))

    texts = {
        "missing": ("auth.no_header", "Requests without an Authorization header",
                    "The client sent no `Authorization: Bearer …` (nor `x-api-key`), so the router answered 401.",
                    f"curl -H \"Authorization: Bearer ${key_var}\" …  (OpenAI SDK: api_key=os.environ['{key_var}']; "
                    "Claude Code: ANTHROPIC_AUTH_TOKEN)"),
        "malformed": ("auth.malformed_header", "Malformed Authorization header (no `Bearer `, quotes or junk)",
                      "The header is not `Authorization: Bearer <key>`: the `Bearer ` prefix is missing or the key "
                      "is wrapped in quotes (often copied from .env with its quotes).",
                      f"send exactly: Authorization: Bearer ${key_var}  (no quotes); strip quotes in .env: "
                      f"{key_var}=sk-…"),
        "quoted": ("auth.key_quoted", "The key is wrapped in quotes",
                   "The key arrived with literal quotes around it — a .env or shell value like "
                   "KEY='\"sk-…\"' keeps them — so it matches no key.",
                   f"remove the quotes: {key_var}=sk-… in .env; send Authorization: Bearer ${key_var}"),
        "whitespace": ("auth.key_whitespace", "The key has stray whitespace (a trailing newline or space)",
                       "The key in the header has leading/trailing whitespace — typical of `$(cat key.txt)` or a "
                       "copy-paste with a newline — so it matches no key.",
                       f"export {key_var}=\"$(printf %s \"${key_var}\" | tr -d '[:space:]')\""),
        "unknown": ("auth.unknown_key", "The key is not the router's key",
                    f"The client sent a well-formed key that matches none the router holds: the client uses a "
                    f"different (old, other environment) key than the router's {key_var}.",
                    f"compare fingerprints: printf %s \"${key_var}\" | sha256sum | cut -c1-12  vs  docker compose "
                    f"exec router sh -c 'printf %s \"${key_var}\" | sha256sum | cut -c1-12'"),
    }
    if conflict_values(ctx) is not None:  # client.auth_conflict names which variable was sent and why
        rejected.pop("unknown", None)
    for reason, group in rejected.items():
        fid, title, cause, fix = texts.get(reason, texts["unknown"])
        headers = Counter(r[events.HEADER] or "?" for r in group)
        title = f"{title} — {len(group)} request(s) rejected with 401"
        if reason not in texts:
            cause = f"The router rejected the key (reason {reason!r}). " + cause
        cause += f" Header(s) seen: {', '.join(f'{h} ×{n}' for h, n in headers.items())}."
        related = _with_client_lines(ctx, group, "auth_401")
        out.append(finding(fid, "error", title, cause, fix, related, [r.request_id for r in group]))

    quota = ctx.by_event(events.LIMIT_QUOTA)
    if quota:
        last = quota[-1]
        out.append(finding(
            "limit.quota_exhausted", "error",
            f"Token quota exhausted for key {_known(last[events.KEY_NAME])} ({_known(last[events.USED])} of "
            f"{_known(last[events.QUOTA])} tokens used)",
            "The key's token quota is used up: the router answers 429 `insufficient_quota` until the quota is "
            "raised or reset. Waiting does not help (unlike a rate limit).",
            "see the key's usage and quota: curl -H \"Authorization: Bearer $TAOTOKEN_API_KEY\" "
            f"{ctx.env.router_url}/v1/usage; raise token_quota in the key's entry of its keys file ([auth] keys_file "
            "in router/settings.toml names it; see router/keys.example.toml), or [limits] token_quota in "
            "router/settings.toml for keys without their own, then docker compose up -d router",
            quota, [r.request_id for r in quota]))
    rate = ctx.by_event(events.LIMIT_RATE)
    if rate:
        kinds = Counter(r[events.LIMIT] or "?" for r in rate)
        last = rate[-1]
        out.append(finding(
            "limit.rate_limited", "warning",
            f"Rate limited {len(rate)} time(s) ({', '.join(f'{k} ×{n}' for k, n in kinds.items())}; last "
            f"{_known(last[events.CURRENT])}/{_known(last[events.MAXIMUM])})",
            "The key exceeded a per-key rate or concurrency limit: a 429 `rate_limit_exceeded` that clears by "
            "itself (not the quota).",
            "retry with backoff (the SDKs do), lower the client's concurrency, or raise the limit ([limits] in "
            "router/settings.toml, or the key's entry in its keys file)",
            rate, [r.request_id for r in rate]))

    out.extend(_client_401_elsewhere(ctx))
    out.extend(_dirty_keys(ctx))
    return out


def _known(value: object) -> str:
    return "?" if value is None else str(value)


def _with_client_lines(ctx: Context, group: list, kind: str) -> list:
    ids = {r.request_id for r in group}
    extra = [r for rid in ids if rid in ctx.timelines for r in ctx.timelines[rid].records
             if r.event in (events.HTTP_ACCESS, events.ROUTER_REQUEST_DONE)]
    return ctx.client_kinds(kind)[:2] + group + extra


def _client_401_elsewhere(ctx: Context) -> list[Finding]:
    """A client got 401 but the router rejected nothing: the request went somewhere else."""
    # a 502 naming the engine's 401 (internal_key_rejected) is not a 401 the client got
    client = [r for r in ctx.client_kinds("auth_401") if r.data.get("status") in (None, 401)]
    router_lines = [r for r in ctx.records if r.service == "router"]
    if not client or not router_lines or ctx.by_event(events.AUTH_REJECTED, events.AUTH_KEY_MISSING):
        return []
    return [finding(
        "auth.not_from_router", "error",
        "The client got a 401 that the router never sent",
        "The router logged no rejected request, so the 401 came from another server: the client's base URL "
        "or a proxy variable sends it elsewhere (an official API, a local proxy).",
        f"point the client at the router ({ctx.env.router_url}/v1 for OpenAI clients, {ctx.env.router_url} for "
        "Claude Code) and see the local_proxy findings",
        client + router_lines[-1:])]


def _dirty_keys(ctx: Context) -> list[Finding]:
    """Keys in the client environment with whitespace or quotes (names only, never values)."""
    if never_left(ctx):  # client.header_refused says it: the SDK refused to send it, the router never saw it
        return []
    bad = [name for name in CLIENT_KEY_VARS
           if (value := ctx.env.client_env(name)) and (value != value.strip() or value[:1] in "\"'"
                                                        or value[-1:] in "\"'" or " " in value)]
    if not bad:
        return []
    return [finding(
        "auth.key_not_clean", "warning",
        f"Key variable(s) with whitespace or quotes: {', '.join(bad)}",
        "A key with a trailing newline, a space or literal quotes is sent as-is and the router rejects it (401).",
        "; ".join(f"export {n}=\"$(printf %s \"${n}\" | tr -d '[:space:]\\\"\\047')\"" for n in bad))]
