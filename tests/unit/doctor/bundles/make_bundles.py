"""Writes the log bundles in this folder: lines shaped exactly as our services log them.

Each line is what stack.common.logging emits (flat JSON: ts, level, service, event, request_id, msg,
fields per stack/common/events.py), then wrapped the way `docker compose logs` prints it (v2
`router-1  | `, v1 `proj_router_1 | `, with or without --timestamps). Decode's clock runs 3 s
behind in the compose bundles; garbage lines (binary noise, truncated JSON, tracebacks) are mixed
in. Re-run after changing the shapes: `python tests/unit/doctor/bundles/make_bundles.py`.
"""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

HERE = Path(__file__).parent
T0 = datetime(2026, 11, 29, 20, 31, 0, tzinfo=timezone.utc)
BYTES_PER_TOKEN = 2048  # 2 (K,V) × 4 layers × 2 kv heads × 32 head_dim × 4 bytes
FINGERPRINT = "llama-tiny-seed0-4c1f9a2e"
SKEW = {"decode": timedelta(seconds=-3)}  # decode's clock is 3 s behind


class Log:
    """Collects (true time, service, line dict) and writes them in one of the compose formats."""

    def __init__(self, skew: dict[str, timedelta] | None = None) -> None:
        self.lines: list[tuple[datetime, int, str, dict | str]] = []
        self.now = T0
        self.skew = SKEW if skew is None else skew

    def tick(self, ms: float) -> None:
        self.now += timedelta(milliseconds=ms)

    def ev(self, service: str, event: str, msg: str, rid: str = "-", level: str = "INFO", **fields) -> None:
        clock = self.now + self.skew.get(service, timedelta())
        line = {"ts": clock.isoformat(timespec="milliseconds").replace("+00:00", "Z"), "level": level,
                "service": service, "event": event, "request_id": rid, "msg": msg, **fields}
        self.lines.append((self.now, len(self.lines), service, line))
        self.tick(0.4)

    def raw(self, service: str, text: str) -> None:
        self.lines.append((self.now, len(self.lines), service, text))

    def render(self, style: str) -> list[str]:
        out = []
        for when, _, service, line in sorted(self.lines, key=lambda x: (x[0], x[1])):
            text = json.dumps(line, ensure_ascii=False) if isinstance(line, dict) else line
            stamp = when.strftime("%Y-%m-%dT%H:%M:%S.%f") + "123Z"  # the daemon's clock, not the container's
            if style == "raw":
                out.append(text)
            elif style == "v2":
                out.append(f"{service + '-1':<10}| {text}")
            elif style == "v2ts":
                out.append(f"{service + '-1':<10}| {stamp} {text}")
            elif style == "v1ts":
                out.append(f"{'pd_' + service + '_1':<14}| {stamp} {text}")
            elif style == "v1":
                out.append(f"{'pd_' + service + '_1':<14}| {text}")
        return out

    def write(self, name: str, style: str) -> None:
        (HERE / name).write_text("\n".join(self.render(style)) + "\n", encoding="utf-8")

    def write_split(self, folder: str) -> None:
        (HERE / folder).mkdir(exist_ok=True)
        for service in ("router", "prefill", "decode"):
            mine = Log(self.skew)
            mine.lines = [x for x in self.lines if x[2] == service]
            (HERE / folder / f"{service}.log").write_text("\n".join(mine.render("raw")) + "\n", encoding="utf-8")


def startup(log: Log, kv_port: int = 9100, buffer: float = 8e9, decode_fp: str = FINGERPRINT,
            router_key: bool = True) -> None:
    log.ev("decode", "service.starting", "engine starting", config="stack/decode/config.json", role="decode",
           fingerprint=decode_fp)
    log.ev("decode", "kv_consumer.listening", f"KV listener on :{kv_port}", kv_port=kv_port, kv_buffer_size=buffer)
    log.ev("decode", "service.ready", "serving", warmup_ms=812.4)
    log.ev("prefill", "service.starting", "engine starting", config="stack/prefill/config.json", role="prefill",
           fingerprint=FINGERPRINT)
    log.ev("prefill", "service.ready", "serving", warmup_ms=790.1)
    log.ev("router", "service.starting", "router starting", config="stack/router/settings.toml")
    if not router_key:
        log.ev("router", "auth.key_missing", "TAOTOKEN_API_KEY is not set: every request will be rejected",
               level="WARNING", key_name="default", env_var="TAOTOKEN_API_KEY")
    log.ev("router", "backend.health", "prefill up", backend="http://prefill:8000", role="prefill", state="up",
           was="down")
    log.ev("router", "backend.health", "decode up", backend="http://decode:8000", role="decode", state="up",
           was="down")
    log.ev("router", "service.ready", "serving", warmup_ms=15.0)
    log.tick(1000)


