"""Claude Code / Codex configured for OAuth (subscription / ChatGPT login) instead of the router key.

Reads ~/.claude/settings.json (env block), ~/.claude/.credentials.json (an OAuth login), the
ANTHROPIC_* variables, ~/.codex/auth.json (API-key vs ChatGPT mode) and ~/.codex/config.toml
(model_provider → base_url / env_key / wire_api), plus pasted client lines: "OAuth token has
expired", `invalid_grant`, "Could not resolve authentication method", "Auth conflict", Codex
"Missing environment variable", the removed `wire_api = "chat"`. Fixes name variables, never values.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from doctor.findings import Context, Finding, finding

KEY_VAR = "TAOTOKEN_API_KEY"


def points_at_router(ctx: Context, url: str | None) -> bool:
    if not url:
        return False
    parts, router = urlsplit(url), urlsplit(ctx.env.router_url)
    local = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}
    same_host = parts.hostname == router.hostname or {parts.hostname, router.hostname} <= local
    return same_host and (parts.port or 80) == (router.port or 80)


def claude_fix(ctx: Context) -> str:
    return ('~/.claude/settings.json: {"env": {"ANTHROPIC_BASE_URL": "' + ctx.env.router_url + '"}, '
            f'"apiKeyHelper": "printenv {KEY_VAR}"}}  — or export ANTHROPIC_AUTH_TOKEN="${KEY_VAR}"; '
            "then `claude /logout` so no OAuth login is used")


def codex_fix(ctx: Context) -> str:
    return ("~/.codex/config.toml:\n"
            'model_provider = "pd"\n'
            "[model_providers.pd]\n"
            'name = "pd-deploy router"\n'
            f'base_url = "{ctx.env.router_url}/v1"\n'
            f'env_key = "{KEY_VAR}"\n'
            'wire_api = "responses"\n'
            f"and export {KEY_VAR}=… in the shell that runs codex")


def check(ctx: Context) -> list[Finding]:
    return _claude(ctx) + _codex(ctx) + _client_lines(ctx)


def _claude(ctx: Context) -> list[Finding]:
    env = ctx.env
    base = env.client_env("ANTHROPIC_BASE_URL")
    token, api_key = env.client_env("ANTHROPIC_AUTH_TOKEN"), env.client_env("ANTHROPIC_API_KEY")
    helper = (env.claude_settings or {}).get("apiKeyHelper")
    out: list[Finding] = []
    if points_at_router(ctx, base) and not (token or api_key or helper):
        login = " and ~/.claude/.credentials.json holds an OAuth login" if env.claude_credentials else ""
        out.append(finding(
            "oauth.claude_no_key", "error",
            "Claude Code points at the router but has no API key: it will use its OAuth login",
            f"ANTHROPIC_BASE_URL={base} is the router, but neither ANTHROPIC_AUTH_TOKEN, ANTHROPIC_API_KEY nor "
            f"apiKeyHelper is set{login}. Claude Code then sends its claude.ai OAuth token (or nothing: 'Could not "
            "resolve authentication method'), which the router rejects with 401; when it expires you see "
            "'OAuth token has expired · Please run /login'.", claude_fix(ctx)))
    if token and api_key and token.strip() == api_key.strip():  # different values: client.auth_conflict
        out.append(finding(
            "oauth.claude_auth_conflict", "warning", "Both ANTHROPIC_AUTH_TOKEN and ANTHROPIC_API_KEY are set (same key)",
            "Claude Code warns 'Auth conflict: Both a token (ANTHROPIC_AUTH_TOKEN) and an API key "
            "(ANTHROPIC_API_KEY) are set' and sends the token; the anthropic SDK sends the API key. They hold the "
            "same key now, so both work, until one of them is rotated.",
            "unset ANTHROPIC_API_KEY (keep ANTHROPIC_AUTH_TOKEN=\"$" + KEY_VAR + "\")"))
    return out


def _codex(ctx: Context) -> list[Finding]:
    env = ctx.env
    out: list[Finding] = []
    config = env.codex_config or {}
    provider_name = config.get("model_provider")
    providers = config.get("model_providers") if isinstance(config.get("model_providers"), dict) else {}
    provider = providers.get(provider_name) if isinstance(provider_name, str) else None
    auth = env.codex_auth or {}
    chatgpt_mode = isinstance(auth.get("tokens"), dict) and not auth.get("OPENAI_API_KEY")
    if env.codex_config_error:
        out.append(finding("oauth.codex_config_invalid", "error", "~/.codex/config.toml does not parse",
                           env.codex_config_error, codex_fix(ctx)))
    if isinstance(provider, dict):
        where = f"~/.codex/config.toml [model_providers.{provider_name}]"
        base = str(provider.get("base_url", ""))
        if not base.rstrip("/").endswith("/v1") or not points_at_router(ctx, base):
            out.append(finding(
                "oauth.codex_base_url", "error", f"{where} base_url is {base or 'missing'}",
                "Codex appends /responses to base_url: it must be the router's URL ending in /v1.", codex_fix(ctx)))
        env_key = provider.get("env_key")
        if not env_key and not provider.get("requires_openai_auth"):
            out.append(finding(
                "oauth.codex_no_env_key", "error", f"{where} has no env_key",
                "Without env_key Codex sends no key to the router (401).", codex_fix(ctx)))
        elif env_key and str(env_key) not in env.set_vars:
            out.append(finding(
                "oauth.codex_env_key_unset", "error", f"{where} env_key = {env_key!r} but ${env_key} is not set",
                f"Codex stops with 'Missing environment variable: `{env_key}`' (it does not fall back to "
                "auth.json).", f"export {env_key}=\"${KEY_VAR}\"  (in the shell that runs codex)"))
        if provider.get("wire_api", "responses") != "responses":
            out.append(finding(
                "oauth.codex_wire_api", "error", f"{where} wire_api = {provider.get('wire_api')!r}",
                "Current Codex removed wire_api = \"chat\"; it speaks only the Responses API, which the router "
                "serves at /v1/responses.", f'set wire_api = "responses" in {where}'))
        if provider.get("requires_openai_auth") and chatgpt_mode:
            out.append(finding(
                "oauth.codex_chatgpt_login", "error", f"{where} uses the ChatGPT login (requires_openai_auth)",
                "~/.codex/auth.json holds ChatGPT tokens, and requires_openai_auth sends them to the router, which "
                "expects its own key.", codex_fix(ctx)))
    elif chatgpt_mode:
        out.append(finding(
            "oauth.codex_chatgpt_login", "warning", "Codex is logged in with ChatGPT and has no provider for the router",
            "~/.codex/auth.json holds ChatGPT tokens (tokens.access_token…) and no model_provider points at the "
            "router, so Codex sends its requests to chatgpt.com, not to this stack.", codex_fix(ctx)))
    return out


def _client_lines(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    expired = ctx.client_kinds("oauth_expired", "invalid_grant")
    if expired:
        out.append(finding(
            "oauth.token_expired", "error",
            "The client uses an OAuth login (expired / refresh failed) instead of the router key",
            "'OAuth token has expired' / invalid_grant come from Claude Code's or Codex's own login (claude.ai / "
            "ChatGPT), not from the router: the client is not using the router key. A shared or rotated "
            "~/.claude/.credentials.json makes refreshes fail with invalid_grant.",
            "Claude Code: " + claude_fix(ctx) + "\nCodex: " + codex_fix(ctx), expired))
    unresolved = ctx.client_kinds("auth_unresolved")
    if unresolved and not any(f.id == "oauth.claude_no_key" for f in _claude(ctx)):
        out.append(finding(
            "oauth.claude_no_key", "error", "Claude Code resolved no credential",
            "ANTHROPIC_BASE_URL is set without ANTHROPIC_AUTH_TOKEN / ANTHROPIC_API_KEY ('Could not resolve "
            "authentication method').", claude_fix(ctx), unresolved))
    conflict = ctx.client_kinds("auth_conflict")
    if conflict and not (ctx.env.client_env("ANTHROPIC_AUTH_TOKEN") and ctx.env.client_env("ANTHROPIC_API_KEY")):
        out.append(finding("oauth.claude_auth_conflict", "warning", "Claude Code reports an auth conflict",
                           "Two credentials are configured; Claude Code picks one.",
                           "unset ANTHROPIC_API_KEY (keep ANTHROPIC_AUTH_TOKEN)", conflict))
    for r in ctx.client_kinds("env_key_missing"):
        var = r.data.get("env_var", "?")  # a client line: the doctor's own data, not a service event
        out.append(finding(
            "oauth.codex_env_key_unset", "error", f"Codex: Missing environment variable ${var}",
            "The provider's env_key names a variable that is not set in Codex's environment.",
            f"export {var}=\"${KEY_VAR}\"", [r]))
    wire = ctx.client_kinds("wire_api_chat")
    if wire:
        out.append(finding("oauth.codex_wire_api", "error", "Codex: wire_api = \"chat\" is no longer supported",
                           "Codex now speaks only the Responses API.", 'wire_api = "responses"', wire))
    return out
