"""`check` and `verify` on engines given by URL: process or remote deployments, no compose project, no Docker.

    python -m doctor check  --router-url URL --prefill-url URL --decode-url URL
    python -m doctor verify --router-url URL [--logs FILE_OR_FOLDER …]

check probes each engine over HTTP the way the router does (GET /health, GET /v1/models with the router's
PD_INTERNAL_KEY from this shell) and compares what prefill and decode serve (model, max_model_len: vLLM lists both in
/v1/models), then runs verify. verify sends one streamed request through the router and, given the deployment's log
files, proves from them that it went prefill → KV → decode (or says where it stopped and why).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import uuid

from doctor import environment, live, sources
from doctor.checks import run_checks
from doctor.errors import DoctorError
from doctor.findings import Context, Finding, finding
from stack.common import events

COMPARED = ("root", "max_model_len")  # /v1/models fields that must agree between prefill and decode


def wanted(args: argparse.Namespace) -> bool:
    """Engines given by URL, or a verify against log files: no compose project is looked for."""
    return bool(getattr(args, "prefill_url", None) or getattr(args, "decode_url", None)
                or (args.command == "verify" and getattr(args, "logs", None)))


def probe_engine(role: str, url: str) -> tuple[list[Finding], dict | None]:
    """GET /health and GET /v1/models (with PD_INTERNAL_KEY) → findings and the first model card."""
    url = url.rstrip("/")
    try:
        with live.request(f"{url}/health", None) as response:
            healthy = response.status == 200
    except (urllib.error.URLError, OSError) as exc:
        return [live.problem(f"engine.{role}", "error", f"{role} engine not reachable at {url}: {exc}",
                             "Nothing answers there: the engine is down, still loading, or the URL/port is wrong.",
                             f"start the {role} engine; curl {url}/health")], None
    key = os.environ.get("PD_INTERNAL_KEY") or None
    try:
        with live.request(f"{url}/v1/models", key) as response:
            cards = json.loads(response.read()).get("data") or []
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            return [live.problem(
                "auth.internal_key_mismatch", "error", f"the {role} engine at {url} refuses "
                + ("this shell's PD_INTERNAL_KEY" if key else "requests without a key") + f" (HTTP {exc.code})",
                "The router sends PD_INTERNAL_KEY to every engine; an engine holding another key (vLLM: VLLM_API_KEY "
                "/ --api-key) refuses every leg, and clients get 502 internal_key_rejected.",
                f"start the {role} engine with the router's PD_INTERNAL_KEY (vLLM: VLLM_API_KEY=…); compare "
                "fingerprints: printf %s \"$PD_INTERNAL_KEY\" | sha256sum | cut -c1-12")], None
        return [live.problem(f"engine.{role}", "error", f"{role} engine at {url}: GET /v1/models answered {exc.code}",
                             exc.read()[:300].decode("utf-8", "replace"), f"curl {url}/v1/models")], None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return [live.problem(f"engine.{role}", "error", f"{role} engine at {url}: GET /v1/models failed: {exc}",
                             "It answers /health but not the API.", f"curl {url}/v1/models")], None
    card = cards[0] if cards and isinstance(cards[0], dict) else {}
    state = "healthy" if healthy else "answering /v1/models but /health is not 200"
    return [live.ok(f"engine.{role}", f"{role} engine at {url}: {state}, serves {card.get('id', '?')}"
                    + (f" (max_model_len {card['max_model_len']})" if card.get("max_model_len") else ""))], card


def compare(cards: dict[str, dict]) -> list[Finding]:
    if "prefill" not in cards or "decode" not in cards:
        return []
    out = []
    for key in COMPARED:
        a, b = cards["prefill"].get(key), cards["decode"].get(key)
        if a is not None and b is not None and a != b:
            name = "model" if key == "root" else key
            out.append(live.problem(
                f"config.{name}_mismatch", "error", f"{name} differs: prefill {a!r}, decode {b!r} (their /v1/models)",
                "Prefill and decode must serve the same model with the same max length for the KV one computes to "
                "be what the other reads.", f"start both engines with the same {'--model' if name == 'model' else '--max-model-len'} "
                f"(vLLM) or \"{name}\" in both config files (ours); restart both"))
    return out


def check(args: argparse.Namespace) -> tuple[list[Finding], dict]:
    url = live.router_url(None, args.router_url)
    found, cards = [], {}
    for role in ("prefill", "decode"):
        for engine in getattr(args, f"{role}_url") or []:
            probed, card = probe_engine(role, engine)
            found += probed
            if card is not None:
                cards.setdefault(role, card)
    found += compare(cards)
    reachable, model = live.probe_router(url)
    found += reachable
    if all(f.severity == "ok" for f in reachable):
        found += live.probe_pools(url)
        verified, _ = verify(args, model=model, url=url)
        found += verified
    return found, {"router_url": url, "engines": {r: getattr(args, f"{r}_url") for r in ("prefill", "decode")}}


def verify(args: argparse.Namespace, model: str | None = None, url: str | None = None) -> tuple[list[Finding], dict]:
    url = url or live.router_url(None, args.router_url)
    if model is None and not getattr(args, "model", None):
        _, model = live.probe_router(url)
    model = getattr(args, "model", None) or model or "default"
    rid = f"doctor-verify-{uuid.uuid4().hex[:12]}"
    done, what = live.send_stream(url, model, rid, getattr(args, "timeout", 60.0))
    summary = {"request_id": rid, "router_url": url, "stream": what}
    logs = getattr(args, "logs", None) or []
    if not logs:
        if done:
            return [live.ok("verify", f"request {rid} streamed through the router ({what}); give --logs (the router's "
                            "and engines' log files) to prove it went prefill → KV → decode")], summary
        return [live.problem("verify", "error", f"verify failed: {what}", "The request through the router failed.",
                             f"python -m doctor diagnose -v --logs <the router's and engines' logs> --request-id {rid}")], summary
    ctx = timeline = None
    for _ in range(10):  # the services write their lines a moment after answering
        loaded = sources.load_files(logs)
        ctx = Context.build(loaded.records, environment.snapshot(args.home, router_url=url), loaded.stats)
        timeline = ctx.timeline(rid)
        if timeline is not None and timeline.first(events.ROUTER_REQUEST_DONE) is not None:
            break
        time.sleep(0.5)
    if timeline is None or ctx is None:
        raise DoctorError(f"{rid}: the router's lines are not in {', '.join(logs)} (give the router's log file)")
    if done and timeline.complete:
        return [finding("verify", "ok", f"verified: request {rid} went {' → '.join(timeline.reached)}: {what}",
                        "The router's lines (and the engines', when they name the request) show every hop.",
                        "nothing to fix", timeline.records[:4], [rid])], summary
    findings = [f for f in run_checks(ctx.narrow(rid) or ctx) if f.severity != "ok"]
    return [live.problem("verify", "error", f"verify failed: {what}; it stopped at {timeline.stopped_at or '?'}",
                         "The request did not go router → prefill → KV → decode; the findings below say why.",
                         f"python -m doctor diagnose -v --logs {' --logs '.join(logs)}")] + findings, summary
