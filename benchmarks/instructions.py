"""The router's own instructions a request, counted by callgrind: a figure no other load on the machine moves.

    python -m benchmarks.instructions [--mode pd|plain] [--api chat|messages|responses] [--tokens 64] [--stream] [--requests 50] [--repeats 2] [--keep DIR]

On a small VM a timing of the router moves by a fifth from repeat to repeat (docs/router-performance.md), so a change
that saves a few per cent cannot be told from noise by the clock. Valgrind's callgrind counts the instructions a
process executes instead: the same program on the same input gives the same count whatever else the machine runs.
Each arm runs `benchmarks.stream_relay`'s setup in one process under callgrind (the fake backend, the gateway, a
client sending one chat request at a time). Instructions are counted only around `--requests` requests after a
warm-up: the process starts valgrind's instrumentation and dumps its count through callgrind's client requests
(a helper of two C functions, compiled with gcc against valgrind's callgrind.h and called through ctypes), so the
start-up (imports, the app's set-up, a first request's caches) is not counted. The arms:
  floor   benchmarks/floor_router.py: aiohttp's server, the legs' client, the body relayed as bytes
  router  the router app itself (create_app: the key, limits, usage in SQLite, the contract, the PD flow, the relay,
          every log line)
  messages, responses  with `--api messages` (or `responses`): the router again, the same requests sent as Anthropic
          Messages (or Responses): `messages - router` is the translation's own count, the legs to the engines being
          the same chat requests
All include the backend's and the client's instructions, the same in each, so `router - floor` is what our layers
execute a request. A streamed request's chunks come `--pace-ms` apart (each its own network read, as an engine's
tokens are: under callgrind the process runs ~50x slower, hence a wide default gap).

Instructions are not CPU time: how fast they run depends on the CPU and on caches. Use this to tell whether a change
cuts work, then time what matters with the peers harness (benchmarks.router_peers) on a quiet machine.
`--keep DIR` keeps each run's callgrind file, for `callgrind_annotate` (which C functions the instructions ran in).
A measurement, not a test: it prints figures. Needs valgrind (Debian's `valgrind` package).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import uvloop

from benchmarks.stream_relay import Client, gateways

_TOTALS = re.compile(rb"^(?:totals|summary):\s+(\d+)", re.MULTILINE)
# Callgrind's client requests are macros (a magic instruction sequence valgrind recognises): C functions around them.
_HELPER = """#include <valgrind/callgrind.h>
void measure_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void measure_stop(void) { CALLGRIND_DUMP_STATS_AT("measured"); CALLGRIND_STOP_INSTRUMENTATION; }
"""


def _helper(folder: Path) -> ctypes.CDLL:
    source, library = folder / "measure.c", folder / "measure.so"
    source.write_text(_HELPER)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], check=True)
    return ctypes.CDLL(str(library))


async def _run(args: argparse.Namespace, tmp: Path) -> None:
    """One arm under callgrind: a warm-up of 10 requests, then `--requests` counted ones."""
    measure = _helper(tmp)
    arms, runners = await gateways(args.tokens, args.pace_ms if args.stream else 0, args.mode, tmp)
    translated = args.run not in arms  # messages, responses: the router serving that API
    client = Client(args.tokens, stream=args.stream, api=args.run if translated else "chat")
    port = arms["router" if translated else args.run]
    for _ in range(10):
        await client.send(port)
    measure.measure_start()
    for _ in range(args.requests):
        await client.send(port)
    measure.measure_stop()
    await client.http.close()
    for runner in reversed(runners):
        await runner.cleanup()


def count(arm: str, requests: int, args: argparse.Namespace, out: Path) -> int:
    """Instructions `arm` ran serving `requests` requests (after its warm-up)."""
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", sys.executable, "-m", "benchmarks.instructions",
               "--run", arm, "--requests", str(requests), "--mode", args.mode, "--tokens", str(args.tokens),
               "--pace-ms", str(args.pace_ms)] + (["--stream"] if args.stream else [])
    # A fixed hash seed: set and dict iteration orders, so the same run executes the same instructions.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dump = out.with_name(out.name + ".1")  # the first dump, measure_stop's; the file at exit counts nothing
    found = _TOTALS.search(dump.read_bytes())
    if found is None:
        raise RuntimeError(f"no totals in {dump}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions", description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("pd", "plain"), default="pd", help="pd: a prefill leg, then decode's")
    parser.add_argument("--stream", action="store_true", help="streamed requests (default: whole answers)")
    parser.add_argument("--tokens", type=int, default=64, help="chunks a stream (max_tokens)")
    parser.add_argument("--pace-ms", type=float, default=20.0, help="the backend's gap between a stream's chunks")
    parser.add_argument("--requests", type=int, default=50, help="requests counted in each run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternating (their spread is printed)")
    parser.add_argument("--keep", type=Path, help="keep the callgrind files here")
    parser.add_argument("--api", choices=("chat", "messages", "responses"), default="chat",
                        help="messages, responses: also the router serving the same requests as that API")
    parser.add_argument("--run", choices=("floor", "router", "messages", "responses"), help=argparse.SUPPRESS)  # the process under callgrind
    args = parser.parse_args(argv)
    if args.run:
        with tempfile.TemporaryDirectory() as tmp:  # the helper, the router's usage file
            uvloop.run(_run(args, Path(tmp)))
        return 0
    for tool in ("valgrind", "gcc"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not installed (apt-get install {tool})")
    kind = f"streams of {args.tokens} chunks" if args.stream else f"whole answers of {args.tokens} tokens"
    print(f"{args.mode} {kind}: instructions a request (backend and client included), {args.requests} requests a run")
    arms = ("floor", "router") + ((args.api,) if args.api != "chat" else ())
    per_request: dict[str, list[float]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for repeat in range(args.repeats):
            for arm in (arms if repeat % 2 == 0 else reversed(arms)):
                out = folder / f"callgrind.{args.mode}.{f'stream{args.tokens}' if args.stream else 'whole'}.{arm}.{repeat}"
                per_request[arm].append(count(arm, args.requests, args, out) / args.requests)
    for arm, counts in per_request.items():
        print(f"  {arm:<6} {statistics.median(counts) / 1e3:10.1f} k   runs {' '.join(f'{c / 1e3:.1f}' for c in counts)}")
    median = {arm: statistics.median(counts) for arm, counts in per_request.items()}
    differences = [("router", "floor")] + ([(args.api, "router")] if args.api != "chat" else [])
    for arm, base in differences:  # messages - router: the translation's own (the same chat legs in both)
        own = median[arm] - median[base]
        print(f"  {arm} - {base} {own / 1e3:8.1f} k" + (f"   ({own / args.tokens / 1e3:.2f} k a chunk)" if args.stream else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
