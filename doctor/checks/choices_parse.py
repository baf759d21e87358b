"""`KeyError: 'choices'`, `Error reading choices[0].message.content`, `list index out of range`.

Causes told apart: an error body (4xx/5xx) reached a client that read `choices` (which status, from
router.request_done / http.access); decode failed after a successful prefill (router.prefill_done +
router.decode_failed / router.upstream_error + decode's own error lines); a stream's usage chunk
with empty `choices` (router.usage_chunk: client_asked); a stream cut without `[DONE]`
(router.decode_failed mid_stream=true).
"""

from __future__ import annotations

from collections import Counter

from doctor import engine_facts
from doctor.checks.config_mismatch import rejected_for_length
from doctor.checks.long_prompt import context_refusals
from doctor.findings import Context, Finding, finding
from stack.common import events

CHOICES_KINDS = ("choices_keyerror", "choices_read", "choices_index")
# KV failures have their own diagnosis (kv_transfer); a decode that failed for them is not repeated here.
KV_FAILURES = {events.KV_CONSUMER_TIMEOUT, events.KV_CONSUMER_BUFFER_FULL, events.KV_CONSUMER_FINGERPRINT_MISMATCH,
               events.KV_CONSUMER_CHECKSUM_MISMATCH, events.KV_PRODUCER_CONNECT_FAILED, events.KV_PRODUCER_REJECTED,
               events.KV_PRODUCER_FAILED, events.KV_CONSUMER_FAILED}


def check(ctx: Context) -> list[Finding]:
    client = ctx.client_kinds(*CHOICES_KINDS)
    out: list[Finding] = []
    out.extend(_decode_failed_after_prefill(ctx, client))
    out.extend(_stream_without_done(ctx))
    out.extend(_usage_chunk(ctx, client))
    if client and not any(f.id == "choices.decode_failed" for f in out):
        out.extend(_error_body(ctx, client))
    return out


def _decode_failed_after_prefill(ctx: Context, client: list) -> list[Finding]:
    hits = []
    # config.max_model_len_mismatch and long_prompt.context_exceeded name these
    by_config = {rid for rid, _, _ in rejected_for_length(ctx)} | {r.request_id for r in context_refusals(ctx)}
    for t in ctx.timelines.values():
        if t.request_id in by_config:
            continue
        prefill_ok = t.first(events.ROUTER_PREFILL_DONE)
        failed = [r for r in t.events(events.ROUTER_DECODE_FAILED, events.ROUTER_UPSTREAM_ERROR)
                  if r.event == events.ROUTER_DECODE_FAILED or r[events.ROLE] == "decode"]
        answered_error = (t.status or 500) >= 400  # a failure the router retried away is not the client's
        if prefill_ok and failed and answered_error and not any(r.get(events.MID_STREAM) for r in failed) \
                and not any(r.event in KV_FAILURES for r in t.records):
            hits.append((t, prefill_ok, failed))
    if not hits:
        return []
    statuses = Counter(str(f[0][events.STATUS] or "?") for _, _, f in hits)
    evidence = list(client[:2])
    for t, prefill_ok, failed in hits[:3]:
        decode_errors = [r for r in t.records if r.service == "decode" and r.level in ("WARNING", "ERROR", "CRITICAL")]
        answered = t.events(events.ROUTER_REQUEST_DONE)
        evidence += [prefill_ok, *failed[:1], *decode_errors[:2], *answered[:1]]
    t0, _, failed0 = hits[0]
    detail = failed0[0].get(events.ERROR) or failed0[0].get(events.BODY) or "(no error text)"
    return [finding(
        "choices.decode_failed", "error",
        f"Decode failed after a successful prefill in {len(hits)} request(s) "
        f"(decode status {', '.join(f'{s} ×{n}' for s, n in statuses.items())})",
        "Prefill computed the KV and answered, then the decode engine answered an error, so the router returned "
        f"an error body instead of a completion; a client that reads `choices` without checking the status "
        f"fails with KeyError: 'choices'. Decode said: {str(detail)[:200]}",
        f"{engine_facts.logs_command(ctx, 'decode', _ERROR_LINES[engine_facts.kind_of(ctx, 'decode')])}; fix the "
        f"decode error shown, then {'docker compose restart decode' if engine_facts.compose(ctx) else 'restart decode'}. "
        "Clients: check response.status / \"error\" before reading choices.",
        evidence, [t.request_id for t, _, _ in hits])]


