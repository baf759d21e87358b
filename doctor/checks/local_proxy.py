""""local proxy failed" / the client cannot reach the router.

Causes told apart: proxy variables (HTTP(S)_PROXY / ALL_PROXY, either case) without NO_PROXY covering
the router host, in the shell or in ~/.claude/settings.json's env block; a client base URL pointing
at an engine port (8000, prefill/decode) instead of the router, or with/without `/v1` the wrong way;
the router not running (no router lines / no router container); a client error that the router log
does not contain. Relies on the router's request lines (router.scheduled, router.request_done; older
routers' router.request_received) and client lines (ECONNREFUSED, `Connection
error.`, Codex `stream disconnected before completion`, CC Switch `local proxy failed`).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from doctor import engine_facts
from doctor.checks.client_view import never_left
from doctor.environment import NO_PROXY_VARS, PROXY_VARS, redact_url
from doctor.findings import Context, Finding, finding
from stack.common import events

CONNECT_KINDS = ("connect_failed", "stream_disconnected", "local_proxy_failed", "socks_missing")
ENGINE_PORT = 8000
ENGINE_HOSTS = ("prefill", "decode", "engine")


def check(ctx: Context) -> list[Finding]:
    client = ctx.client_kinds(*CONNECT_KINDS)
    out: list[Finding] = []
    out.extend(_proxy_variables(ctx, bool(client)))
    out.extend(_base_urls(ctx))
    router_down = _router_down(ctx, client)
    out.extend(router_down)
    if client and not router_down and not never_left(ctx):
        out.extend(_not_in_router_log(ctx, client, [f.id for f in out]))
    return out


def no_proxy_covers(no_proxy: str, host: str) -> bool:
    """httpx/curl semantics: `*`, the exact host, or a domain suffix (`.example.com`, `example.com`)."""
    for entry in re.split(r"[,\s]+", no_proxy.strip()):
        entry = entry.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return True
        entry = entry.split(":")[0] if entry.count(":") == 1 else entry  # drop a port, keep IPv6
        if host == entry or host.endswith("." + entry.lstrip(".")):
            return True
    return False


def _proxy_variables(ctx: Context, client_failed: bool) -> list[Finding]:
    host = ctx.env.router_host.lower()
    out: list[Finding] = []
    scopes = (("shell environment", dict(ctx.env.env)), ("~/.claude/settings.json env", ctx.env.claude_env))
    for scope, env in scopes:
        proxies = {name: env[name] for name in PROXY_VARS if env.get(name)}
        if not proxies:
            continue
        no_proxy = " ".join(env.get(n, "") for n in NO_PROXY_VARS)
        if no_proxy_covers(no_proxy, host):
            continue
        shown = ", ".join(f"{k}={redact_url(v)}" for k, v in proxies.items())
        socks = any(v.lower().startswith("socks") for v in proxies.values())
        cause = (f"{scope} sets {shown} and NO_PROXY does not cover {host}, so the client (httpx, Claude Code, "
                 f"Codex) sends its requests for the router through that proxy; a dead or remote proxy turns "
                 f"them into connection errors / 'local proxy failed'.")
        if socks:
            cause += " A socks:// ALL_PROXY also makes the Python SDKs fail at start without `socksio`."
        upper_lower = [(u, u.lower()) for u in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
                       if env.get(u) and env.get(u.lower()) and env[u] != env[u.lower()]]
        if upper_lower:
            cause += " Upper- and lower-case variables disagree (" + ", ".join(
                f"{u}≠{l}" for u, l in upper_lower) + "); tools pick different ones."
        hosts = ",".join(dict.fromkeys([host, "localhost", "127.0.0.1", "::1"]))
        fix = (f"export NO_PROXY={hosts} no_proxy={hosts}   (or unset {' '.join(proxies)})"
               if scope == "shell environment" else
               f'add to the "env" block of ~/.claude/settings.json: "NO_PROXY": "{hosts}"')
        out.append(finding("proxy.env_without_no_proxy", "error" if client_failed else "warning",
                           f"Proxy variables route router traffic through a proxy ({scope})", cause, fix,
                           ctx.client_kinds(*CONNECT_KINDS)[:3]))
    return out


def _client_base_urls(ctx: Context) -> list[tuple[str, str, str, bool]]:
    """(where, variable, url, wants_v1) for each client base URL configured."""
    urls: list[tuple[str, str, str, bool]] = []
    if ctx.env.env.get("OPENAI_BASE_URL"):
        urls.append(("OPENAI_BASE_URL", "OPENAI_BASE_URL", ctx.env.env["OPENAI_BASE_URL"], True))
    claude = ctx.env.client_env("ANTHROPIC_BASE_URL")
    if claude:
        where = "~/.claude/settings.json env.ANTHROPIC_BASE_URL" if "ANTHROPIC_BASE_URL" in ctx.env.claude_env \
            else "ANTHROPIC_BASE_URL"
        urls.append((where, "ANTHROPIC_BASE_URL", claude, False))
    return urls


def engine_host_ports(ctx: Context) -> set[int]:
    """Host ports the engine containers publish (live only): a client URL on one of them reaches an engine."""
    published = (ctx.docker or {}).get("published") or {}
    return {int(b.split("->")[0].rsplit(":", 1)[1]) for s in ENGINE_HOSTS for b in published.get(s, ())}


def _base_urls(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    router = ctx.env.router_url
    engine_ports = engine_host_ports(ctx)
    for where, var, url, wants_v1 in _client_base_urls(ctx):
        parts = urlsplit(url)
        right = f"{router}/v1" if wants_v1 else router
        if parts.port == ENGINE_PORT or (parts.hostname or "") in ENGINE_HOSTS or parts.port in engine_ports:
            out.append(finding(
                "client.base_url_engine", "error",
                f"{where} points at an engine ({redact_url(url)}), not the router",
                "Port 8000 / prefill / decode (or a host port an engine container publishes) is an engine: it has no key check, no PD scheduling, and a decode "
                "engine without a prefill hand-off waits for KV that never comes. Clients must only talk to the "
                "router.",
                f"{var}={right}"))
            continue
        path = parts.path.rstrip("/")
        if wants_v1 and not path.endswith("/v1"):
            out.append(finding(
                "client.base_url_no_v1", "error", f"{where} lacks /v1 ({redact_url(url)})",
                "OpenAI clients append /chat/completions to the base URL, so without /v1 they call "
                "/chat/completions and get 404.", f"export {var}={right}"))
        elif not wants_v1 and path.endswith("/v1"):
            out.append(finding(
                "client.base_url_extra_v1", "error", f"{where} ends in /v1 ({redact_url(url)})",
                "Claude Code appends /v1/messages itself, so this calls /v1/v1/messages and gets 404.",
                f"{var}={right}"))
    return out


def _router_down(ctx: Context, client: list) -> list[Finding]:
    services = ctx.services_seen()
    docker = ctx.docker or {}
    states = docker.get("services")
    running = None if states is None else {s for s, state in states.items() if state in ("running", "healthy",
                                                                                        "starting", "unhealthy")}
    if running is not None and "router" not in running and "engine" not in running:
        return [finding(
            "router.not_running", "error", f"The router is not running in compose project {docker.get('project')!r}",
            "The router is the only entry: without it every client call fails to connect.",
            "docker compose up -d router && docker compose logs router", client[:3])]
    if "router" in services or not (client or services) or (running is not None and "router" in running):
        return []  # a running router that logged nothing in the window is quiet, not down
    return [finding(
        "router.not_running", "error",
        "The router logged nothing" + (" while the client failed to connect" if client else ""),
        "There is no router line in the logs" + (f" (only {', '.join(sorted(services))})" if services else "")
        + ": the router is not running, crashed at start, or its logs were not collected.",
        "docker compose ps router; docker compose logs router; docker compose up -d router" if engine_facts.compose(ctx)
        else "give the router's log too (--logs router.log); if it is not running: python -m stack.router --config "
             "<its settings.toml>",
        client[:3] + [r for r in ctx.background if r.event == events.SERVICE_STARTING][:2])]


def _not_in_router_log(ctx: Context, client: list, explained_by: list[str]) -> list[Finding]:
    received = list({r.request_id: r for r in ctx.by_event(events.ROUTER_SCHEDULED, events.ROUTER_REQUEST_DONE,
                                                           events.ROUTER_REQUEST_RECEIVED)}.values())  # a line a request
    with_ids = [r for r in client if r.request_id != "-"]
    if with_ids:
        if all(r.request_id in ctx.timelines for r in with_ids):
            return []
        why = "its request id is not in the router log"
    elif received:
        why = f"the router logged {len(received)} other request(s), none of them answered with this error"
    else:
        why = "the router log has no request at all"
    cc_switch = ctx.client_kinds("local_proxy_failed")
    cause = (f"The client reports a connection failure and {why}: the request died between the client and "
             "the router.")
    if cc_switch:
        cause += (" 'local proxy failed' is CC Switch's local proxy: it is not running, or its provider's base URL "
                  "does not point at the router.")
    if explained_by:
        cause += f" See {', '.join(dict.fromkeys(explained_by))}."
    fix = (f"curl -sS {ctx.env.router_url}/v1/models -H \"Authorization: Bearer $TAOTOKEN_API_KEY\" from the "
           f"client's shell; point the client (or CC Switch's provider) at {ctx.env.router_url}/v1")
    return [finding("client.cannot_reach_router", "error", "The client cannot reach the router", cause, fix,
                    client + received[-1:])]
