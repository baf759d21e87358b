"""Slow is a diagnosis: the router's per-request times against the SLOs, explained by what the engines said about their
load — vLLM's periodic stats line (`Running: N reqs, Waiting: M reqs, KV fetch: K waiting to start, …, KV cache usage:
U%`, vllm/v1/metrics/loggers.py) and its KV capacity at start (`KV cache size: N tokens`).

SLOs: PD_SLO_TTFT_MS / PD_SLO_TPOT_MS where the doctor runs, else the router's defaults (stack/router/metrics.py SLO).
With few requests the P99 is their worst.
"""

from __future__ import annotations

import math

from doctor import engine_facts
from doctor.engine_lines import VLLM
from doctor.errors import DoctorError
from doctor.findings import Context, Finding, finding
from stack.common import events
from stack.common.config import ConfigError
from stack.router.metrics import SLO

KV_FULL_PCT = 90.0  # a KV cache this full makes new requests wait for blocks


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def check(ctx: Context) -> list[Finding]:
    try:
        slo = SLO.from_env()
    except ConfigError as exc:
        raise DoctorError(str(exc)) from None
    ttft, tpot, done = [], [], []
    for t in ctx.timelines.values():
        end = t.first(events.ROUTER_REQUEST_DONE)
        first = t.first(events.ROUTER_DECODE_FIRST_TOKEN)
        if end is None or not t.complete:
            continue
        done.append(end)
        if first is not None and first[events.TTFT_MS] is not None:
            ttft.append(first[events.TTFT_MS] / 1000)
            tokens = end[events.COMPLETION_TOKENS] or 0
            if tokens > 1 and end[events.E2E_MS] is not None:
                tpot.append((end[events.E2E_MS] - first[events.TTFT_MS]) / 1000 / (tokens - 1))
    broken = []
    if ttft and p99(ttft) > slo.ttft_s:
        broken.append(f"P99 TTFT {p99(ttft):.1f} s > SLO {slo.ttft_s:g} s")
    if tpot and p99(tpot) > slo.tpot_s:
        broken.append(f"P99 TPOT {p99(tpot) * 1000:.0f} ms > SLO {slo.tpot_s * 1000:.0f} ms")
    if not broken:
        return []
    slow_ids = [r.request_id for r in done]
    for service in ("decode", "prefill", "engine"):
        load = _load(ctx, service)
        if load is None:
            continue
        waiting, kv_waits, detail, worst = load
        runs = engine_facts.starts(ctx).get(service, [])
        capacity = runs[-1].kv_tokens if runs else None
        prompt = [r[events.PROMPT_TOKENS] + (r[events.COMPLETION_TOKENS] or 0) for r in done
                  if r[events.PROMPT_TOKENS] is not None]
        per_request = sum(prompt) / len(prompt) if prompt else None
        holds = (f" — its KV holds {capacity:,} tokens, about {capacity / per_request:.0f} request(s) of "
                 f"{per_request:.0f} tokens" if capacity and per_request else "")
        other = "prefill" if service == "decode" else "decode"
        other_runs = engine_facts.starts(ctx).get(other, [])
        if holds and other_runs and other_runs[-1].kv_tokens:
            holds += f" ({other}'s: {other_runs[-1].kv_tokens:,})"
        kv_bound = kv_waits is not None
        cause = (f"{service} ran out of KV blocks: up to {waiting} request(s) waited ({detail}){holds}. Requests queue "
                 f"on {service} until running ones free their blocks." if kv_bound else
                 f"{service} had more requests than it runs at once: up to {waiting} waited ({detail}): compute-bound, "
                 "or its batch limit.")
        return [finding(
            f"slow.{service}_kv_capacity" if kv_bound else f"slow.{service}_queueing", "warning",
            f"Slow: {'; '.join(broken)} over {len(done)} request(s); {service} queued up to {waiting} request(s)"
            + (f" waiting for KV ({kv_waits})" if kv_bound else ""),
            cause, _fix(ctx, service, kv_bound), worst + (runs[-1].evidence("kv_tokens")[:1] if runs else []),
            slow_ids)]
    return [finding(
        "slow.slo_missed", "warning", f"Slow: {'; '.join(broken)} over {len(done)} request(s)",
        "The router's times break the SLO, and no engine reported requests waiting (no stats lines or none queued): "
        "the time goes in the engines' compute or the KV transfer; python -m doctor explain <request id> shows which hop.",
        "python -m doctor advise (more prefill or more decode, from the router's metrics under this load); ./pd scale",
        done[:3], slow_ids)]


def _load(ctx: Context, service: str) -> tuple[int, str | None, str, list] | None:
    """(most requests waiting, what waited for KV or None, what the engine said, the lines) on one engine, or None when
    none waited: vLLM's stats lines; our engine's engine.request_queued (a wait for KV blocks) and the router's
    router.queued for that role (every slot busy)."""
    stats = [r for r in ctx.by_event(VLLM + "stats") if r.service == service]
    waiting = max((r.data.get("waiting", 0) for r in stats), default=0)
    if waiting:
        worst = max(stats, key=lambda r: (r.data.get("waiting", 0), r.data.get("kv_fetch_waiting", 0)))
        fetch = max(r.data.get("kv_fetch_waiting", 0) for r in stats)
        usage = max(r.data.get("kv_usage_pct", 0.0) for r in stats)
        kv = f"{fetch} KV fetches not started" if fetch else f"KV cache {usage:.0f}% full" if usage >= KV_FULL_PCT else None
        return waiting, kv, f"KV fetch: {fetch} waiting to start; KV cache usage up to {usage:.0f}%", [worst]
    kv_waits = [r for r in ctx.by_event(events.ENGINE_REQUEST_QUEUED) if r.service == service]
    queued = [r for r in ctx.by_event(events.ROUTER_QUEUED) if r[events.ROLE] == service]
    if not kv_waits and not queued:
        return None
    depth = max((r[events.QUEUE_DEPTH] or 0 for r in queued), default=0)
    said = f"{len(kv_waits)} engine.request_queued for KV blocks; router queue depth up to {depth}"
    return (max(depth, len(kv_waits)), f"{len(kv_waits)} waits for KV blocks" if kv_waits else None, said,
            kv_waits[:2] + queued[:2])


def _fix(ctx: Context, service: str, kv_bound: bool) -> str:
    kind = engine_facts.kind_of(ctx, service)
    if kv_bound:
        more = ("give it more KV: VLLM_CPU_KVCACHE_SPACE (GiB, CPU) or --gpu-memory-utilization (GPU), and no "
                "--num-gpu-blocks-override below the load" if kind == "vllm" else
                f"give it more KV (kv_cache_bytes in {ctx.facts.config_file(service)[0]})")
    else:
        more = "raise --max-num-seqs if its KV allows" if kind == "vllm" else \
            f"raise max_num_seqs in {ctx.facts.config_file(service)[0]} if its KV allows"
    return f"{service}: {more}; or add {service} replicas: ./pd scale {service}=N; python -m doctor advise to size it"
