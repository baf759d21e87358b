"""Long prompts (issue 19): over the window, KV that decode cannot hold or that stopped arriving, work abandoned.

Each finding carries every hop's lines of the requests it names (router, prefill, decode), so the
reader sees where the prompt's size met a limit, and the fix sized for that prompt.
"""

from __future__ import annotations

import re

from doctor.findings import Context, Finding, finding
from doctor.parse import Record
from stack.common import events

_WINDOW = re.compile(r"maximum context length is (\d+) tokens\. However, (?:your prompt has|you requested) (\d+) tokens")


def check(ctx: Context) -> list[Finding]:
    return _context_exceeded(ctx) + _kv_capacity(ctx) + _kv_stalled(ctx) + _abandoned(ctx)


def _hops(ctx: Context, records: list[Record]) -> list[Record]:
    """The given lines and every other line of their requests (all hops)."""
    out = list(records)
    for rid in dict.fromkeys(r.request_id for r in records):
        timeline = ctx.timeline(rid) if rid and rid != "-" else None
        out += timeline.records if timeline else []
    return out


def _rids(records: list[Record]) -> list[str]:
    return [r.request_id for r in records]


def _engines_disagree(ctx: Context, record: Record) -> bool:
    """A decode that refused what the prefill already computed and the router answered 502: the engines' windows
    disagree (config.*). The router passes such a refusal on as the client's 400 only when the windows are the same."""
    timeline = ctx.timeline(record.request_id) if record.service == "decode" else None
    return bool(timeline) and timeline.status != 400 and any(r.event == events.ROUTER_PREFILL_DONE for r in timeline.records)


def context_refusals(ctx: Context) -> list[Record]:
    """One line per request refused for its size (prompt, or prompt + max_tokens) against a window both engines share:
    the engine and the router each log the 400 (the router's line is what the client got)."""
    return list({r.request_id: r for r in ctx.by_event(events.HTTP_BAD_REQUEST)
                 if r[events.CODE] == "context_length_exceeded" and not _engines_disagree(ctx, r)}.values())


def _context_exceeded(ctx: Context) -> list[Finding]:
    refused = context_refusals(ctx)
    if not refused:
        return []
    counts = [m.groups() for r in refused if (m := _WINDOW.search(r.line))]
    window = max((int(w) for w, _ in counts), default=None)
    largest = max((int(n) for _, n in counts), default=None)
    told = (f" The engine counted up to {largest} tokens against a {window}-token window." if counts else "")
    return [finding(
        "long_prompt.context_exceeded", "error",
        f"{len(refused)} request(s) refused 400 context_length_exceeded: prompt + max_tokens past the window",
        "The prompt (plus max_tokens) is longer than the engine's window, counted with the engine's own tokenizer; a "
        "client that counts with another tokenizer (Claude Code counts Claude's) sees a smaller number. A prompt alone "
        "past the window is refused before any compute; in PD, prompt + max_tokens past it only by decode, once prefill "
        "computed the prompt (the prefill leg asks one token)." + told,
        "shorten the conversation (Claude Code: /compact) or lower max_tokens; or serve a model with a longer window "
        "(max_model_len in prefill/ and decode/config.json, with kv_cache_bytes ≥ 16 KiB × tokens for dummy:small; "
        "docs/long-prompts.md)",
        _hops(ctx, refused[:3]), _rids(refused))]


def _kv_capacity(ctx: Context) -> list[Finding]:
    small = ctx.by_event(events.KV_CONSUMER_POOL_TOO_SMALL)
    if not small:
        return []
    tokens = max(r[events.NUM_TOKENS] for r in small)
    pool = min(r[events.POOL_TOKENS] for r in small)
    budget = max(r[events.KV_CACHE_BYTES] for r in small)
    rejected = [r for r in ctx.by_event(events.KV_PRODUCER_REJECTED) if r[events.REASON] == "pool_too_small"]
    return [finding(
        "long_prompt.decode_kv_capacity", "error",
        f"decode refused KV of {tokens} tokens: its KV pool holds {pool} tokens (kv_cache_bytes={budget})",
        "Decode refuses a transfer its KV pool could never hold at the KV header, before any KV moves; prefill answers "
        "503 decode_kv_capacity and the router tries another decode. Every decode here is too small for this prompt.",
        f"raise kv_cache_bytes in decode/config.json above {tokens} × the KV bytes a token (16 KiB for dummy:small: "
        f"{(tokens + 1) * 16384:.3g} bytes for this prompt), then docker compose up -d decode",
        _hops(ctx, small[:2] + rejected[:2]), _rids(small + rejected))]


def _kv_stalled(ctx: Context) -> list[Finding]:
    stalled = ctx.by_event(events.KV_CONSUMER_STALLED)
    if not stalled:
        return []
    lease = stalled[0][events.KV_LEASE_MS]
    return [finding(
        "long_prompt.kv_stalled", "error",
        f"{len(stalled)} KV push(es) cut off: nothing arrived for kv_lease_ms={lease} mid-transfer",
        "Decode closes an admitted push only when no byte came for kv_lease_ms (the lease counts from the last byte). "
        "The prefill stopped sending: it is overloaded (a layer of a long prompt took longer than the lease), it died, "
        "or the network between them dropped.",
        "check the prefill's lines for these transfer ids (engine.step_failed, a restart); if one layer of a long "
        "prefill takes longer, raise kv_transfer_config.kv_lease_ms in decode/config.json",
        _hops(ctx, stalled[:3]), _rids(stalled))]


def _abandoned(ctx: Context) -> list[Finding]:
    gone = ctx.by_event(events.ENGINE_REQUEST_ABANDONED)
    if not gone:
        return []
    stopped = ctx.by_event(events.ENGINE_PREFILL_STOPPED)
    biggest = max(r[events.PROMPT_TOKENS] for r in gone)
    return [finding(
        "long_prompt.abandoned", "warning",
        f"{len(gone)} request(s) abandoned by their caller (largest prompt {biggest} tokens); the engines stopped them",
        "The router (its deadline, the client leaving, a retry elsewhere) closed the connection to the engine; the "
        "engine cancelled the work, stopped a running prefill between layers "
        f"({len(stopped)} stopped mid-forward) and freed its KV, so later requests do not wait behind it.",
        "if these were wanted: raise the client's timeout, or the router's deadlines for long prompts; if a client "
        "sent a prompt far over what it needs (thousands of messages), trim it",
        _hops(ctx, gone[:3] + stopped[:2]), _rids(gone + stopped))]
