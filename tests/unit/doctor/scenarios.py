"""The doctor's test bundles, written by the services' real `log_event` (so a renamed field breaks a test).

Each line is what stack.common.logging writes for the event and fields a service passes (checked
against stack/common/events.py in strict mode), with the time from a fake clock; the lines are then
wrapped the way `docker compose logs` prints them (v2 `router-1  | `, v1 `proj_router_1 | `, with
or without --timestamps). Decode's clock runs 3 s behind in the compose bundles; garbage lines
(binary noise, truncated JSON, traceback text) are mixed in. `write_bundles(folder)` writes them all.
"""

from __future__ import annotations

import io
import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

from loguru import logger

from stack.common import events
from stack.common.logging import log_event, request_context, setup_logging

T0 = datetime(2026, 11, 29, 20, 31, 0, tzinfo=timezone.utc)
BYTES_PER_TOKEN = 2048  # 2 (K,V) × 4 layers × 2 kv heads × 32 head_dim × 4 bytes
FINGERPRINT = "llama-tiny-seed0-4c1f9a2e"
SKEW = {"decode": timedelta(seconds=-3)}  # decode's clock is 3 s behind
PREFILL, DECODE = "http://prefill:8000", "http://decode:8000"
CHAT = "/v1/chat/completions"


class Log:
    """Lines as the services log them: (true time, order, service, the line) in one compose project."""

    def __init__(self, skew: dict[str, timedelta] | None = None) -> None:
        self.lines: list[tuple[datetime, int, str, str]] = []
        self.now = T0
        self.skew = SKEW if skew is None else skew

    def tick(self, ms: float) -> None:
        self.now += timedelta(milliseconds=ms)

    def _capture(self, service: str, rid: str, emit) -> None:
        sink = io.StringIO()
        clock = self.now + self.skew.get(service, timedelta())
        setup_logging(service, "DEBUG", sink=sink, clock=lambda: clock)
        with request_context(rid):
            emit()
        setup_logging("-")  # leave no test's sink or clock behind
        for line in sink.getvalue().splitlines():
            self.lines.append((self.now, len(self.lines), service, line))
        self.tick(0.4)

    def ev(self, service: str, event: events.Event, msg: str, rid: str = "-", level: str | None = None, **fields) -> None:
        """One log_event call by `service`, inside request `rid`, at the event's usual level unless given."""
        self._capture(service, rid, lambda: log_event(event, msg, level or event.level, **fields))

    def crash(self, service: str, error: Exception, rid: str, msg: str) -> None:
        """An unhandled exception, as the error middleware logs it (loguru, with the exception)."""
        def emit() -> None:
            try:
                raise error
            except type(error):
                logger.bind(event=events.HTTP_ERROR).opt(exception=True).error(msg)
        self._capture(service, rid, emit)

    def raw(self, service: str, text: str) -> None:
        """A line that is no log event: a traceback's text, binary noise, a truncated line."""
        self.lines.append((self.now, len(self.lines), service, text))

    def render(self, style: str) -> list[str]:
        out = []
        for when, _, service, text in sorted(self.lines, key=lambda x: (x[0], x[1])):
            stamp = when.strftime("%Y-%m-%dT%H:%M:%S.%f") + "123Z"  # the daemon's clock, not the container's
            out.append({"raw": text,
                        "v2": f"{service + '-1':<10}| {text}",
                        "v2ts": f"{service + '-1':<10}| {stamp} {text}",
                        "v1ts": f"{'pd_' + service + '_1':<14}| {stamp} {text}",
                        "v1": f"{'pd_' + service + '_1':<14}| {text}"}[style])
        return out

    def write(self, path: Path, style: str) -> None:
        path.write_text("\n".join(self.render(style)) + "\n", encoding="utf-8")

    def write_split(self, folder: Path) -> None:
        folder.mkdir(exist_ok=True)
        for service in ("router", "prefill", "decode"):
            mine = Log(self.skew)
            mine.lines = [x for x in self.lines if x[2] == service]
            (folder / f"{service}.log").write_text("\n".join(mine.render("raw")) + "\n", encoding="utf-8")


