"""KV transfer failures between prefill (kv_producer) and decode (kv_consumer).

Causes told apart:
- kv_port mismatch: kv_producer.connect_failed to decode:X (refused) while decode's
  kv_consumer.listening says kv_port Y;
- KV port unreachable (network cut, firewall, DNS): connect_failed with a timeout / no route error,
  or kv_consumer.incomplete (connection closed mid-payload);
- transfers larger than kv_buffer_size: kv_consumer.buffer_full / kv_producer.rejected buffer_full,
  with the prompt sizes that failed vs the largest that succeeded (kv_producer.sent num_tokens);
- decode waited and timed out: kv_consumer.timeout with no kv_producer.sent for that transfer;
- different model versions: kv_consumer.fingerprint_mismatch / kv_producer.rejected fingerprint_mismatch
  (and differing `fingerprint` facts in prefill's and decode's service.starting lines).
"""

from __future__ import annotations

import math
import re

from doctor.findings import Context, Finding, finding
from doctor.parse import Record
from stack.common import events

_REFUSED = re.compile(r"refused|errno 111|ECONNREFUSED", re.I)
_UNREACHABLE = re.compile(r"timed out|timeout|no route|unreachable|errno 11[03]|name or service|name resolution|"
                          r"nodename|not known|errno -[23]|reset by peer", re.I)
RESTART = "docker compose up -d decode prefill router"


def check(ctx: Context) -> list[Finding]:
    return _connect_failures(ctx) + _buffer_full(ctx) + _timeouts(ctx) + _model_mismatch(ctx) + _corrupt(ctx)


def _port(addr: str) -> int | None:
    match = re.search(r":(\d+)$", addr or "")
    return int(match.group(1)) if match else None


def _rids(records: list[Record]) -> list[str]:
    return [r.request_id for r in records]


def _connect_failures(ctx: Context) -> list[Finding]:
    failed = ctx.by_event(events.KV_PRODUCER_CONNECT_FAILED)
    listening = [r for r in ctx.by_event(events.KV_CONSUMER_LISTENING)]
    ports = {r.get("kv_port") for r in listening if isinstance(r.get("kv_port"), int)}
    router_side = ctx.by_event(events.ROUTER_DECODE_FAILED, events.ROUTER_PREFILL_FAILED)
    out: list[Finding] = []
    refused = [r for r in failed if _REFUSED.search(str(r.get("error", "")))]
    unreachable = [r for r in failed if r not in refused]
    if refused:
        addrs = sorted({str(r.get("decode_kv_addr")) for r in refused})
        pushed = {_port(a) for a in addrs}
        related = _same_requests(router_side, refused)
        if ports and not pushed & ports:
            out.append(finding(
                "kv.port_mismatch", "error",
                f"kv_port mismatch: prefill pushes KV to {', '.join(addrs)} but decode listens on "
                f"{', '.join(str(p) for p in sorted(ports))}",
                "Prefill connects to the decode KV address the router gave it and is refused: nothing listens on "
                "that port, because decode's kv_transfer_config.kv_port is different. The request fails: prefill "
                "answers 502, or decode waits for KV that never comes.",
                f"use one port everywhere: kv_transfer_config.kv_port in stack/decode/config.json and "
                f"stack/prefill/config.json, and KV_TRANSFER_PORT in .env (the router's decode_kv_addr) — e.g. "
                f"{sorted(ports)[0]}; then {RESTART}",
                refused[:3] + listening[:1] + related[:2], _rids(refused)))
        else:
            out.append(finding(
                "kv.port_closed", "error", f"Nothing accepts KV on {', '.join(addrs)} (connection refused)",
                "Prefill's KV push is refused: decode is not running there, has not started its KV listener, or "
                "listens on another port (no kv_consumer.listening line was found to compare).",
                f"docker compose logs decode | grep kv_consumer.listening; check kv_port in stack/decode/config.json "
                f"and KV_TRANSFER_PORT in .env; {RESTART}",
                refused[:3] + listening[:1] + related[:2], _rids(refused)))
    incomplete = ctx.by_event(events.KV_CONSUMER_INCOMPLETE)
    if unreachable or incomplete:
        addrs = sorted({str(r.get("decode_kv_addr")) for r in unreachable})
        host_port = addrs[0] if addrs else "decode:9100"
        host, _, port = host_port.rpartition(":")
        out.append(finding(
            "kv.unreachable", "error",
            f"The KV port is unreachable from prefill ({', '.join(addrs) or 'transfers cut mid-payload'})",
            "Prefill cannot open (or keep) a TCP connection to decode's KV port: a network problem between the "
            "two containers/hosts (network disconnected, firewall, wrong host, DNS), not a port number problem. "
            f"Error: {(unreachable or incomplete)[0].get('error', 'connection closed mid-payload')}",
            f"docker compose exec prefill python -c \"import socket; socket.create_connection(('{host}', {port or 9100}),"
            f" 3); print('ok')\"; docker network inspect <project>_default (both services attached?); open the "
            f"port in the firewall; {RESTART}",
            unreachable[:3] + incomplete[:2] + _same_requests(router_side, unreachable + incomplete)[:2],
            _rids(unreachable + incomplete)))
    return out