def request(log: Log, n: int, prompt: int = 40, completion: int = 16, stream: bool = True, fate: str = "ok",
            kv_addr: str = "decode:9100", buffer: float = 8e9) -> str:
    """One chat request through router → prefill → KV → decode; `fate` picks how it breaks."""
    rid = f"req-{n:04d}-{random.Random(n).getrandbits(32):08x}"
    tid = f"kv-{rid[4:]}"
    nbytes = prompt * BYTES_PER_TOKEN
    log.ev("router", "router.request_received", "POST /v1/chat/completions", rid, api="chat", model="tiny",
           stream=stream)
    log.ev("router", "auth.accepted", "key accepted", rid, key_name="default")
    log.ev("router", "router.scheduled", "prefill → decode", rid, prefill="http://prefill:8000",
           decode="http://decode:8000", policy="load_aware", mode="disaggregated", attempt=1)
    log.ev("prefill", "engine.request_received", "request", rid, prompt_tokens=prompt, max_tokens=1, stream=False,
           role="prefill")
    log.tick(prompt * 0.8)
    log.ev("prefill", "engine.prefill_done", f"prefilled {prompt} tokens", rid, prompt_tokens=prompt,
           prefill_ms=round(prompt * 0.8, 2))
    log.ev("prefill", "kv_producer.sending", f"pushing KV to {kv_addr}", rid, transfer_id=tid, decode_kv_addr=kv_addr,
           num_tokens=prompt, bytes=nbytes)
    if fate == "port_mismatch":
        log.ev("prefill", "kv_producer.connect_failed", f"cannot connect to {kv_addr}", rid, level="ERROR",
               transfer_id=tid, decode_kv_addr=kv_addr, error="[Errno 111] Connection refused")
    elif fate == "unreachable":
        log.tick(3000)
        log.ev("prefill", "kv_producer.connect_failed", f"cannot connect to {kv_addr}", rid, level="ERROR",
               transfer_id=tid, decode_kv_addr=kv_addr, error="timed out")
    elif fate == "buffer_full":
        log.ev("decode", "kv_consumer.buffer_full", f"transfer of {nbytes} bytes exceeds kv_buffer_size {buffer:.0f}",
               level="ERROR", transfer_id=tid, bytes=nbytes, kv_buffer_size=buffer, buffer_used=0)
        log.ev("prefill", "kv_producer.rejected", "decode refused the KV", rid, level="ERROR", transfer_id=tid,
               reason="buffer_full", detail=f"{nbytes} bytes > kv_buffer_size {buffer:.0f}")
    elif fate == "fingerprint":
        log.ev("decode", "kv_consumer.fingerprint_mismatch", "model fingerprint differs", level="ERROR",
               transfer_id=tid, local="llama-tiny-seed1-77d0b3c1", remote=FINGERPRINT)
        log.ev("prefill", "kv_producer.rejected", "decode refused the KV", rid, level="ERROR", transfer_id=tid,
               reason="fingerprint_mismatch", detail="llama-tiny-seed1-77d0b3c1 != " + FINGERPRINT)
    elif fate == "never_sent":
        pass  # prefill computed but never pushed (e.g. its KV thread died): nothing logged
    else:
        log.tick(nbytes / 1e6)
        log.ev("decode", "kv_consumer.received", f"received {prompt} tokens of KV", transfer_id=tid,
               num_tokens=prompt, bytes=nbytes, peer="172.18.0.3:41822")
        log.ev("prefill", "kv_producer.sent", f"pushed {prompt} tokens of KV to {kv_addr}", rid, transfer_id=tid,
               decode_kv_addr=kv_addr, num_tokens=prompt, bytes=nbytes, transfer_ms=round(nbytes / 1e6, 2),
               gbps=round(nbytes * 8 / 1e9 / max(nbytes / 1e9, 1e-6), 2))
    log.ev("prefill", "engine.request_finished", "done", rid, prompt_tokens=prompt, completion_tokens=1,
           finish_reason="length", e2e_ms=round(prompt * 0.8 + 2, 2))
    log.ev("prefill", "http.access", "POST /v1/chat/completions 200", rid, method="POST",
           path="/v1/chat/completions", status=200, duration_ms=round(prompt * 0.8 + 3, 2))
    log.ev("router", "router.prefill_done", "prefill answered", rid, prefill="http://prefill:8000",
           prefill_ms=round(prompt * 0.8 + 4, 2), transfer_id=tid)
    log.ev("router", "router.kv_handoff", "decode leg", rid, decode="http://decode:8000", transfer_id=tid,
           kv_transfer_params=["do_remote_decode", "do_remote_prefill", "transfer_id", "num_tokens", "remote_host",
                               "remote_port"])
    log.ev("decode", "engine.request_received", "request", rid, prompt_tokens=prompt, max_tokens=completion,
           stream=stream, role="decode")
    if fate in ("port_mismatch", "unreachable", "never_sent", "buffer_full", "fingerprint", "decode_500"):
        if fate == "decode_500":
            log.ev("decode", "kv_consumer.claimed", "KV claimed", rid, transfer_id=tid, wait_ms=0.3)
            log.ev("decode", "http.error", "internal error", rid, level="ERROR", status=500, type="server_error",
                   message="RuntimeError: sampling produced NaN logits", exc="RuntimeError: sampling produced NaN")
            log.raw("decode", "Traceback (most recent call last):")
            log.raw("decode", '  File "/app/stack/engine/sampling.py", line 41, in sample')
            log.raw("decode", "RuntimeError: sampling produced NaN logits")
            status, error = 500, "server_error: sampling produced NaN logits"
        else:
            if fate in ("port_mismatch", "unreachable", "never_sent"):
                log.tick(5000)
                log.ev("decode", "kv_consumer.timeout", "no KV within 5000 ms", rid, level="ERROR", transfer_id=tid,
                       waited_ms=5000, kv_transfer_timeout_ms=5000)
            log.ev("decode", "http.error", "KV transfer failed", rid, level="ERROR", status=504,
                   type="upstream_timeout", message=f"KV for transfer {tid} did not arrive")
            status, error = 504, "upstream_timeout: KV transfer failed"
        log.ev("decode", "http.access", f"POST /v1/chat/completions {status}", rid, method="POST",
               path="/v1/chat/completions", status=status, duration_ms=5001.2)
        log.ev("router", "router.upstream_error", "decode answered an error", rid, level="ERROR",
               backend="http://decode:8000", status=status,
               body=json.dumps({"error": {"message": error, "type": "server_error", "param": None, "code": None}}))
        log.ev("router", "router.decode_failed", "decode failed", rid, level="ERROR", decode="http://decode:8000",
               status=status, error=error, mid_stream=False)
        log.ev("router", "router.request_done", "answered 502", rid, level="WARNING", status=502, prompt_tokens=prompt,
               completion_tokens=0, e2e_ms=5010.0)
        log.ev("router", "http.access", "POST /v1/chat/completions 502", rid, method="POST",
               path="/v1/chat/completions", status=502, duration_ms=5010.0)
        log.tick(50)
        return rid
    log.ev("decode", "kv_consumer.claimed", "KV claimed", rid, transfer_id=tid, wait_ms=0.3)
    log.ev("decode", "engine.first_token", "first token", rid, ttft_ms=1.2)
    log.ev("router", "router.decode_first_token", "first token relayed", rid, decode="http://decode:8000",
           ttft_ms=round(prompt * 0.8 + 8, 2))
    log.tick(completion * 4)
    if fate == "mid_stream":
        log.ev("decode", "http.error", "decode loop crashed", rid, level="ERROR", status=500, type="server_error",
               message="MemoryError: KV block pool exhausted")
        log.ev("router", "router.decode_failed", "decode stream broke", rid, level="ERROR",
               decode="http://decode:8000", status=200, error="upstream closed the stream after 5 chunks",
               mid_stream=True)
        log.ev("router", "router.request_done", "stream cut", rid, level="WARNING", status=200, prompt_tokens=prompt,
               completion_tokens=5, e2e_ms=80.0)
        log.ev("router", "http.access", "POST /v1/chat/completions 200", rid, method="POST",
               path="/v1/chat/completions", status=200, duration_ms=80.0)
        return rid
    log.ev("decode", "engine.request_finished", "done", rid, prompt_tokens=prompt, completion_tokens=completion,
           finish_reason="length", e2e_ms=completion * 4.0)
    log.ev("decode", "http.access", "POST /v1/chat/completions 200", rid, method="POST", path="/v1/chat/completions",
           status=200, duration_ms=completion * 4.0 + 1)
    if fate == "usage_chunk":
        log.ev("router", "router.usage_chunk", "usage chunk sent", rid, client_asked=True, prompt_tokens=prompt,
               completion_tokens=completion)
    log.ev("router", "router.request_done", "answered 200", rid, status=200, prompt_tokens=prompt,
           completion_tokens=completion, e2e_ms=round(prompt * 0.8 + completion * 4 + 12, 2))
    log.ev("router", "http.access", "POST /v1/chat/completions 200", rid, method="POST", path="/v1/chat/completions",
           status=200, duration_ms=round(prompt * 0.8 + completion * 4 + 13, 2))
    log.tick(30)
    return rid