def startup(log: Log, kv_port: int = 9100, buffer: float = 8e9, decode_fp: str = FINGERPRINT,
            router_key: bool = True) -> None:
    for role, fingerprint in (("decode", decode_fp), ("prefill", FINGERPRINT)):
        log.ev(role, events.SERVICE_STARTING, f"engine role {role} serving tiny", config=f"{role}/config.json", role=role,
               kv_role="kv_consumer" if role == "decode" else "kv_producer", model="tiny", checkpoint=None,
               fingerprint=fingerprint, load_ms=95.2)
        if role == "decode":
            log.ev(role, events.KV_CONSUMER_LISTENING, f"KV consumer listening on 0.0.0.0:{kv_port}", kv_port=kv_port,
                   kv_buffer_size=buffer, kv_lease_ms=30000)
        log.ev(role, events.SERVICE_READY, "serving", host="0.0.0.0", port=8000, health_port=50051, warmup_ms=812.4)
    log.ev("router", events.SERVICE_STARTING, "router starting with router/settings.toml", config="router/settings.toml",
           prefill=[PREFILL], decode=[DECODE], policy="load_aware")
    if not router_key:
        log.ev("router", events.AUTH_KEY_MISSING, "environment variable TAOTOKEN_API_KEY is unset or empty",
               key_name="default", env_var="TAOTOKEN_API_KEY")
    for role, url in (("prefill", PREFILL), ("decode", DECODE)):
        log.ev("router", events.BACKEND_HEALTH, f"{role} backend {url} is up (SERVING)", level="INFO", backend=url, role=role,
               state="up", was="down", reason="SERVING")
    log.ev("router", events.SERVICE_READY, "serving", host="0.0.0.0", port=8080, health_port=50052, warmup_ms=15.0)
    log.tick(1000)


def _access(log: Log, service: str, rid: str, status: int, ms: float) -> None:
    log.ev(service, events.HTTP_ACCESS, f"POST {CHAT} {status}", rid, method="POST", path=CHAT, status=status,
           duration_ms=ms)


def _done(log: Log, rid: str, status: int, prompt: int, completion: int, ms: float, error: str | None = None) -> None:
    log.ev("router", events.ROUTER_REQUEST_DONE, f"chat request done: {status}", rid, "WARNING" if status >= 400 or error else "INFO",
           api="chat", key_name="default", status=status, error=error, prompt_tokens=prompt, completion_tokens=completion,
           e2e_ms=ms)
    _access(log, "router", rid, status, ms)


def request_id(n: int) -> str:
    return f"req-{n:04d}-{random.Random(n).getrandbits(32):08x}"


def _scheduled(log: Log, rid: str, stream: bool) -> None:
    """The router's one line for a parsed request: what was asked, the pair it picked, its time in the router's queue."""
    log.ev("router", events.ROUTER_SCHEDULED, f"chat request for tiny: prefill {PREFILL} → decode {DECODE}", rid, api="chat",
           model="tiny", stream=stream, prefill=PREFILL, decode=DECODE, policy="load_aware", mode="disaggregated", attempt=1,
           prefill_attempt=1, queue_ms=0.3)