def _same_requests(candidates: list[Record], anchors: list[Record]) -> list[Record]:
    ids = {r.request_id for r in anchors} - {"-"}
    return [r for r in candidates if r.request_id in ids]


def _tokens_of(ctx: Context, record: Record) -> int | None:
    """The prompt size of the request a KV record belongs to (from the KV lines or the engine)."""
    if isinstance(record.get("num_tokens"), int):
        return record.get("num_tokens")
    t = ctx.timelines.get(record.request_id)
    if t is None:
        return None
    for r in t.records:
        for field in ("num_tokens", "prompt_tokens"):
            if isinstance(r.get(field), int) and r.service in ("prefill", "decode", "engine"):
                return r.get(field)
    return None


def _buffer_full(ctx: Context) -> list[Finding]:
    full = ctx.by_event(events.KV_CONSUMER_BUFFER_FULL)
    rejected = [r for r in ctx.by_event(events.KV_PRODUCER_REJECTED) if r.get("reason") == "buffer_full"]
    if not full and not rejected:
        return []
    sizes = [r.get("bytes") for r in full if isinstance(r.get("bytes"), int)]
    buffer = next((r.get("kv_buffer_size") for r in full if r.get("kv_buffer_size")), None)
    if buffer is None:
        buffer = next((r.get("kv_buffer_size") for r in ctx.by_event(events.KV_CONSUMER_LISTENING)), None)
    failed_tokens = sorted({n for r in full + rejected if (n := _tokens_of(ctx, r)) is not None})
    sent = ctx.by_event(events.KV_PRODUCER_SENT)
    ok_tokens = [r.get("num_tokens") for r in sent if isinstance(r.get("num_tokens"), int)]
    biggest = max(sizes) if sizes else None
    prompts = (f" Failed prompts: {', '.join(map(str, failed_tokens))} tokens" if failed_tokens else "") + \
              (f"; the largest that went through: {max(ok_tokens)} tokens." if ok_tokens else ".")
    need = f"{biggest} bytes" if biggest else "the failed transfer size"
    suggested = _suggest(biggest, buffer)
    return [finding(
        "kv.buffer_too_small", "error",
        f"KV transfers larger than decode's kv_buffer_size ({biggest or '?'} bytes > {buffer or '?'} bytes)",
        "Decode's KV receive buffer (kv_transfer_config.kv_buffer_size) cannot hold the transfer, so it is "
        "refused and the request fails — typically only long prompts, whose KV grows with the prompt." + prompts,
        f"raise kv_transfer_config.kv_buffer_size in stack/decode/config.json above {need} times the concurrent "
        f"transfers (e.g. {suggested}), then docker compose up -d decode",
        full[:3] + rejected[:2] + sent[-1:], _rids(full + rejected))]


def _suggest(biggest: int | None, buffer: float | None) -> str:
    """A round number of bytes (like the article's 8e9) at least 8× the largest failed transfer."""
    if not biggest:
        return "8e9"
    mantissa, exponent = f"{max(biggest * 8, (buffer or 0) * 2):e}".split("e")
    return f"{math.ceil(float(mantissa))}e{int(exponent)}"


