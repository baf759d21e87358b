"""The diagnoses: one module each with a pure `check(ctx) -> list[Finding]`, and the registry that runs them.

A new diagnosis is its module plus one `Check` line in `REGISTRY` (the order reports are printed in,
router side first). `healthy` and `stalled` are not in it: they are decided after the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from doctor.checks import (auth_401, backends, bypass, choices_parse, client_request, client_view, config_mismatch,
                           engine_config, engine_paths, healthy, internal_key, kv_transfer, lifecycle, local_proxy,
                           long_prompt, model_name, nixl_lease_wait, nixl_transport, oauth, p2pnccl, slowness, stalled,
                           tool_calling, unexplained, unknown_route, upstream)
from doctor.findings import Context, Finding


@dataclass(frozen=True)
class Check:
    id: str
    summary: str
    run: Callable[[Context], list[Finding]]


REGISTRY: tuple[Check, ...] = (
    Check("client_view", "requests that never left the client; ANTHROPIC_* credential conflicts", client_view.check),
    Check("model", "404 model_not_found (Claude Code's claude-* names)", model_name.check),
    Check("route", "404 for a path the router does not serve: a client base URL with /v1 twice or without it",
          unknown_route.check),
    Check("client_request", "4xx for what the client sent (invalid_json, a field's type or value, an unsupported "
          "parameter, 413/408/415): which field, the router's words, the fix", client_request.check),
    Check("internal_key", "engines that refuse the router's PD_INTERNAL_KEY (401/403 → 502 internal_key_rejected)",
          internal_key.check),
    Check("tool_calling", "vLLM engines started without tool calling: requests with tools refused (400)",
          tool_calling.check),
    Check("engine_config", "prefill/decode start-up configurations that differ (model, tokenizer, max length, block "
          "size, dtype), read from the engines' own lines", engine_config.check),
    Check("lifecycle", "engine cores that died (vLLM EngineCore / EngineDeadError), restarts, when an engine was down",
          lifecycle.check),
    Check("backends", "a prefill/decode backend that is gone (503 no_*_backend, OOM-killed container)", backends.check),
    Check("bypass", "clients that talk to an engine directly, not through the router", bypass.check),
    Check("config", "prefill/decode config mismatches (max_model_len, block_size, …): key, values, files",
          config_mismatch.check),
    Check("auth", "401s, missing router key, quota vs rate limit", auth_401.check),
    Check("local_proxy", "client cannot reach the router (proxy variables, base URL, router down)", local_proxy.check),
    Check("oauth", "Claude Code / Codex configured for OAuth instead of the router key", oauth.check),
    Check("choices", "error bodies, failed decodes, empty choices, streams without [DONE]", choices_parse.check),
    Check("kv_transfer", "KV port mismatch, unreachable KV port, buffer too small, timeouts, model mismatch",
          kv_transfer.check),
    Check("long_prompt", "prompts over the window, KV a decode cannot hold or that stopped arriving, abandoned work",
          long_prompt.check),
    Check("upstream", "real vLLM / NIXL / UCX / SGLang / Mooncake / NCCL failure strings", upstream.check),
    Check("nixl_lease_wait", "decode's NIXL reads that completed only as the prefill's KV lease expired (each first "
          "token a lease late)", nixl_lease_wait.check),
    Check("nixl_transport", "how NIXL's KV moves (UCX lanes): CUDA IPC / shared memory, or a silent TCP fallback",
          nixl_transport.check),
    Check("p2pnccl", "vLLM P2pNccl engines not registered with the router, dropped, or pinging another format",
          p2pnccl.check),
    Check("slowness", "P99 TTFT / TPOT over the SLO, with the queueing and KV waits the engines reported",
          slowness.check),
    Check("engine_paths", "our engines on a slow path: attention or matmuls fallen back to numpy, MKL on a CPU "
          "not Intel's", engine_paths.check),
)
# Findings that name a symptom, not a cause: for requests a specific finding explains, they step back.
GENERIC = frozenset({"client_request.engine_refused", "choices.decode_failed", "choices.stream_without_done",
                     "backend.decode_down", "backend.prefill_down", "auth.not_from_router"})
STALLED = "stalled"  # the id `--check` selects the stalled-request diagnosis by
UNEXPLAINED = "unexplained"  # failed requests no diagnosis explained


def run_checks(ctx: Context, only: Iterable[str] = ()) -> list[Finding]:
    """Run the registered checks; add stalled requests nobody explained; say healthy when clean."""
    wanted = set(only)
    results: list[Finding] = []
    for check in REGISTRY:
        if not wanted or check.id in wanted:
            results.extend(check.run(ctx))
    results = _specific_first(ctx, results)
    if not wanted or STALLED in wanted:
        explained = {rid for f in results for rid in f.request_ids}
        results.extend(stalled.check(ctx, explained))
    if not wanted or UNEXPLAINED in wanted:
        explained = {rid for f in results for rid in f.request_ids}
        results.extend(unexplained.check(ctx, explained))
    if not any(f.severity != "ok" for f in results):
        results.extend(healthy.check(ctx))
    return results


def _specific_first(ctx: Context, results: list[Finding]) -> list[Finding]:
    """Specific causes first; a generic finding only for requests none of them explains (dropped when none is left).
    A request counts by the router's id or its client's X-Request-ID (findings name either)."""
    specific = [f for f in results if f.id not in GENERIC]
    explained = {rid for f in specific if f.severity != "ok" for rid in f.request_ids}
    explained |= {r.data["client_request_id"] for rid in list(explained) if rid in ctx.timelines
                  for r in ctx.timelines[rid].records if isinstance(r.data.get("client_request_id"), str)}
    generic = [f for f in results if f.id in GENERIC and not (f.request_ids and set(f.request_ids) <= explained)]
    return specific + generic