def request(log: Log, n: int, prompt: int = 40, completion: int = 16, stream: bool = True, fate: str = "ok",
            kv_addr: str = "decode:9100", buffer: float = 8e9) -> str:
    """One chat request through router → prefill → KV → decode; `fate` picks how it breaks."""
    rid = request_id(n)
    tid = f"kv-{rid[4:]}"
    nbytes = prompt * BYTES_PER_TOKEN
    log.ev("router", events.AUTH_ACCEPTED, "key 'default' accepted", rid, key_name="default", header="authorization")
    _scheduled(log, rid, stream)
    log.ev("prefill", events.ENGINE_REQUEST_RECEIVED, f"chat request: {prompt} prompt tokens, PD prefill leg", rid,
           prompt_tokens=prompt, max_tokens=1, stream=False, role="prefill", pd_leg="prefill", transfer_id=tid)
    log.tick(prompt * 0.8)
    log.ev("prefill", events.ENGINE_PREFILL_DONE, f"prefilled {prompt} tokens", rid, prompt_tokens=prompt,
           prefill_ms=round(prompt * 0.8, 2), queue_ms=0.2)
    log.ev("prefill", events.KV_PRODUCER_SENDING, f"pushing {prompt} tokens of KV ({nbytes} bytes) to {kv_addr}", rid,
           transfer_id=tid, decode_kv_addr=kv_addr, num_tokens=prompt, bytes=nbytes)
    if fate in ("port_mismatch", "unreachable"):
        error = "[Errno 111] Connection refused" if fate == "port_mismatch" else "timed out"
        log.tick(0 if fate == "port_mismatch" else 3000)
        log.ev("prefill", events.KV_PRODUCER_CONNECT_FAILED, f"cannot connect to decode KV address {kv_addr}: {error}", rid,
               transfer_id=tid, decode_kv_addr=kv_addr, error=error)
    elif fate == "buffer_full":
        msg = (f"KV transfer of {nbytes} bytes ({prompt} tokens) does not fit the receive buffer: "
               f"kv_buffer_size={buffer:.0f} bytes, 0 in use")
        # A KV header without a request id: decode's line joins its request by transfer id only.
        log.ev("decode", events.KV_CONSUMER_BUFFER_FULL, msg, transfer_id=tid, bytes=nbytes, kv_buffer_size=buffer,
               buffer_used=0, peer="172.18.0.3:41822")
        log.ev("prefill", events.KV_PRODUCER_REJECTED, f"decode at {kv_addr} rejected the KV: {msg}", rid, transfer_id=tid,
               decode_kv_addr=kv_addr, reason="buffer_full", detail=msg, bytes=nbytes, kv_buffer_size=buffer,
               buffer_used=0)
    elif fate == "fingerprint":
        other = "llama-tiny-seed1-77d0b3c1"
        msg = f"model fingerprint mismatch: decode runs {other}, the KV is from {FINGERPRINT}"
        log.ev("decode", events.KV_CONSUMER_FINGERPRINT_MISMATCH, msg, transfer_id=tid, local=other, remote=FINGERPRINT,
               peer="172.18.0.3:41822")
        log.ev("prefill", events.KV_PRODUCER_REJECTED, f"decode at {kv_addr} rejected the KV: {msg}", rid, transfer_id=tid,
               decode_kv_addr=kv_addr, reason="fingerprint_mismatch", detail=msg, local=other, remote=FINGERPRINT)
    elif fate != "never_sent":  # never_sent: prefill computed but never pushed (its KV thread died): nothing logged
        log.tick(nbytes / 1e6)
        log.ev("decode", events.KV_CONSUMER_RECEIVED, f"received {prompt} tokens of KV ({nbytes} bytes)", rid,
               transfer_id=tid, num_tokens=prompt, bytes=nbytes, peer="172.18.0.3:41822",
               receive_ms=round(nbytes / 1e6, 3), gbps=1.0)
        log.ev("prefill", events.KV_PRODUCER_SENT, f"pushed {prompt} tokens of KV to {kv_addr}", rid, transfer_id=tid,
               decode_kv_addr=kv_addr, num_tokens=prompt, bytes=nbytes, transfer_ms=round(nbytes / 1e6, 2), gbps=1.0)
    log.ev("prefill", events.ENGINE_REQUEST_FINISHED, "finished (length) after 1 tokens", rid, prompt_tokens=prompt,
           completion_tokens=1, finish_reason="length", e2e_ms=round(prompt * 0.8 + 2, 2))
    _access(log, "prefill", rid, 200, round(prompt * 0.8 + 3, 2))
    log.ev("router", events.ROUTER_PREFILL_DONE, f"prefill done; handing KV to decode {DECODE}", rid, prefill=PREFILL,
           prefill_ms=round(prompt * 0.8 + 4, 2), transfer_id=tid, decode=DECODE,
           kv_transfer_params=["decode_kv_addr", "do_remote_prefill", "num_tokens", "transfer_id"])
    log.ev("decode", events.ENGINE_REQUEST_RECEIVED, f"chat request: {prompt} prompt tokens, PD decode leg", rid,
           prompt_tokens=prompt, max_tokens=completion, stream=stream, role="decode", pd_leg="decode", transfer_id=tid)
    if fate in ("port_mismatch", "unreachable", "never_sent", "buffer_full", "fingerprint", "decode_500"):
        if fate == "decode_500":
            log.ev("decode", events.KV_CONSUMER_CLAIMED, f"claimed KV of transfer {tid}", rid, transfer_id=tid, wait_ms=0.3,
                   num_tokens=prompt, bytes=nbytes)
            log.crash("decode", RuntimeError("sampling produced NaN logits"), rid, f"unhandled error on POST {CHAT}")
            log.raw("decode", "Traceback (most recent call last):")
            log.raw("decode", '  File "/app/stack/engine/sampling.py", line 41, in sample')
            log.raw("decode", "RuntimeError: sampling produced NaN logits")
            status, error = 500, "server_error: sampling produced NaN logits"
        else:
            if fate in ("port_mismatch", "unreachable", "never_sent"):
                log.tick(5000)
                log.ev("decode", events.KV_CONSUMER_TIMEOUT, f"KV for transfer {tid} did not arrive within "
                       "kv_transfer_timeout_ms=5000", rid, transfer_id=tid, waited_ms=5000, kv_transfer_timeout_ms=5000,
                       in_flight=False)
            log.ev("decode", events.HTTP_ERROR, f"KV for transfer {tid} did not arrive", rid, status=504,
                   type="upstream_timeout", code="kv_transfer_timeout")
            status, error = 504, "upstream_timeout: KV transfer failed"
        _access(log, "decode", rid, status, 5001.2)
        body = json.dumps({"error": {"message": error, "type": "server_error", "param": None, "code": None}})
        log.ev("router", events.ROUTER_UPSTREAM_ERROR, f"decode {DECODE} answered HTTP {status}", rid, backend=DECODE,
               role="decode", status=status, body=body)
        log.ev("router", events.ROUTER_DECODE_FAILED, f"decode {DECODE} failed: {error}", rid, "WARNING", decode=DECODE,
               status=status, error=error, mid_stream=False, retried=False)
        _done(log, rid, 502, prompt, 0, 5010.0, error)
        log.tick(50)
        return rid
    log.ev("decode", events.KV_CONSUMER_CLAIMED, f"claimed KV of transfer {tid}", rid, transfer_id=tid, wait_ms=0.3,
           num_tokens=prompt, bytes=nbytes)
    log.ev("decode", events.ENGINE_FIRST_TOKEN, "first token", rid, ttft_ms=1.2)
    log.ev("router", events.ROUTER_DECODE_FIRST_TOKEN, "first token", rid, decode=DECODE, ttft_ms=round(prompt * 0.8 + 8, 2))
    log.tick(completion * 4)
    if fate == "mid_stream":
        log.ev("decode", events.HTTP_ERROR, "MemoryError: KV block pool exhausted", rid, status=500, type="server_error",
               code=None)
        error = "upstream closed the stream after 5 chunks"
        log.ev("router", events.ROUTER_DECODE_FAILED, f"decode {DECODE} failed mid-stream: {error}", rid, decode=DECODE,
               status=200, error=error, mid_stream=True, retried=False)
        _done(log, rid, 200, prompt, 5, 80.0, error)
        return rid
    log.ev("decode", events.ENGINE_REQUEST_FINISHED, f"finished (length) after {completion} tokens", rid,
           prompt_tokens=prompt, completion_tokens=completion, finish_reason="length", e2e_ms=completion * 4.0)
    _access(log, "decode", rid, 200, completion * 4.0 + 1)
    if fate == "usage_chunk":
        log.ev("router", events.ROUTER_USAGE_CHUNK, "sent the usage chunk (empty choices) the client asked for", rid,
               client_asked=True, prompt_tokens=prompt, completion_tokens=completion)
    _done(log, rid, 200, prompt, completion, round(prompt * 0.8 + completion * 4 + 12, 2))
    log.tick(30)
    return rid


