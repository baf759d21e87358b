"""How fast does the doctor diagnose a big log bundle? `python -m benchmarks.doctor [--lines N]`.

Generates a realistic bundle (router, prefill and decode interleaved as `docker compose logs` prints
them, decode's clock 3 s behind, 1 % failed requests of several kinds, a little garbage; every line
checked against its event's declaration in stack/common/events.py), then times
parse + join + every diagnosis over it, against a baseline measured in the same run: one bare
`json.loads` per line (the least any JSON-lines reader must do). Prints lines/s and the ratio.
Target: 100,000 lines in under 2 s.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from datetime import datetime, timedelta, timezone

from doctor import environment
from doctor.checks import run_checks
from doctor.findings import Context
from doctor.parse import parse_lines
from stack.common import events

T0 = datetime(2026, 11, 29, 20, 0, tzinfo=timezone.utc)
SKEW = {"decode": timedelta(seconds=-3)}
PREFIX = {"router": "router-1  | ", "prefill": "prefill-1 | ", "decode": "decode-1  | "}


def _line(now: datetime, service: str, event: str, rid: str, msg: str, level: str = "INFO", **fields) -> tuple:
    # Built by hand, not by log_event (100k calls would change service and clock per line), so checked here.
    assert events.ALL[event].problems(fields) == ([], []), f"{event}: {events.ALL[event].problems(fields)}"
    clock = now + SKEW.get(service, timedelta())
    body = {"ts": clock.isoformat(timespec="milliseconds").replace("+00:00", "Z"), "level": level,
            "service": service, "event": event, "request_id": rid, "msg": msg, **fields}
    return now, PREFIX[service] + json.dumps(body)


def _request(n: int, start: datetime, rng: random.Random) -> list[tuple]:
    """One request's lines at their true times (a healthy PD request unless the dice say otherwise)."""
    rid, tid = f"req-{n:06d}", f"kv-{n:06d}"
    prompt, completion = rng.randint(20, 2000), rng.randint(8, 64)
    nbytes, t = prompt * 2048, start
    out = []

    def add(service, event, msg, ms=0.3, **fields):
        nonlocal t
        t += timedelta(milliseconds=ms)
        out.append(_line(t, service, event, rid, msg, **fields))

    add("router", "auth.accepted", "key accepted", key_name="default", header="authorization")
    add("router", "router.scheduled", "chat request: prefill → decode", api="chat", model="tiny", stream=True,
        prefill="http://prefill:8000", decode="http://decode:8000", policy="load_aware", mode="disaggregated", attempt=1,
        prefill_attempt=1, queue_ms=0.3)
    add("prefill", "engine.request_received", "request", prompt_tokens=prompt, max_tokens=1, stream=False,
        role="prefill", pd_leg="prefill", transfer_id=tid)
    add("prefill", "engine.prefill_done", "prefilled", ms=prompt * 0.05, prompt_tokens=prompt, prefill_ms=prompt * 0.05,
        queue_ms=0.1)
    add("prefill", "kv_producer.sending", "pushing", transfer_id=tid, decode_kv_addr="decode:9100", num_tokens=prompt,
        bytes=nbytes)
    fate = rng.random()
    if fate < 0.005:
        add("prefill", "kv_producer.connect_failed", "cannot connect", level="ERROR", transfer_id=tid,
            decode_kv_addr="decode:9100", error="TimeoutError: timed out")
        add("decode", "kv_consumer.timeout", "no KV", ms=5000, level="ERROR", transfer_id=tid, waited_ms=5000,
            kv_transfer_timeout_ms=5000, in_flight=False)
        add("router", "router.decode_failed", "decode failed", level="WARNING", decode="http://decode:8000",
            status=504, error="KV did not arrive", mid_stream=False, retried=False)
        add("router", "router.request_done", "done", level="WARNING", api="chat", key_name="default", status=504,
            error="KV did not arrive", prompt_tokens=prompt, completion_tokens=0, e2e_ms=5010)
        return out
    add("decode", "kv_consumer.received", "received", ms=nbytes / 2e6, transfer_id=tid, num_tokens=prompt,
        bytes=nbytes, peer="172.18.0.3:40000", receive_ms=nbytes / 2e6, gbps=16.0)
    add("prefill", "kv_producer.sent", "pushed", transfer_id=tid, decode_kv_addr="decode:9100", num_tokens=prompt,
        bytes=nbytes, transfer_ms=nbytes / 2e6, gbps=16.0)
    add("prefill", "engine.request_finished", "done", prompt_tokens=prompt, completion_tokens=1, finish_reason="length",
        e2e_ms=prompt * 0.05)
    add("prefill", "http.access", "POST /v1/chat/completions 200", method="POST", path="/v1/chat/completions",
        status=200, duration_ms=prompt * 0.05)
    add("router", "router.prefill_done", "prefill done", prefill="http://prefill:8000", prefill_ms=prompt * 0.05,
        transfer_id=tid)
    add("router", "router.kv_handoff", "handing KV", decode="http://decode:8000", transfer_id=tid,
        kv_transfer_params=["do_remote_prefill", "num_tokens", "transfer_id"])
    add("decode", "engine.request_received", "request", prompt_tokens=prompt, max_tokens=completion, stream=True,
        role="decode", pd_leg="decode", transfer_id=tid)
    add("decode", "kv_consumer.claimed", "claimed", transfer_id=tid, wait_ms=0.2, num_tokens=prompt, bytes=nbytes)
    add("decode", "engine.first_token", "first token", ttft_ms=1.0)
    add("router", "router.decode_first_token", "first token", decode="http://decode:8000", ttft_ms=prompt * 0.05 + 2)
    if fate < 0.01:
        add("router", "router.decode_failed", "decode stream broke", ms=40, level="ERROR", decode="http://decode:8000",
            status=200, error="upstream closed the stream", mid_stream=True, retried=False)
    else:
        add("decode", "engine.request_finished", "done", ms=completion * 4, prompt_tokens=prompt,
            completion_tokens=completion, finish_reason="length", e2e_ms=completion * 4)
        add("decode", "http.access", "POST /v1/chat/completions 200", method="POST", path="/v1/chat/completions",
            status=200, duration_ms=completion * 4)
    add("router", "router.request_done", "done", api="chat", key_name="default", status=200, error=None,
        prompt_tokens=prompt, completion_tokens=completion, e2e_ms=prompt * 0.05 + completion * 4)
    add("router", "http.access", "POST /v1/chat/completions 200", method="POST", path="/v1/chat/completions",
        status=200, duration_ms=prompt * 0.05 + completion * 4)
    return out


