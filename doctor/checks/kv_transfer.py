"""KV transfer failures between prefill (kv_producer) and decode (kv_consumer).

Causes told apart:
- kv_port mismatch: kv_producer.connect_failed to decode:X (refused) while decode's
  kv_consumer.listening says kv_port Y (the router gave prefill another port than decode's own);
- KV port unreachable (network cut, firewall, DNS): connect_failed with a timeout / no route error,
  or kv_consumer.incomplete (connection closed mid-payload) of a request its caller had not abandoned;
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
# How to read decode's own KV port when no kv_consumer.listening line was collected.
ASK_DECODE = ("docker compose exec decode python -c \"import urllib.request; "
              "print(urllib.request.urlopen('http://localhost:8000/health').read().decode())\" (its kv_port)")


def check(ctx: Context) -> list[Finding]:
    reported = _reported_mismatch(ctx)
    refused = [f for f in _connect_failures(ctx) if not (reported and f.id == "kv.port_mismatch")]
    return reported + refused + _buffer_full(ctx) + _timeouts(ctx) + _model_mismatch(ctx) + _corrupt(ctx)


def _reported_mismatch(ctx: Context) -> list[Finding]:
    """The router was given a KV port (KV_TRANSFER_PORT or a kv_addrs port) that decode does not use.
    The router says so itself (router.kv_port_mismatch) and pushes to decode's own port, so requests work;
    the override is dead config that misleads whoever reads it (and breaks a router that cannot ask)."""
    mismatches = ctx.by_event(events.ROUTER_KV_PORT_MISMATCH)
    if not mismatches:
        return []
    first = mismatches[0]
    configured, used = first[events.CONFIGURED_PORT], first[events.REPORTED_PORT]
    source = first[events.CONFIGURED_BY] or "the router's settings"
    listening = ctx.by_event(events.KV_CONSUMER_LISTENING)
    where = ("KV_TRANSFER_PORT in .env (or the router's environment)" if source == "KV_TRANSFER_PORT" else source)
    return [finding(
        "kv.port_mismatch", "warning",
        f"kv_port mismatch: the router was given {configured} ({source}) but decode listens on {used} "
        f"({first[events.REPORTED_BY] or 'its GET /health'}); the router uses {used}",
        "The router learns each decode's KV port from the decode itself, so KV still moves; the other value is "
        "stale configuration. Anything that trusts it (a script, a firewall rule, another router version) "
        "points at a port nothing listens on.",
        f"make the two agree: remove or correct {where} (= {configured}), or set kv_transfer_config.kv_port "
        f"in decode/config.json to the port you mean (now {used}); then {RESTART}",
        mismatches[:2] + listening[:1])]


def _host_port(addr: str | None) -> tuple[str, int] | None:
    match = re.fullmatch(r"(.+):(\d+)", addr or "")
    return (match.group(1), int(match.group(2))) if match else None


def _rids(records: list[Record]) -> list[str]:
    return [r.request_id for r in records]


def _connect_failures(ctx: Context) -> list[Finding]:
    failed = ctx.by_event(events.KV_PRODUCER_CONNECT_FAILED)
    listening = ctx.by_event(events.KV_CONSUMER_LISTENING)
    ports = {r[events.KV_PORT] for r in listening} - {None}  # decode's own word on its KV port
    router_side = ctx.by_event(events.ROUTER_DECODE_FAILED, events.ROUTER_PREFILL_FAILED)
    out: list[Finding] = []
    refused = [r for r in failed if _REFUSED.search(r[events.ERROR] or "")]
    unreachable = [r for r in failed if r not in refused]
    if refused:
        addrs = sorted({r[events.DECODE_KV_ADDR] or "?" for r in refused})
        pushed = {hp[1] for a in addrs if (hp := _host_port(a))}
        related = _same_requests(router_side, refused)
        if ports and not pushed & ports:
            port = sorted(ports)[0]
            out.append(finding(
                "kv.port_mismatch", "error",
                f"kv_port mismatch: prefill pushes KV to {', '.join(addrs)} but decode listens on "
                f"{', '.join(str(p) for p in sorted(ports))}",
                "Prefill connects to the decode KV address the router gave it and is refused: nothing listens on "
                "that port, because decode's KV listener is on another one (a KV_TRANSFER_PORT the router was given "
                "that decode does not use, or a router that has not seen decode's new port). The request fails: "
                "prefill answers 502, or decode waits for KV that never comes.",
                f"let the router use decode's port {port}: set KV_TRANSFER_PORT={port} in .env (it sets decode's "
                f"listener too), or unset it so the router takes the kv_port decode reports on GET /health "
                f"(kv_transfer_config.kv_port in decode/config.json); then {RESTART}",
                refused[:3] + listening[:1] + related[:2], _rids(refused)))
        else:
            out.append(finding(
                "kv.port_closed", "error", f"Nothing accepts KV on {', '.join(addrs)} (connection refused)",
                "Prefill's KV push is refused: decode is not running there, has not started its KV listener, or "
                "listens on another port" + ("" if ports else " (no kv_consumer.listening line was found to compare)")
                + ".",
                f"docker compose logs decode | grep kv_consumer.listening, or {ASK_DECODE}; compare with "
                f"kv_transfer_config.kv_port in decode/config.json and KV_TRANSFER_PORT in .env; {RESTART}",
                refused[:3] + listening[:1] + related[:2], _rids(refused)))
    # A transfer cut because its request's caller left (an engine logged it abandoned; the prefill then stopped its
    # push) is long_prompt.abandoned's, not the network's: a push the network cuts fails the prefill's leg instead.
    # Found by killing the router under agent-sized streams. Matched by request id: the services' clocks may differ.
    abandoned = {r.request_id for r in ctx.by_event(events.ENGINE_REQUEST_ABANDONED)} - {"-"}
    incomplete = [r for r in ctx.by_event(events.KV_CONSUMER_INCOMPLETE) if r.request_id not in abandoned]
    if unreachable or incomplete:
        addrs = sorted({r[events.DECODE_KV_ADDR] or "?" for r in unreachable})
        target = next((hp for a in addrs if (hp := _host_port(a))), None)
        if target is None and ports:  # only cut transfers: decode's listener is the address
            target = ("decode", sorted(ports)[0])
        probe = (f"docker compose exec prefill python -c \"import socket; socket.create_connection(('{target[0]}', "
                 f"{target[1]}), 3); print('ok')\"" if target else
                 f"decode's KV port is not in these logs: {ASK_DECODE}, then from prefill: docker compose exec prefill "
                 f"python -c \"import socket; socket.create_connection(('decode', <kv_port>), 3); print('ok')\"")
        error = unreachable[0][events.ERROR] if unreachable else None
        out.append(finding(
            "kv.unreachable", "error",
            f"The KV port is unreachable from prefill ({', '.join(addrs) or 'transfers cut mid-payload'})",
            "Prefill cannot open (or keep) a TCP connection to decode's KV port: a network problem between the "
            "two containers/hosts (network disconnected, firewall, wrong host, DNS), not a port number problem. "
            f"Error: {error or 'connection closed mid-payload'}",
            f"{probe}; docker network inspect {ctx.facts.network_between('prefill', 'decode') or 'pd-deploy_kv'} "
            f"(both prefill and decode attached?); open the port in the firewall; {RESTART}",
            unreachable[:3] + incomplete[:2] + _same_requests(router_side, unreachable + incomplete)[:2],
            _rids(unreachable + incomplete)))
    return out


def _same_requests(candidates: list[Record], anchors: list[Record]) -> list[Record]:
    ids = {r.request_id for r in anchors} - {"-"}
    return [r for r in candidates if r.request_id in ids]


def _tokens_of(ctx: Context, record: Record) -> int | None:
    """The prompt size of the request a KV record belongs to (from the KV lines or the engine)."""
    if record.get(events.NUM_TOKENS) is not None:
        return record.get(events.NUM_TOKENS)
    t = ctx.timelines.get(record.request_id)
    if t is None:
        return None
    for r in t.records:
        if r.service in ("prefill", "decode", "engine"):
            for field in (events.NUM_TOKENS, events.PROMPT_TOKENS):
                if r.get(field) is not None:
                    return r.get(field)
    return None


def _buffer_full(ctx: Context) -> list[Finding]:
    full = ctx.by_event(events.KV_CONSUMER_BUFFER_FULL)
    rejected = [r for r in ctx.by_event(events.KV_PRODUCER_REJECTED) if r[events.REASON] == "buffer_full"]
    if not full and not rejected:
        return []
    sizes = [n for r in full + rejected if (n := r[events.BYTES]) is not None]
    buffer = next((b for r in full + rejected + ctx.by_event(events.KV_CONSUMER_LISTENING)
                   if (b := r[events.KV_BUFFER_SIZE])), None)
    failed_tokens = sorted({n for r in full + rejected if (n := _tokens_of(ctx, r)) is not None})
    sent = ctx.by_event(events.KV_PRODUCER_SENT)
    ok_tokens = [n for r in sent if (n := r[events.NUM_TOKENS]) is not None]
    biggest = max(sizes) if sizes else None
    prompts = (f" Failed prompts: {', '.join(map(str, failed_tokens))} tokens" if failed_tokens else "") + \
              (f"; the largest that went through: {max(ok_tokens)} tokens." if ok_tokens else ".")
    need = f"{biggest} bytes" if biggest else "the failed transfer size"
    suggested = _suggest(biggest, buffer)
    return [finding(
        "kv.buffer_too_small", "error",
        f"KV transfers larger than decode's kv_buffer_size ({biggest or '?'} bytes > {_bytes(buffer)} bytes)",
        "Decode's KV receive buffer (kv_transfer_config.kv_buffer_size) cannot hold the transfer, so it is "
        "refused and the request fails — typically only long prompts, whose KV grows with the prompt." + prompts,
        f"raise kv_transfer_config.kv_buffer_size in decode/config.json above {need} times the concurrent "
        f"transfers (e.g. {suggested}), then docker compose up -d decode",
        full[:3] + rejected[:2] + sent[-1:], _rids(full + rejected))]


def _bytes(size: float | None) -> str:
    return "?" if size is None else f"{size:.0f}"


def _suggest(biggest: int | None, buffer: float | None) -> str:
    """A round number of bytes (like the article's 8e9) at least 8× the largest failed transfer."""
    if not biggest:
        return "8e9"
    mantissa, exponent = f"{max(biggest * 8, (buffer or 0) * 2):e}".split("e")
    return f"{math.ceil(float(mantissa))}e{int(exponent)}"


def _timeouts(ctx: Context) -> list[Finding]:
    explained = {r[events.TRANSFER_ID] for r in ctx.by_event(
        events.KV_PRODUCER_CONNECT_FAILED, events.KV_PRODUCER_REJECTED, events.KV_PRODUCER_FAILED,
        events.KV_CONSUMER_BUFFER_FULL, events.KV_CONSUMER_FINGERPRINT_MISMATCH, events.KV_CONSUMER_INCOMPLETE,
        events.KV_CONSUMER_CHECKSUM_MISMATCH)}
    sent = {r[events.TRANSFER_ID]: r for r in ctx.by_event(events.KV_PRODUCER_SENT)}
    waits = [r for r in ctx.by_event(events.KV_CONSUMER_TIMEOUT) if r[events.TRANSFER_ID] not in explained]
    if not waits:
        return []
    never = [r for r in waits if r[events.TRANSFER_ID] not in sent]
    late = [r for r in waits if r[events.TRANSFER_ID] in sent]
    out: list[Finding] = []
    if never:
        prefill = [r for r in ctx.records if r.service == "prefill" and r.request_id in {w.request_id for w in never}]
        out.append(finding(
            "kv.timeout_never_sent", "error",
            f"Decode timed out waiting for KV that prefill never sent ({len(never)} transfer(s), "
            f"{_ms(never[0][events.WAITED_MS])} ms)",
            "Decode claimed the transfer and waited kv_transfer_timeout_ms, but no kv_producer.sent exists for it: "
            "prefill did not push (it failed, was given another decode_kv_addr, or its logs show why).",
            "docker compose logs prefill | grep -E 'kv_producer|ERROR'; check that the router's decode_kv_addr "
            "(KV_TRANSFER_PORT) is decode's kv_port; " + RESTART,
            never[:3] + prefill[:2], _rids(never)))
    if late:
        pairs = [x for r in late[:3] for x in (sent[r[events.TRANSFER_ID]], r)]
        out.append(finding(
            "kv.timeout_slow", "warning",
            f"KV arrived, but after decode's kv_transfer_timeout_ms ({len(late)} transfer(s))",
            "Prefill pushed the KV but decode had already given up: the transfer (or prefill under load) is slower "
            "than the timeout.",
            "raise kv_transfer_timeout_ms ([scheduler] in router/settings.toml and kv_transfer_config in "
            "decode/config.json) or add prefill capacity",
            pairs, _rids(late)))
    return out


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


def _model_mismatch(ctx: Context) -> list[Finding]:
    mismatched = ctx.by_event(events.KV_CONSUMER_FINGERPRINT_MISMATCH) + [
        r for r in ctx.by_event(events.KV_PRODUCER_REJECTED) if r[events.REASON] == "fingerprint_mismatch"]
    starting = {r.service: r for r in ctx.by_event(events.SERVICE_STARTING) if r[events.FINGERPRINT]}
    differ = ("prefill" in starting and "decode" in starting
              and starting["prefill"][events.FINGERPRINT] != starting["decode"][events.FINGERPRINT])
    # The router pairs only engines whose fingerprints agree: a decode with no prefill of its model serves alone.
    alone = ctx.by_event(events.ROUTER_VERSION_SPLIT)
    if not mismatched and not differ and not alone:
        return []
    first = next((r for r in mismatched if r[events.LOCAL]), None)
    detail = (f" Decode's model is {first[events.LOCAL]}, prefill's KV came from {first[events.REMOTE]}."
              if first else "")
    if alone:
        detail += (f" The router pairs only engines of one model, so {len(alone)} request(s) ran on decode alone, without"
                   f" disaggregation (router.model_version_split; decode's model {alone[-1][events.FINGERPRINT]}). During a"
                   " rolling model update (./pd swarm update) this is expected and ends with the update.")
    return [finding(
        "kv.model_mismatch", "error", "Prefill and decode run different model versions",
        "The KV header's model fingerprint differs from decode's own: the two engines load different "
        "checkpoints (or seeds), so the KV cache is meaningless to decode and is refused." + detail,
        "point `model` (checkpoint / seed) in prefill/config.json and decode/config.json at the same "
        "version, then docker compose up -d --force-recreate prefill decode",
        mismatched[:3] + alone[:2] + [starting[s] for s in ("prefill", "decode") if s in starting and differ],
        _rids(mismatched + alone))]


def _corrupt(ctx: Context) -> list[Finding]:
    bad = ctx.by_event(events.KV_CONSUMER_CHECKSUM_MISMATCH) + [
        r for r in ctx.by_event(events.KV_PRODUCER_REJECTED) if r[events.REASON] == "checksum_mismatch"]
    if not bad:
        return []
    return [finding(
        "kv.checksum_mismatch", "error", f"{len(bad)} KV transfer(s) arrived corrupted (checksum mismatch)",
        "The bytes decode received do not match prefill's checksum: truncation or corruption on the way.",
        "check the network between prefill and decode (MTU, proxies on the KV port); " + RESTART,
        bad[:3], _rids(bad))]