def rejected(log: Log, n: int, reason: str, header: str = "authorization") -> str:
    rid = request_id(n)
    log.ev("router", events.AUTH_REJECTED, f"401: {reason}", rid, reason=reason, header=header)
    _done(log, rid, 401, 0, 0, 0.4)
    log.tick(20)
    return rid


def backend_gone(log: Log, n: int, role: str = "prefill", first: bool = True) -> str:
    """The prefill container was killed: the router marks it down and answers 503 no_prefill_backend."""
    rid = request_id(n)
    url = PREFILL if role == "prefill" else DECODE
    if first:
        log.ev("router", events.BACKEND_HEALTH, f"{role} backend {url} is down (unreachable)", level="WARNING",
               backend=url, role=role, state="down", was="up", reason="unreachable")
    log.ev("router", events.HTTP_ERROR, f"no healthy {role} backend", rid, status=503, type="service_unavailable",
           code=f"no_{role}_backend")
    _done(log, rid, 503, 0, 0, 1.2, f"no_{role}_backend")
    log.tick(20)
    return rid


def model_missing(log: Log, n: int, model: str = "claude-sonnet-4-5") -> str:
    """A client asks for a model name the router does not serve (Claude Code's claude-* default)."""
    rid = request_id(n)
    log.ev("router", events.HTTP_BAD_REQUEST, f"The model '{model}' does not exist on this router; it serves "
           "'your-model-id' (see GET /v1/models).", rid, status=404, type="invalid_request_error", code="model_not_found")
    _done(log, rid, 404, 0, 0, 0.8, "model_not_found")
    log.tick(20)
    return rid