def rejected(log: Log, n: int, reason: str, header: str = "authorization") -> str:
    rid = f"req-{n:04d}-{random.Random(n).getrandbits(32):08x}"
    log.ev("router", "router.request_received", "POST /v1/chat/completions", rid, api="chat", model="tiny",
           stream=False)
    log.ev("router", "auth.rejected", f"401: {reason}", rid, level="WARNING", reason=reason, header=header)
    log.ev("router", "router.request_done", "answered 401", rid, level="WARNING", status=401, prompt_tokens=0,
           completion_tokens=0, e2e_ms=0.4)
    log.ev("router", "http.access", "POST /v1/chat/completions 401", rid, method="POST", path="/v1/chat/completions",
           status=401, duration_ms=0.5)
    log.tick(20)
    return rid


def limited(log: Log, n: int, quota: bool) -> str:
    rid = f"req-{n:04d}-{random.Random(n).getrandbits(32):08x}"
    log.ev("router", "router.request_received", "POST /v1/chat/completions", rid, api="chat", model="tiny", stream=True)
    log.ev("router", "auth.accepted", "key accepted", rid, key_name="default")
    if quota:
        log.ev("router", "limit.quota_exhausted", "token quota used up", rid, level="WARNING", key_name="default",
               used=100204, quota=100000)
    else:
        log.ev("router", "limit.rate_limited", "rpm limit", rid, level="WARNING", key_name="default", limit="rpm",
               current=61, maximum=60)
    log.ev("router", "router.request_done", "answered 429", rid, level="WARNING", status=429, prompt_tokens=0,
           completion_tokens=0, e2e_ms=0.3)
    log.ev("router", "http.access", "POST /v1/chat/completions 429", rid, method="POST", path="/v1/chat/completions",
           status=429, duration_ms=0.4)
    log.tick(20)
    return rid


