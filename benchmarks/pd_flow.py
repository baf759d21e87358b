"""The PD flow's own CPU, and the whole router's: `PDClient.complete` and the router app against the same two legs
sent bare, in one process.

    python -m benchmarks.pd_flow [--requests 3000] [--rounds 6] [--without log,metrics,deadline]

The peers harness (benchmarks/router_peers.py) measures whole routers across cores, and on a small VM a send that
wakes the other core moves its figures by a fifth from repeat to repeat (docs/router-performance.md). Here the fake
backend of benchmarks.router runs on the same event loop as the client, requests go one at a time, and CPU comes
from process_time, so the only thing that differs between the two arms is the router's own Python:
  flow   PDClient.complete of a one-line chat request (pairing, the prefill leg, the hand-off, the decode leg, its
         metrics and log lines; lines go to /dev/null, flushed once per loop turn as deployed)
  legs   the same two legs on the router's HTTP client (engine_http.EngineHTTP) with nothing around them: the prefill
         leg's kv_transfer_params handed to the decode leg
  router the same request sent to the router app itself (create_app, served on this loop: the key, limits, usage in
         SQLite, the contract, the PD flow, every log line), as the load generator sends it
All include the backend's own CPU, so `flow - legs` is the flow's own. `router - legs` is the whole router's own CPU
plus the client's side of one more HTTP request (the same in every checkout): run it from two checkouts in turn to
compare them, where the peers harness cannot tell a few per cent apart. The arms alternate round by round; the
median of the rounds is printed with every round. `--without` replaces parts of the flow with no-ops in this
process only (its log lines, its metrics, the request's deadline), to see what each costs.
A measurement, not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvloop
from aiohttp import web

from benchmarks.router import KEY, MODEL, _backend_app, _free_port, _settings
from stack.common import metrics as common_metrics
from stack.common.logging import setup_logging
from stack.protocol.parse import parse
from stack.router import pairing, pd
from stack.router import config as router_config
from stack.router.app import create_app
from stack.router.engine_http import EngineHTTP, Timeout
from stack.router.fleet import Fleet
from stack.router.metrics import Metrics
from stack.router.upstream import new_session

_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello to the benchmark."}], "max_tokens": 8,
         "stream": False}
_LEG = Timeout(connect_s=5, total_s=60, read_s=30)


def without(parts: set[str]) -> None:
    """No-ops in place of the flow's parts named in `parts` (this process only)."""
    if "log" in parts:
        for module in (pd, pairing):
            module.log_event = lambda *_args, **_fields: None  # type: ignore[assignment]
    if "metrics" in parts:
        common_metrics.Counter.inc = lambda *_args, **_labels: None  # type: ignore[method-assign]
        common_metrics.Histogram.observe = lambda *_args, **_labels: None  # type: ignore[method-assign]
    if "deadline" in parts:
        async def run(self: pd.PDClient, job: pd.Job, tried: pairing.Tried) -> pd.Leg:
            return await self._run(job, tried)
        pd.PDClient._run_within_deadline = run  # type: ignore[method-assign]


async def measure(requests: int, rounds: int, tmp: Path) -> dict[str, list[float]]:
    setup_logging("router", sink=open("/dev/null", "w"))  # noqa: SIM115 - for the process's lifetime
    runner = web.AppRunner(_backend_app(8, 0), access_log=None)
    await runner.setup()
    ports = _free_port(), _free_port()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    prefill, decode = (f"http://127.0.0.1:{port}" for port in ports)
    router_port = _free_port()
    settings = router_config.load(_settings(tmp, prefill, decode, router_port, _free_port()))
    router_runner = web.AppRunner(create_app(settings, env={"BENCH_ROUTER_KEY": KEY}), access_log=None)
    await router_runner.setup()
    await web.TCPSite(router_runner, "127.0.0.1", router_port).start()
    to_router = (f"http://127.0.0.1:{router_port}/v1/chat/completions", json.dumps(_BODY).encode(),
                 {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    req = parse("chat", _BODY)
    raw = EngineHTTP()
    async with new_session() as session:
        fleet = Fleet(settings, session, Metrics())  # the router arm's settings: the same pools and scheduler
        await fleet.start()
        client = pd.PDClient(fleet, Metrics())

        async def flow() -> None:
            await client.complete("r" * 32, "chat", "/v1/chat/completions", req, dict(_BODY))

        async def legs() -> None:
            leg = dict(_BODY, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": "t" * 32})
            answer = await raw.post(prefill + "/v1/chat/completions", json.dumps(leg).encode(), {}, _LEG)
            params = json.loads(await answer.read())["kv_transfer_params"]
            answer.release()
            answer = await raw.post(decode + "/v1/chat/completions", json.dumps(dict(_BODY, kv_transfer_params=params)).encode(), {}, _LEG)
            json.loads(await answer.read())
            answer.release()

        async def router() -> None:
            url, body, headers = to_router
            answer = await raw.post(url, body, headers, _LEG)
            assert answer.status == 200, await answer.read()
            json.loads(await answer.read())
            answer.release()

        arms: dict[str, Callable[[], Awaitable[None]]] = {"flow": flow, "legs": legs, "router": router}
        for arm in arms.values():  # warm up: connections, caches
            for _ in range(200):
                await arm()
        cpu: dict[str, list[float]] = {name: [] for name in arms}
        for round_ in range(rounds):
            for name in (list(arms) if round_ % 2 == 0 else list(reversed(arms))):
                started = time.process_time()
                for _ in range(requests):
                    await arms[name]()
                cpu[name].append((time.process_time() - started) / requests * 1e6)
        await raw.close()
        await fleet.close()
    await router_runner.cleanup()
    await runner.cleanup()
    return cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pd_flow", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per arm and round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, the arms' order alternating")
    parser.add_argument("--without", default="", help="comma-separated: log, metrics, deadline")
    args = parser.parse_args(argv)
    parts = {p for p in args.without.split(",") if p}
    if parts - {"log", "metrics", "deadline"}:
        parser.error(f"--without: unknown part(s) {', '.join(sorted(parts - {'log', 'metrics', 'deadline'}))}")
    without(parts)
    with tempfile.TemporaryDirectory() as tmp:  # the router's usage file
        cpu = uvloop.run(measure(args.requests, args.rounds, Path(tmp)))
    flow, legs = statistics.median(cpu["flow"]), statistics.median(cpu["legs"])
    print(f"PD flow (PDClient.complete), CPU µs a request, median of {args.rounds} rounds"
          + (f", without {', '.join(sorted(parts))}" if parts else ""))
    for name in cpu:
        print(f"  {name:<5} {statistics.median(cpu[name]):7.0f}   rounds {' '.join(f'{x:.0f}' for x in cpu[name])}")
    print(f"  flow - legs {flow - legs:7.0f}   (the flow's own CPU above two bare legs; both include the backend's)")
    print(f"  router - legs {statistics.median(cpu['router']) - legs:5.0f}   (the whole router's, and the client's side "
          "of one more request)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
