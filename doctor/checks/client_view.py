"""The client's real view: requests that never left the client, and credential variables that conflict.

Never left the client: httpx/h11 refuse a header value with whitespace or control bytes
(`Illegal header value b'Bearer sk-… '`, then the SDK's `Connection error.`), or the router's host
name does not resolve. The router cannot have seen these, so they are not "router rejected it".

Credential precedence, as each client really applies it:
- anthropic-python (2.14.0, anthropic/_client.py `static_credential_from_env`): ANTHROPIC_API_KEY wins
  over ANTHROPIC_AUTH_TOKEN ("If both … are set, the API key is used"); both are sent as
  `Authorization: Bearer` in 2.x (`_api_key_auth` / `_bearer_auth`); 0.x sent the API key as `X-Api-Key`.
- Claude Code (code.claude.com docs: llm-gateway, settings, iam; ../shared/reference/gateways.md B1):
  ANTHROPIC_AUTH_TOKEN (`Authorization: Bearer`) before ANTHROPIC_API_KEY (`X-Api-Key`), then
  apiKeyHelper; its settings.json `env` block wins over the shell.
- openai-python (openai/_client.py): api_key= else OPENAI_API_KEY, base_url= else OPENAI_BASE_URL,
  sent as `Authorization: Bearer`. Codex: the provider's env_key in ~/.codex/config.toml.
So with both Anthropic variables set to different values, the SDK and Claude Code send different keys.
"""

from __future__ import annotations

from doctor.findings import Context, Finding, finding
from stack.common import events

SDK_CHOICE = "ANTHROPIC_API_KEY"  # anthropic-python: the API key wins
CLAUDE_CODE_CHOICE = "ANTHROPIC_AUTH_TOKEN"  # Claude Code: the token wins


def check(ctx: Context) -> list[Finding]:
    return _never_sent(ctx) + _conflict(ctx)


def never_left(ctx: Context) -> bool:
    return bool(ctx.client_kinds("header_refused", "dns_failed"))


def _never_sent(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    refused = ctx.client_kinds("header_refused")
    if refused:
        after = ctx.client_kinds("connect_failed")[:1]
        dirty = [n for n in ("TAOTOKEN_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN")
                 if (v := ctx.env.client_env(n)) and v != v.strip()]
        out.append(finding(
            "client.header_refused", "error",
            "The request never left the client: the SDK refused to send the key's header",
            "httpx (h11) refuses a header value with leading/trailing whitespace or a control character "
            "('Illegal header value'), before connecting; the SDK then reports 'Connection error.'. The router "
            "never saw the request, so it logged nothing and answered nothing (no 401)."
            + (f" Variable(s) with whitespace: {', '.join(dirty)}." if dirty else ""),
            "; ".join(f"export {n}=\"$(printf %s \"${n}\" | tr -d '[:space:]')\"" for n in dirty or ["TAOTOKEN_API_KEY"])
            + "  (a key read with $(cat file) keeps its newline)",
            refused + after))
    dns = ctx.client_kinds("dns_failed")
    if dns:
        out.append(finding(
            "client.dns_failed", "error", f"The request never left the client: {ctx.env.router_host} does not resolve",
            "The client could not resolve the router's host name; nothing reached the router.",
            f"use a name the client's machine resolves (e.g. http://localhost:{ctx.env.router_port}); service names "
            "like router or prefill resolve only inside the compose networks", dns))
    return out


def conflict_values(ctx: Context) -> tuple[str, str] | None:
    """(token, api key) when both Anthropic variables are set to different values, as Claude Code sees them."""
    token, api_key = ctx.env.client_env("ANTHROPIC_AUTH_TOKEN"), ctx.env.client_env("ANTHROPIC_API_KEY")
    if token and api_key and token.strip() != api_key.strip():
        return token, api_key
    return None


def _conflict(ctx: Context) -> list[Finding]:
    values = conflict_values(ctx)
    if values is None:
        return []
    token, api_key = values
    router_key = ctx.env.env.get("TAOTOKEN_API_KEY")
    right = ("ANTHROPIC_AUTH_TOKEN" if router_key == token else "ANTHROPIC_API_KEY" if router_key == api_key
             else None) if router_key else None
    rejected = [r for r in ctx.by_event(events.AUTH_REJECTED) if r[events.REASON] == "unknown"]
    client_401 = ctx.client_kinds("auth_401")
    failing = bool(rejected or client_401)
    cause = ("ANTHROPIC_AUTH_TOKEN and ANTHROPIC_API_KEY are both set, to different keys. The anthropic SDK sends "
             "ANTHROPIC_API_KEY (it wins over the token: anthropic/_client.py static_credential_from_env), Claude Code "
             "sends ANTHROPIC_AUTH_TOKEN (code.claude.com llm-gateway docs), so the two clients present different keys.")
    if right:
        cause += f" Only {right} equals $TAOTOKEN_API_KEY (the router key in this shell)."
    if rejected:
        headers = sorted({r[events.HEADER] or "?" for r in rejected})
        cause += (f" The router rejected {len(rejected)} request(s) with 401 unknown key (header {', '.join(headers)}): "
                  "that is the client sending the other variable.")
    wrong = {"ANTHROPIC_AUTH_TOKEN": "ANTHROPIC_API_KEY", "ANTHROPIC_API_KEY": "ANTHROPIC_AUTH_TOKEN"}.get(right or "")
    fix = (f"unset {wrong} (keep {right})" if right else
           'set one only: unset ANTHROPIC_API_KEY; export ANTHROPIC_AUTH_TOKEN="$TAOTOKEN_API_KEY"')
    return [finding("client.auth_conflict", "error" if failing else "warning",
                    "ANTHROPIC_API_KEY and ANTHROPIC_AUTH_TOKEN differ: the SDK and Claude Code send different keys"
                    + (" — the router rejected the other one with 401" if failing else ""),
                    cause, fix, client_401[:2] + rejected[:3], [r.request_id for r in rejected])]