def unknown_route(log: Log, n: int, method: str, path: str) -> str:
    """A client calls a path the router does not serve: aiohttp's 404 through the error middleware, then the access line."""
    rid = request_id(n)
    log.ev("router", events.HTTP_BAD_REQUEST, f"Not Found: {method} {path}", rid, status=404, type="not_found_error")
    log.ev("router", events.HTTP_ACCESS, f"{method} {path} 404", rid, method=method, path=path, status=404, duration_ms=0.6)
    log.tick(20)
    return rid


def direct(log: Log, n: int, service: str = "decode") -> str:
    """A client talks to an engine's published port: engine lines, no router line, no PD leg."""
    rid = f"direct-{n:04d}"
    log.ev(service, events.ENGINE_REQUEST_RECEIVED, "chat request: 12 prompt tokens", rid, prompt_tokens=12, max_tokens=8,
           stream=False, role=service, pd_leg=None, transfer_id=None)
    log.ev(service, events.ENGINE_FIRST_TOKEN, "first token", rid, ttft_ms=9.5)
    log.ev(service, events.ENGINE_REQUEST_FINISHED, "finished (length) after 8 tokens", rid, prompt_tokens=12,
           completion_tokens=8, finish_reason="length", e2e_ms=40.0)
    _access(log, service, rid, 200, 41.0)
    log.tick(20)
    return rid