def generate(n_lines: int, seed: int = 0) -> list[str]:
    """About `n_lines` lines of concurrent requests, interleaved by true time like compose prints them."""
    rng = random.Random(seed)
    timed: list[tuple] = []
    n = 0
    while len(timed) < n_lines:
        timed.extend(_request(n, T0 + timedelta(milliseconds=n * 7), rng))
        n += 1
        if n % 500 == 0:
            timed.append((T0 + timedelta(milliseconds=n * 7), "decode-1  | Traceback (most recent call last):"))
            timed.append((T0 + timedelta(milliseconds=n * 7), '{"ts": "2026-11-29T20:0'))  # truncated
    timed.sort(key=lambda x: x[0])
    return [line for _, line in timed[:n_lines]]


def baseline(lines: list[str]) -> None:
    """The floor: strip the compose prefix and json.loads every line (what any reader must do)."""
    loads = json.loads
    for line in lines:
        start = line.find("{")
        try:
            loads(line[start:])
        except ValueError:
            pass


def diagnose(lines: list[str]) -> int:
    records, stats = parse_lines(lines, "bench")
    ctx = Context.build(records, environment.snapshot("/nonexistent", environ={}), stats)
    return len(run_checks(ctx))


def best_of(fn, arg, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs for each measurement")
    args = parser.parse_args()
    lines = generate(args.lines)
    base = best_of(baseline, lines, args.repeat)
    full = best_of(diagnose, lines, args.repeat)
    findings = diagnose(lines)
    print(f"bundle: {len(lines)} lines (router/prefill/decode interleaved, compose v2 prefixes, decode clock -3 s)")
    print(f"baseline json.loads pass: {base:.3f} s  ({len(lines) / base:,.0f} lines/s)")
    print(f"doctor parse+join+checks: {full:.3f} s  ({len(lines) / full:,.0f} lines/s), {findings} findings")
    print(f"ratio doctor/baseline: {full / base:.2f}x   target: 100,000 lines < 2 s -> "
          f"{'met' if full * 100_000 / len(lines) < 2 else 'NOT met'}")


if __name__ == "__main__":
    main()
