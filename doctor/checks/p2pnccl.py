"""vLLM P2pNccl engines that never registered with the router, stopped pinging, or ping in another format.

With `[p2pnccl] registry_port` set (the P2pNccl GPU overlay) the router's pools are the engines that
register over ZMQ, so an engine whose proxy_ip/proxy_port is wrong is simply absent, and requests fail
503 `no_prefill_backend` / `no_decode_backend`. Relies on the router's events config.ignored (value
"(registry)": registry mode), p2pnccl.joined, p2pnccl.left, p2pnccl.bad_ping, and http.error with
those codes.
"""

from __future__ import annotations

from doctor.findings import Context, Finding, finding
from stack.common import events

_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


def check(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    bad = ctx.by_event(events.P2PNCCL_BAD_PING)
    if bad:
        out.append(finding(
            "p2pnccl.bad_ping", "warning",
            f"{len(bad)} sender(s) on the P2pNccl registry port do not speak vLLM's registration",
            "The router read pings it could not use (" + "; ".join(sorted({r[events.ERROR] or "?" for r in bad})) + "). "
            "Only vLLM P2pNccl engines (msgpack type/http_address/zmq_address every 3 s) belong on that port.",
            "Point only the P2pNccl engines' kv_connector_extra_config proxy_ip/proxy_port at the router's registry port; "
            "move anything else to another port.", bad))
    mode = [r for r in ctx.by_event(events.CONFIG_IGNORED) if r.service == "router" and r[events.VALUE] == "(registry)"]
    joined = {r[events.ROLE] for r in ctx.by_event(events.P2PNCCL_JOINED)}
    refused = [r for r in ctx.by_event(events.HTTP_ERROR)
               if r.service == "router" and r[events.CODE] in ("no_prefill_backend", "no_decode_backend")]
    for role in ("prefill", "decode"):
        failed = [r for r in refused if r[events.CODE] == f"no_{role}_backend"]
        if not failed or role in joined or not (mode or joined):
            continue
        out.append(finding(
            f"p2pnccl.no_{role}", "error",
            f"no P2pNccl {role} instance has registered with the router: {len(failed)} request(s) got 503",
            f"In P2pNccl mode the router routes only to engines that ping its registry; no {_KV_ROLE[role]} engine did, so "
            "the configured endpoints do not count. The engine is down, or its proxy_ip/proxy_port do not reach the router.",
            f"In the {role} engine's --kv-transfer-config set kv_connector_extra_config proxy_ip to the router's address and "
            "proxy_port to its registry port (compose.gpu.p2pnccl.yaml: P2P_ROUTER_IP, 30001); check the engine's log for "
            f"'P2pNcclEngine init … proxy_address': docker compose logs {role} | grep P2pNcclEngine",
            mode + failed, [r.request_id for r in failed]))
    left = ctx.by_event(events.P2PNCCL_LEFT)
    if left:
        out.append(finding(
            "p2pnccl.left", "warning",
            f"{len(left)} P2pNccl instance(s) stopped pinging and were taken out of service",
            "An instance that has not pinged for instance_ttl_ms (5 s) is dropped: the engine died, restarted, or lost "
            "its network to the router. It comes back by itself when it pings again.",
            "docker compose ps; docker compose logs " + " ".join(sorted({r[events.ROLE] or "?" for r in left})), left))
    return out
