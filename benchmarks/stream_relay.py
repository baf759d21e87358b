"""A streamed chunk's CPU through the router against the floor gateway, in one process.

    python -m benchmarks.stream_relay [--streams 200] [--tokens 64] [--pace-ms 0.5] [--rounds 6] [--mode pd|plain]
                                      [--api chat|messages|responses]

The peers harness (benchmarks/router_peers.py) divides a stream's whole CPU by its chunks across two cores, and on a
small VM its repeats move by a fifth. Here the fake backend of benchmarks.router paces `--tokens` chunks `--pace-ms`
apart (each chunk its own network read, as a real engine's tokens are; under uvloop a pause under a millisecond
lasts one loop turn, and each chunk still arrives alone), and two gateways serve on the same event
loop as the client, which sends one streamed chat request at a time and reads it to its end:
  floor   benchmarks/floor_router.py: aiohttp's server, the legs' client, the body relayed as bytes; nothing else
  router  the router app itself (create_app: the key, limits, usage in SQLite, the contract, the PD flow, the relay,
          every log line)
CPU comes from process_time and includes the backend's and the client's, the same in both arms, so `router - floor`
per chunk is what the router's own layers cost a chunk (the request's own cost spread over its chunks included, as
the harness counts it). With `--api messages` (or `responses`) the router relays each stream as Anthropic Messages
(or Responses) events, the floor still as chat bytes: the difference is then what such a client's chunk costs the
router. Arms alternate round by round; the median of the rounds is printed with every round. Run it from two
checkouts in turn to compare them. A measurement, not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import uvloop
from aiohttp import web

from benchmarks.floor_router import build as floor_app
from benchmarks.router import KEY, MODEL, _backend_app, _free_port, _settings
from stack.common.logging import setup_logging
from stack.router import config as router_config
from stack.router.app import create_app
from stack.router.engine_http import EngineHTTP, Timeout

_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello to the benchmark."}], "stream": True}
_LEG = Timeout(connect_s=5, total_s=60, read_s=30)


async def _serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def gateways(tokens: int, pace_ms: float, mode: str, tmp: Path) -> tuple[dict[str, int], list[web.AppRunner]]:
    """The fake backend and both gateways served on this loop: ({"floor": port, "router": port}, runners to clean up)."""
    setup_logging("router", sink=open("/dev/null", "w"))  # noqa: SIM115 - for the process's lifetime
    ports = _free_port(), _free_port()
    backend = await _serve(_backend_app(tokens, pace_ms), ports[0])
    await web.TCPSite(backend, "127.0.0.1", ports[1]).start()
    prefill, decode = (f"http://127.0.0.1:{port}" for port in ports)
    if mode == "plain":
        prefill = decode  # as the harness runs plain: both roles on one backend, no prefill leg
    router_port, floor_port = _free_port(), _free_port()
    path = _settings(tmp, prefill, decode, router_port, _free_port())
    os.environ["BENCH_ROUTER_KEY"] = KEY  # the floor reads its key from the environment, as deployed
    runners = [backend, await _serve(create_app(router_config.load(path), env={"BENCH_ROUTER_KEY": KEY}), router_port)]
    runners.append(await _serve(floor_app({"taotoken": {"api_key_env": "BENCH_ROUTER_KEY"}, "prefill": {"endpoint": prefill},
                                           "decode": {"endpoint": decode}}), floor_port))
    return {"floor": floor_port, "router": router_port}, runners


# Each API's path, and its stream's last event (the last read holds it whole).
_PATH = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
_LAST = {"chat": b"data: [DONE]\n\n", "messages": b"event: message_stop\n",
         "responses": b"event: response.incomplete\n"}  # the answer stops at max_output_tokens


def _body(api: str, tokens: int, stream: bool) -> dict:
    if api == "responses":
        return {"model": MODEL, "input": _BODY["messages"][0]["content"], "max_output_tokens": tokens, "stream": stream}
    return {**_BODY, "max_tokens": tokens, "stream": stream}  # chat, and Anthropic Messages (the same fields)


class Client:
    """Sends one chat (or `api="messages"` / `"responses"`, the router only) request to a gateway and reads its
    answer to the end (a stream: up to its last event)."""

    def __init__(self, tokens: int, stream: bool, api: str = "chat") -> None:
        self.body = json.dumps(_body(api, tokens, stream)).encode()
        self.headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        self.stream, self.api = stream, api
        self.http = EngineHTTP()

    async def send(self, port: int) -> None:
        answer = await self.http.post(f"http://127.0.0.1:{port}{_PATH[self.api]}", self.body, self.headers, _LEG)
        assert answer.status == 200, await answer.read()
        received = b""
        while block := await answer.readany():
            received = block
        ended = received.find(_LAST[self.api]) >= 0 and received.endswith(b"\n\n") if self.stream else received.endswith(b"}")
        assert ended, received[-200:]
        answer.release()


async def measure(args: argparse.Namespace, tmp: Path) -> dict[str, list[float]]:
    arms, runners = await gateways(args.tokens, args.pace_ms, args.mode, tmp)
    # --api messages|responses: the router is sent that API, the floor (which cannot translate) the same as chat.
    clients = {"floor": Client(args.tokens, stream=True), "router": Client(args.tokens, stream=True, api=args.api)}
    for name, port in arms.items():  # warm up: connections, caches
        for _ in range(20):
            await clients[name].send(port)
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    for round_ in range(args.rounds):
        for name in (list(arms) if round_ % 2 == 0 else list(reversed(arms))):
            started = time.process_time()
            for _ in range(args.streams):
                await clients[name].send(arms[name])
            cpu[name].append((time.process_time() - started) / (args.streams * args.tokens) * 1e6)
    for client in clients.values():
        await client.http.close()
    for runner in reversed(runners):
        await runner.cleanup()
    return cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stream_relay", description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200, help="streams per arm and round")
    parser.add_argument("--tokens", type=int, default=64, help="chunks a stream")
    parser.add_argument("--pace-ms", type=float, default=0.5, help="the backend's gap between chunks (0: one burst)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, the arms' order alternating")
    parser.add_argument("--mode", choices=("pd", "plain"), default="pd", help="pd: a prefill leg, then decode's stream")
    parser.add_argument("--api", choices=("chat", "messages", "responses"), default="chat",
                        help="messages, responses: the router relays the stream as that API's events (the floor as chat)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:  # the router's usage file
        cpu = uvloop.run(measure(args, Path(tmp)))
    floor, router = statistics.median(cpu["floor"]), statistics.median(cpu["router"])
    print(f"{args.mode} {args.api} streams of {args.tokens} chunks {args.pace_ms:g} ms apart: CPU µs a chunk (backend and "
          f"client included), median of {args.rounds} rounds")
    for name in cpu:
        print(f"  {name:<6} {statistics.median(cpu[name]):6.1f}   rounds {' '.join(f'{x:.1f}' for x in cpu[name])}")
    print(f"  router - floor {router - floor:5.1f}   (the router's own layers a chunk, its request's share included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
