"""Router overhead: the real router process against calling a trivially fast backend directly.

    python -m benchmarks.router [--requests 2000] [--concurrency 32] [--stream-tokens 200] [--stream-pace-ms 0] [--pin]
        [--prompt hello|agentic]

One run starts a fake backend (answers at once; prefill legs get kv_transfer_params; GET /health names
a KV port, as decode's does) on two ports,
measures it alone (the machine-speed reference), then each router setup — the full router
(`python -m stack.router`: auth, limits, usage, PD flow) and a bare PDClient app (the PD flow
alone), each colocated (one upstream request) and disaggregated (prefill leg + decode leg):
  latency   sequential non-streamed requests: p50/p99 with and without the router (added ms)
  capacity  non-streamed requests at --concurrency: router CPU µs per request (from /proc) and
            the requests/s one router core could carry (1e6 / µs)
  stream    streamed requests of --stream-tokens chunks: relayed tokens per router CPU second. The
            backend writes a whole answer at once (a burst: the router forwards what one read
            brought in one write) or, with --stream-pace-ms, one chunk per interval, as a real
            engine does (every token then costs the router its own read and write)
--prompt agentic sends what coding agents send instead of one short line: a Claude-Code-sized turn with its
system prompt and 14 tools (~33 kB of JSON), so the figures include the router's per-byte work (the JSON limits,
parsing, the legs' bodies).
CPU comes from /proc, so "per core" figures do not depend on where the OS runs the router;
`--pin` pins the router to core 0 and the backend and load generator to the other cores.
Targets: ≤ 1 ms added p50, ≥ 2,000 non-streamed req/s and ≥ 50,000 relayed tokens/s on one core.
A measurement, not a test: it prints figures and ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from stack.bench.agentic import PROFILES, AgenticShape, build_workload

KEY = "bench-" + "k" * 24
MODEL = "bench-model"


# -- the processes under test -----------------------------------------------------------------------
def _backend_app(tokens: int, pace_ms: float) -> web.Application:
    """Answers as fast as aiohttp can: pre-encoded bodies, no model; stream chunks `pace_ms` apart (0: a burst)."""
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
    base = {"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    frames = [f"data: {json.dumps({**base, 'choices': [{'index': 0, 'delta': {'content': 'tok '}, 'finish_reason': None}]})}\n\n".encode()
              for _ in range(tokens - 1)]
    frames.append(f"data: {json.dumps({**base, 'choices': [{'index': 0, 'delta': {'content': 'end'}, 'finish_reason': 'length'}]})}\n\n".encode())
    frames.append(f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
    answer = {"id": "chatcmpl-b", "object": "chat.completion", "created": 1, "model": MODEL,
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}], "usage": usage}

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            return web.json_response({**answer, "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                                                       "transfer_id": params.get("transfer_id"), "num_tokens": 8}})
        if not body.get("stream"):
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if not pace_ms:
            await response.write(b"".join(frames))
        for data in frames[:-1] if pace_ms else ():
            await response.write(data)
            await asyncio.sleep(pace_ms / 1000)
        await response.write_eof(frames[-1] if pace_ms else b"")  # [DONE] with the body's end, as an engine sends it
        return response

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def health(_request: web.Request) -> web.Response:
        # The router asks decode for its KV port before sending it work; nothing listens there (no KV moves).
        return web.json_response({"status": "ok", "kv_port": 1})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def _bare_pd_app(prefill: str, decode: str) -> web.Application:
    """The PD flow alone (no auth/limits/usage): what PDClient and SSE framing cost."""
    from stack.common.errors import error_middleware
    from stack.common.sse import frame, open_stream, send_done
    from stack.router.backends import PoolConfig
    from stack.protocol.parse import parse
    from stack.router.config import RouterConfig
    from stack.router.fleet import Fleet
    from stack.router.metrics import Metrics
    from stack.router.pd import PDClient
    from stack.router.upstream import new_session
    from stack.router.scheduler import SchedulerConfig

    client_key = web.AppKey("pd", PDClient)

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers.get("X-Request-ID", "bench")
        pd = request.app[client_key]
        req = parse("chat", body)  # what the API front end hands the PD flow: the parsed request and its body
        if not req.stream:
            return web.json_response(await pd.complete(rid, "chat", "/v1/chat/completions", req, body))
        decode = await pd.open(rid, "chat", "/v1/chat/completions", req, body)
        try:
            stream = await open_stream(request)
            while (batch := await decode.next()) is not None:
                await stream.write(b"".join(frame(chunk) for chunk in batch))
        finally:
            decode.close()
        await send_done(stream)
        return stream

    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        async with new_session() as session:
            config = RouterConfig(prefill=PoolConfig(endpoint=prefill, max_concurrent=256), decode=PoolConfig(endpoint=decode, max_concurrent=256),
                                  scheduler=SchedulerConfig(health_interval_ms=0))
            metrics = Metrics()
            fleet = Fleet(config, session, metrics)
            await fleet.start()
            app[client_key] = PDClient(fleet, metrics)
            yield
            await fleet.close()

    app = web.Application(middlewares=[error_middleware()])
    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_get("/health", lambda _r: web.json_response({"status": "ok"}))
    return app


async def _serve_forever(app: web.Application, ports: list[int]) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


# -- the load generator -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _pin(pid: int, cores: set[int]) -> None:
    available = os.sched_getaffinity(0)
    if cores & available and len(available) > 1:
        os.sched_setaffinity(pid, cores & available)


async def _wait_ready(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up within {timeout_s:.0f}s")
            await asyncio.sleep(0.1)


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> tuple[float, int]:
    started = time.perf_counter()
    async with session.post(url, data=body, headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {(await response.text())[:300]}")
        tokens = 0
        if stream:
            async for line in response.content:
                if line.startswith(b"data: {") and b'"delta"' in line:
                    tokens += 1
        else:
            await response.read()
            tokens = 1
    return time.perf_counter() - started, tokens


def _prompt(kind: str) -> dict[str, Any]:
    """The request's conversation: one short line, or a Claude-Code-sized turn (stack.bench.agentic's claude-code
    profile: its system prompt and 14 tools, the last of 4 turns; about 33 kB of JSON), what agents send."""
    if kind == "hello":
        return {"messages": [{"role": "user", "content": "Say hello to the benchmark."}]}
    shape = AgenticShape(sessions=1, turns=4, **PROFILES["claude-code"], turn_len=200, output_len=32, think_mean_s=1, stagger_s=0)
    workload = build_workload(shape, np.random.default_rng(0))
    return {"messages": workload.messages(workload.sessions[0], 3), "tools": list(workload.tools)}


async def _load(url: str, n: int, concurrency: int, stream: bool, tokens: int, prompt: dict[str, Any]) -> tuple[list[float], int, float]:
    body = json.dumps({"model": MODEL, **prompt, "max_tokens": tokens, "stream": stream}).encode()
    latencies: list[float] = []
    relayed = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _one(session, url, body, stream)  # warm the connections
        remaining = n

        async def worker() -> None:
            nonlocal remaining, relayed
            while remaining > 0:
                remaining -= 1
                latency, count = await _one(session, url, body, stream)
                latencies.append(latency)
                relayed += count

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, relayed, time.perf_counter() - started


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def _measure(name: str, url: str, direct: str, pid: int | None, args: argparse.Namespace) -> dict[str, float]:
    """Latency, capacity and stream figures for one target (pid None = the backend itself)."""
    seq, prompt = max(100, args.requests // 10), _prompt(args.prompt)
    lat, _, _ = await _load(url, seq, 1, False, args.stream_tokens, prompt)
    base, _, _ = await _load(direct, seq, 1, False, args.stream_tokens, prompt)
    cpu0 = _cpu_seconds(pid) if pid else 0.0
    _, _, wall = await _load(url, args.requests, args.concurrency, False, args.stream_tokens, prompt)
    cpu1 = _cpu_seconds(pid) if pid else 0.0
    n_streams = max(20, args.requests // 20)
    # Paced streams spend most of their time waiting: more of them at once keep the router busy.
    _, relayed, stream_wall = await _load(url, n_streams, args.concurrency if args.stream_pace_ms else min(8, args.concurrency), True,
                                          args.stream_tokens, prompt)
    cpu2 = _cpu_seconds(pid) if pid else 0.0
    row = {
        "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99), "direct_p50_ms": _pct(base, 0.5), "direct_p99_ms": _pct(base, 0.99),
        "req_per_s": args.requests / wall, "cpu_us_per_req": (cpu1 - cpu0) / args.requests * 1e6,
        "stream_tok_per_s": relayed / stream_wall, "cpu_us_per_token": (cpu2 - cpu1) / max(1, relayed) * 1e6,
    }
    row["added_p50_ms"] = row["p50_ms"] - row["direct_p50_ms"]
    row["added_p99_ms"] = row["p99_ms"] - row["direct_p99_ms"]
    row["req_per_core_s"] = 1e6 / row["cpu_us_per_req"] if row["cpu_us_per_req"] else float("inf")
    row["tok_per_core_s"] = 1e6 / row["cpu_us_per_token"] if row["cpu_us_per_token"] else float("inf")
    return row


def _settings(tmp: Path, prefill: str, decode: str, port: int, health_port: int) -> Path:
    path = tmp / "settings.toml"
    path.write_text(f"""