# How each engine kind marks its error lines: vLLM prints plain text, ours JSON lines.
_ERROR_LINES = {"vllm": "ERROR|Traceback|EngineCore", "pd-engine": '"level": "(WARNING|ERROR|CRITICAL)"'}


def _stream_without_done(ctx: Context) -> list[Finding]:
    cut = [r for r in ctx.by_event(events.ROUTER_DECODE_FAILED) if r[events.MID_STREAM] is True]
    if not cut:
        return []
    evidence: list = list(ctx.client_kinds("stream_incomplete", "choices_index")[:1])
    for r in cut[:3]:
        t = ctx.timelines.get(r.request_id)
        decode = [x for x in t.records if x.service == "decode" and x.level in ("ERROR", "CRITICAL")] if t else []
        evidence += [r, *decode[:1]]
    return [finding(
        "choices.stream_without_done", "error",
        f"{len(cut)} stream(s) broke mid-way: decode's stream ended without data: [DONE]",
        "Decode failed after the first tokens were relayed. The router ends such a stream with an in-band error "
        "event (the OpenAI SDK raises APIError; a client that only reads choices sees a chunk without them, and one "
        "behind another proxy may see the stream simply stop). Decode said: "
        f"{(cut[0][events.ERROR] or '')[:200]}",
        "docker compose logs decode --since 10m; fix the decode error; clients should treat a stream that ends "
        "without [DONE] as failed and retry",
        evidence, [r.request_id for r in cut])]


def _usage_chunk(ctx: Context, client: list) -> list[Finding]:
    chunks = ctx.by_event(events.ROUTER_USAGE_CHUNK)
    unasked = [r for r in chunks if r[events.CLIENT_ASKED] is False]
    out: list[Finding] = []
    if unasked:
        out.append(finding(
            "choices.usage_chunk_unasked", "error",
            f"The router sent a usage chunk with empty choices to {len(unasked)} stream(s) that did not ask for it",
            "Only clients that send stream_options.include_usage expect a final chunk with `choices: []`; others "
            "index choices[0] and fail with `list index out of range`.",
            "router: send the usage chunk only when the client asked include_usage (drop it otherwise)",
            client[:2] + unasked, [r.request_id for r in unasked]))
    index_errors = ctx.client_kinds("choices_index")
    # router.scheduled names a request's stream flag (older routers logged it on router.request_received).
    streams = [r for r in ctx.by_event(events.ROUTER_SCHEDULED, events.ROUTER_REQUEST_RECEIVED) if r[events.STREAM]]
    if index_errors and not unasked and (chunks or streams):
        out.append(finding(
            "choices.empty_choices_chunk", "warning",
            "The client indexes choices[0] on a stream chunk whose choices is empty",
            "With stream_options.include_usage the last chunk before [DONE] carries only usage and "
            "`choices: []` (OpenAI spec); a client doing chunk.choices[0] raises IndexError: list index out of "
            "range on it.",
            "in the client: `for chunk in stream: if not chunk.choices: continue` (read chunk.usage there), or do "
            "not ask include_usage",
            index_errors[:2] + (chunks or streams)[:2], [r.request_id for r in chunks]))
    return out


def _error_body(ctx: Context, client: list) -> list[Finding]:
    failed = [t for t in ctx.timelines.values() if (t.status or 0) >= 400]
    if not failed:
        return []
    statuses = Counter(t.status for t in failed)
    evidence = list(client[:2])
    for t in failed[:3]:
        evidence += [r for r in t.records if r.service == "router" and r.level in ("WARNING", "ERROR")][:1]
        evidence += t.events(events.ROUTER_REQUEST_DONE, events.HTTP_ACCESS)[:1]
    return [finding(
        "choices.error_body", "error",
        "An error body reached a client that read choices (router answered "
        + ", ".join(f"{s} ×{n}" for s, n in sorted(statuses.items())) + ")",
        "The router answered an error ({\"error\": {\"message\", \"type\", …}}) with a 4xx/5xx status and the "
        "client indexed response['choices'] anyway. The other findings say why the router answered an error.",
        "client: check the HTTP status (the SDKs raise APIStatusError) or the \"error\" key before reading "
        "choices; then fix the error the router reported",
        evidence, [t.request_id for t in failed])]