def context_refused(log: Log, n: int, decode_len: int = 64, prompt: int = 40, max_tokens: int = 48,
                    prefill_len: int = 512) -> str:
    """Prefill serves the prompt, decode refuses it for prompt + max_tokens past its window (logged at WARNING). The
    router knows both windows (/v1/models): smaller than prefill's, the engines' fault (502); the same, the client's
    400, passed on as our engine words it."""
    rid = request_id(n)
    tid = f"kv-{rid[4:]}"
    _scheduled(log, rid, True)
    log.ev("prefill", events.ENGINE_REQUEST_RECEIVED, f"chat request: {prompt} prompt tokens, PD prefill leg", rid,
           prompt_tokens=prompt, max_tokens=1, stream=False, role="prefill", pd_leg="prefill", transfer_id=tid)
    log.ev("prefill", events.ENGINE_PREFILL_DONE, f"prefilled {prompt} tokens", rid, prompt_tokens=prompt, prefill_ms=30.0,
           queue_ms=0.2)
    _access(log, "prefill", rid, 200, 33.0)
    log.ev("router", events.ROUTER_PREFILL_DONE, "prefill done", rid, prefill=PREFILL, prefill_ms=34.0, transfer_id=tid)
    shared = decode_len == prefill_len
    msg = (f"This model's maximum context length is {decode_len} tokens. However, you requested {prompt + max_tokens} "
           f"tokens ({prompt} in the messages, {max_tokens} in the completion).")
    code = "context_length_exceeded" if shared else None
    log.ev("decode", events.HTTP_BAD_REQUEST, msg, rid, status=400, type="invalid_request_error", code=code)
    _access(log, "decode", rid, 400, 1.0)
    body = json.dumps({"error": {"message": msg, "type": "invalid_request_error", "param": "max_tokens" if shared else None,
                                 "code": code}})
    log.ev("router", events.ROUTER_UPSTREAM_ERROR, f"decode {DECODE} answered HTTP 400", rid, backend=DECODE,
           role="decode", status=400, body=body)
    answer = msg if shared else (
        f"decode engine {DECODE} refused a request the prefill engine accepted (HTTP 400: {msg}): prefill and decode "
        f"disagree; decode's max_model_len {decode_len} is not prefill's {prefill_len} (python -m doctor check)")
    log.ev("router", events.ROUTER_DECODE_FAILED, f"decode {DECODE} failed: {answer}", rid, "WARNING", decode=DECODE,
           status=400 if shared else 502, error=answer, mid_stream=False, retried=False)
    _done(log, rid, 400 if shared else 502, prompt, 0, 40.0, answer)
    log.tick(20)
    return rid


def mystery(log: Log, n: int) -> str:
    """A failure no diagnosis knows: the router answers 500 with an unhandled exception."""
    rid = request_id(n)
    log.ev("router", events.HTTP_ERROR, "unhandled error on POST /v1/chat/completions", rid,
           exc="ZeroDivisionError: division by zero")
    _done(log, rid, 500, 0, 0, 2.0, "internal error")
    log.tick(20)
    return rid


def limited(log: Log, n: int, quota: bool) -> str:
    rid = request_id(n)
    log.ev("router", events.AUTH_ACCEPTED, "key 'default' accepted", rid, key_name="default", header="authorization")
    if quota:
        log.ev("router", events.LIMIT_QUOTA, "key 'default' used its token quota", rid, key_name="default", used=100204,
               quota=100000)
    else:
        log.ev("router", events.LIMIT_RATE, "key 'default' hit its rpm limit", rid, key_name="default", limit="rpm",
               current=61, maximum=60, retry_after_s=1)
    _done(log, rid, 429, 0, 0, 0.3)
    log.tick(20)
    return rid


GARBAGE = ["\x00\x17\x9b\x02\x7f\x10binary", '{"ts": "2026-11-29T20:31:07.000Z", "level": "INFO", "service": "rou',
           "Traceback (most recent call last):"]


def _with(build, style: str, folder: Path, name: str, **startup_kw) -> None:
    log = Log()
    startup(log, **startup_kw)
    build(log)
    log.write(folder / name, style)