[server]
host = "127.0.0.1"
port = {port}
health_port = {health_port}
[taotoken]
api_key_env = "BENCH_ROUTER_KEY"
model_id = "{MODEL}"
[prefill]
endpoint = "{prefill}"
max_concurrent = 256
[decode]
endpoint = "{decode}"
max_concurrent = 256
[scheduler]
health_interval_ms = 0
[usage]
db_path = "{tmp / 'usage.sqlite3'}"
""")
    return path


async def run(args: argparse.Namespace) -> int:
    cores = sorted(os.sched_getaffinity(0))
    router_core, other_cores = {cores[0]}, set(cores[1:]) or {cores[0]}
    if args.pin:
        _pin(0, other_cores)
    p_port, d_port = _free_port(), _free_port()
    prefill, decode = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    python = sys.executable
    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, dict[str, float]] = {}
    try:
        backend = subprocess.Popen([python, "-m", "benchmarks.router", "--serve-backend", str(p_port), str(d_port),
                                    "--stream-tokens", str(args.stream_tokens), "--stream-pace-ms", str(args.stream_pace_ms)])
        procs.append(backend)
        if args.pin:
            _pin(backend.pid, other_cores)
        await _wait_ready(decode + "/v1/models")
        direct = decode + "/v1/chat/completions"
        # The backend's own cost in this run: the machine-speed reference the router figures are read against.
        print("… measuring the backend alone", flush=True)
        results["backend alone (reference)"] = await _measure("backend", direct, direct, backend.pid, args)
        setups = [("full router, colocated", decode, decode), ("full router, disaggregated", prefill, decode),
                  ("bare PDClient app, colocated", decode, decode), ("bare PDClient app, disaggregated", prefill, decode)]
        with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
            for name, p_url, d_url in setups:
                port = _free_port()
                if name.startswith("bare"):
                    cmd = [python, "-m", "benchmarks.router", "--serve-bare", str(port), p_url, d_url,
                           "--stream-tokens", str(args.stream_tokens)]
                else:
                    cmd = [python, "-m", "stack.router", "--config", str(_settings(Path(tmp), p_url, d_url, port, _free_port()))]
                router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ, "BENCH_ROUTER_KEY": KEY})
                procs.append(router)
                if args.pin:
                    _pin(router.pid, router_core)
                await _wait_ready(f"http://127.0.0.1:{port}/health")
                print(f"… measuring {name}", flush=True)
                results[name] = await _measure(name, f"http://127.0.0.1:{port}/v1/chat/completions", direct, router.pid, args)
                router.terminate()
                router.wait(10)
        _report(results, args)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
    return 0


def _report(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print(f"\nrouter overhead ({'router pinned to core 0; ' if args.pin else ''}{args.requests} {args.prompt} requests at concurrency {args.concurrency}; "
          f"streams of {args.stream_tokens} chunks, {f'{args.stream_pace_ms:g} ms apart' if args.stream_pace_ms else 'as a burst'}; load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    print(f"{'setup':36} {'p50 ms':>8} {'direct':>8} {'added':>7} {'p99 ms':>8} {'direct':>8} {'added':>7} "
          f"{'CPU µs/req':>10} {'req/s/core':>10} {'req/s':>7} {'CPU µs/tok':>10} {'tok/s/core':>10}")
    for name, r in results.items():
        print(f"{name:36} {r['p50_ms']:8.3f} {r['direct_p50_ms']:8.3f} {r['added_p50_ms']:7.3f} {r['p99_ms']:8.3f} "
              f"{r['direct_p99_ms']:8.3f} {r['added_p99_ms']:7.3f} {r['cpu_us_per_req']:10.0f} {r['req_per_core_s']:10.0f} "
              f"{r['req_per_s']:7.0f} {r['cpu_us_per_token']:10.2f} {r['tok_per_core_s']:10.0f}")
    print("\ntargets: added p50 ≤ 1 ms, ≥ 2,000 non-streamed req/s per core, ≥ 50,000 relayed tokens/s per core")
    reference = results.pop("backend alone (reference)", None)
    if reference:
        print(f"  (the backend alone spends {reference['cpu_us_per_req']:.0f} µs CPU per request and {reference['cpu_us_per_token']:.2f} µs per "
              "token here; perf.md measured 46–58 µs per request on a quiet machine)")
    for name, r in results.items():
        print(f"  {name:36} added p50 {r['added_p50_ms']:.3f} ms ({r['added_p50_ms'] / 1.0:.2f}× budget); "
              f"{r['req_per_core_s']:.0f} req/s/core ({r['req_per_core_s'] / 2000:.2f}× target); "
              f"{r['tok_per_core_s']:.0f} tok/s/core ({r['tok_per_core_s'] / 50000:.2f}× target)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="non-streamed requests for the capacity phase")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=200, help="chunks per streamed answer")
    parser.add_argument("--stream-pace-ms", type=float, default=0.0, help="backend: ms between stream chunks (0: all at once)")
    parser.add_argument("--pin", action="store_true", help="pin the router to core 0, everything else to the other cores")
    parser.add_argument("--prompt", choices=("hello", "agentic"), default="hello",
                        help="what each request carries: one short line, or a Claude-Code-sized turn with 14 tools (~33 kB)")
    parser.add_argument("--serve-backend", nargs=2, type=int, metavar=("PREFILL_PORT", "DECODE_PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-bare", nargs=3, metavar=("PORT", "PREFILL", "DECODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_backend:
        asyncio.run(_serve_forever(_backend_app(args.stream_tokens, args.stream_pace_ms), list(args.serve_backend)))
        return 0
    if args.serve_bare:
        from stack.common.logging import setup_logging

        setup_logging("router")  # JSON lines to stdout (DEVNULL here), as the real router logs
        port, p_url, d_url = args.serve_bare
        asyncio.run(_serve_forever(_bare_pd_app(p_url, d_url), [int(port)]))
        return 0
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