def _timeouts(ctx: Context) -> list[Finding]:
    explained = {r.get("transfer_id") for r in ctx.by_event(
        events.KV_PRODUCER_CONNECT_FAILED, events.KV_PRODUCER_REJECTED, events.KV_PRODUCER_FAILED,
        events.KV_CONSUMER_BUFFER_FULL, events.KV_CONSUMER_FINGERPRINT_MISMATCH, events.KV_CONSUMER_INCOMPLETE,
        events.KV_CONSUMER_CHECKSUM_MISMATCH)}
    sent = {r.get("transfer_id"): r for r in ctx.by_event(events.KV_PRODUCER_SENT)}
    waits = [r for r in ctx.by_event(events.KV_CONSUMER_TIMEOUT) if r.get("transfer_id") not in explained]
    if not waits:
        return []
    never = [r for r in waits if r.get("transfer_id") not in sent]
    late = [r for r in waits if r.get("transfer_id") in sent]
    out: list[Finding] = []
    if never:
        prefill = [r for r in ctx.records if r.service == "prefill" and r.request_id in {w.request_id for w in never}]
        out.append(finding(
            "kv.timeout_never_sent", "error",
            f"Decode timed out waiting for KV that prefill never sent ({len(never)} transfer(s), "
            f"{never[0].get('waited_ms', '?')} ms)",
            "Decode claimed the transfer and waited kv_transfer_timeout_ms, but no kv_producer.sent exists for it: "
            "prefill did not push (it failed, was given another decode_kv_addr, or its logs show why).",
            "docker compose logs prefill | grep -E 'kv_producer|ERROR'; check that the router's decode_kv_addr "
            "(KV_TRANSFER_PORT) is decode's kv_port; " + RESTART,
            never[:3] + prefill[:2], _rids(never)))
    if late:
        pairs = [x for r in late[:3] for x in (sent[r.get("transfer_id")], r)]
        out.append(finding(
            "kv.timeout_slow", "warning",
            f"KV arrived, but after decode's kv_transfer_timeout_ms ({len(late)} transfer(s))",
            "Prefill pushed the KV but decode had already given up: the transfer (or prefill under load) is slower "
            "than the timeout.",
            "raise kv_transfer_timeout_ms ([scheduler] in stack/router/settings.toml / the decode config) or add "
            "prefill capacity",
            pairs, _rids(late)))
    return out


def _model_mismatch(ctx: Context) -> list[Finding]:
    mismatched = ctx.by_event(events.KV_CONSUMER_FINGERPRINT_MISMATCH) + [
        r for r in ctx.by_event(events.KV_PRODUCER_REJECTED) if r.get("reason") == "fingerprint_mismatch"]
    starting = {r.service: r for r in ctx.by_event(events.SERVICE_STARTING) if r.get("fingerprint")}
    differ = ("prefill" in starting and "decode" in starting
              and starting["prefill"].get("fingerprint") != starting["decode"].get("fingerprint"))
    if not mismatched and not differ:
        return []
    first = next((r for r in mismatched if r.get("local")), None)
    detail = (f" Decode's model is {first.get('local')}, prefill's KV came from {first.get('remote')}."
              if first else "")
    return [finding(
        "kv.model_mismatch", "error", "Prefill and decode run different model versions",
        "The KV header's model fingerprint differs from decode's own: the two engines load different "
        "checkpoints (or seeds), so the KV cache is meaningless to decode and is refused." + detail,
        "point `model` (checkpoint / seed) in stack/prefill/config.json and stack/decode/config.json at the same "
        "version, then docker compose up -d --force-recreate prefill decode",
        mismatched[:3] + [starting[s] for s in ("prefill", "decode") if s in starting and differ],
        _rids(mismatched))]


def _corrupt(ctx: Context) -> list[Finding]:
    bad = ctx.by_event(events.KV_CONSUMER_CHECKSUM_MISMATCH) + [
        r for r in ctx.by_event(events.KV_PRODUCER_REJECTED) if r.get("reason") == "checksum"]
    if not bad:
        return []
    return [finding(
        "kv.checksum_mismatch", "error", f"{len(bad)} KV transfer(s) arrived corrupted (checksum mismatch)",
        "The bytes decode received do not match prefill's checksum: truncation or corruption on the way.",
        "check the network between prefill and decode (MTU, proxies on the KV port); " + RESTART,
        bad[:3], _rids(bad))]