GARBAGE = ["\x00\x17\x9b\x02\x7f\x10binary", '{"ts": "2026-11-29T20:31:07.000Z", "level": "INFO", "service": "rou',
           "Traceback (most recent call last):"]


def main() -> None:
    log = Log()
    startup(log)
    for n in range(1, 6):
        request(log, n, prompt=30 + 10 * n)
    log.raw("router", GARBAGE[0])
    log.raw("prefill", GARBAGE[1])
    log.raw("decode", GARBAGE[2])
    log.raw("decode", '  File "/app/stack/engine/server.py", line 88, in handle')
    log.write("healthy_v2ts.log", "v2ts")
    log.write("healthy_v1.log", "v1")
    log.write_split("healthy_split")

    log = Log()
    startup(log, router_key=False)
    for n in range(1, 4):
        rejected(log, n, "no_keys_configured")
    log.write("router_key_missing.log", "v1ts")

    log = Log()
    startup(log)
    request(log, 1)
    rejected(log, 2, "missing")
    rejected(log, 3, "whitespace")
    rejected(log, 4, "unknown")
    rejected(log, 5, "unknown", header="x-api-key")
    limited(log, 6, quota=False)
    limited(log, 7, quota=True)
    log.write("auth_mixed.log", "v2")

    log = Log()
    startup(log)
    request(log, 1)
    request(log, 2, fate="decode_500")
    request(log, 3, fate="decode_500")
    log.write("decode_failed.log", "v2ts")

    log = Log()
    startup(log)
    request(log, 1, fate="mid_stream")
    log.write("stream_cut.log", "v2")

    log = Log()
    startup(log, kv_port=9200)
    request(log, 1, fate="port_mismatch")
    request(log, 2, fate="port_mismatch")
    log.write("kv_port_mismatch.log", "v2ts")

    log = Log()
    startup(log)
    request(log, 1)
    request(log, 2, fate="unreachable")
    log.write("kv_unreachable.log", "v1ts")

    log = Log()
    startup(log, buffer=262144)
    request(log, 1, prompt=40, buffer=262144)
    request(log, 2, prompt=100, buffer=262144)
    request(log, 3, prompt=1800, fate="buffer_full", buffer=262144)
    request(log, 4, prompt=4000, fate="buffer_full", buffer=262144)
    log.write("kv_buffer_full.log", "v2")

    log = Log()
    startup(log)
    request(log, 1, fate="never_sent")
    log.write("kv_timeout.log", "v2")

    log = Log()
    startup(log, decode_fp="llama-tiny-seed1-77d0b3c1")
    request(log, 1, fate="fingerprint")
    log.write("kv_model_mismatch.log", "v2ts")

    log = Log()
    startup(log)
    request(log, 1, fate="usage_chunk")
    log.write("usage_chunk.log", "v2")

    log = Log()
    startup(log)
    log.lines = [x for x in log.lines if x[2] != "router"]  # the router never started
    log.write("router_down.log", "v2")


if __name__ == "__main__":
    main()