def write_bundles(folder: Path) -> Path:
    """Write every scenario's bundle into `folder`; → folder."""
    log = Log()
    startup(log)
    for n in range(1, 6):
        request(log, n, prompt=30 + 10 * n)
    log.raw("router", GARBAGE[0])
    log.raw("prefill", GARBAGE[1])
    log.raw("decode", GARBAGE[2])
    log.raw("decode", '  File "/app/stack/engine/server.py", line 88, in handle')
    log.write(folder / "healthy_v2ts.log", "v2ts")
    log.write(folder / "healthy_v1.log", "v1")
    log.write_split(folder / "healthy_split")

    _with(lambda log: [rejected(log, n, "no_keys_configured") for n in range(1, 4)], "v1ts", folder,
          "router_key_missing.log", router_key=False)
    _with(lambda log: (request(log, 1), rejected(log, 2, "missing"), rejected(log, 3, "whitespace"),
                       rejected(log, 4, "unknown"), rejected(log, 5, "unknown", header="x-api-key"),
                       limited(log, 6, quota=False), limited(log, 7, quota=True)), "v2", folder, "auth_mixed.log")
    _with(lambda log: (request(log, 1), request(log, 2, fate="decode_500"), request(log, 3, fate="decode_500")),
          "v2ts", folder, "decode_failed.log")
    _with(lambda log: request(log, 1, fate="mid_stream"), "v2", folder, "stream_cut.log")
    _with(lambda log: (request(log, 1, fate="port_mismatch"), request(log, 2, fate="port_mismatch")), "v2ts", folder,
          "kv_port_mismatch.log", kv_port=9200)
    _with(lambda log: (request(log, 1), request(log, 2, fate="unreachable")), "v1ts", folder, "kv_unreachable.log")
    _with(lambda log: (request(log, 1, prompt=40, buffer=262144), request(log, 2, prompt=100, buffer=262144),
                       request(log, 3, prompt=1800, fate="buffer_full", buffer=262144),
                       request(log, 4, prompt=4000, fate="buffer_full", buffer=262144)), "v2", folder,
          "kv_buffer_full.log", buffer=262144)
    _with(lambda log: request(log, 1, fate="never_sent"), "v2", folder, "kv_timeout.log")
    _with(lambda log: request(log, 1, fate="fingerprint"), "v2ts", folder, "kv_model_mismatch.log",
          decode_fp="llama-tiny-seed1-77d0b3c1")
    _with(lambda log: request(log, 1, fate="usage_chunk"), "v2", folder, "usage_chunk.log")

    _with(lambda log: (request(log, 1), backend_gone(log, 2), backend_gone(log, 3, first=False)), "v2ts", folder,
          "prefill_killed.log")
    _with(lambda log: (request(log, 1), model_missing(log, 2), model_missing(log, 3, "claude-haiku-4-5")), "v2", folder,
          "model_claude.log")
    _with(lambda log: (request(log, 1), direct(log, 1), direct(log, 2)), "v2", folder, "engine_direct.log")
    _with(lambda log: (request(log, 1), unknown_route(log, 2, "POST", "/v1/v1/messages"),
                       unknown_route(log, 3, "POST", "/v1/v1/messages"), unknown_route(log, 4, "POST", "/chat/completions"),
                       unknown_route(log, 5, "GET", "/v1/embeddings"), unknown_route(log, 6, "HEAD", "/v1/api/hello")),
          "v2ts", folder, "base_url.log")
    _with(lambda log: (request(log, 1), context_refused(log, 2)), "v2ts", folder, "max_model_len.log")
    _with(lambda log: (request(log, 1), context_refused(log, 2, decode_len=512, max_tokens=500)), "v2ts", folder,
          "max_tokens_past_window.log")
    _with(lambda log: (request(log, 1), mystery(log, 2)), "v2", folder, "unexplained.log")

    log = Log()
    startup(log)
    log.lines = [x for x in log.lines if x[2] != "router"]  # the router never started
    log.write(folder / "router_down.log", "v2")
    return folder


def every_event(log: Log, rid: str = "every-event") -> None:
    """Each declared event once, through log_event with its fields' example values (all fields, optional too)."""
    for event in events.ALL.values():
        service = {events.ANY: "router", events.ENGINE: "decode"}.get(event.service, event.service)
        fields = {name: field.example for name, field in event.fields.items()}
        # An abandoned request explains its own cut KV transfer (doctor/checks/kv_transfer.py): another request's.
        own = f"{rid}-abandoned" if event is events.ENGINE_REQUEST_ABANDONED else rid
        log.ev(service, event, f"{event} (every declared field)", own, **fields)
