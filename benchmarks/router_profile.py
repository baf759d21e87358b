"""Where the router's CPU goes: py-spy samples of the real router under load, grouped by the code that spent them.

    python -m benchmarks.router_profile [--mode plain|pd] [--phase requests|streams] [--requests 5000] [--prompt hello|agentic]
        [--concurrency 32] [--stream-tokens 64] [--stream-pace-ms 1] [--rate 250] [--top 30] [--raw FILE]

Starts benchmarks.router's fake backend and the full router (`python -m stack.router`, its JSON lines to a file as
deployed; the router pinned to the first core, the backend and the load to the others), attaches `py-spy record`
(the dev extra) to the router for one load phase, and prints
  by our module   each sample goes to the innermost frame of our code (stack/, doctor/) on its stack, with whatever
                  library it was calling (aiohttp, json, sqlite3) counted there; samples with none of our code on
                  the stack (aiohttp's server and client internals, the event loop) go to their leaf's library
  by function     the functions with the most own time (the leaf frame)
Shares only: sampling and a shared machine move absolute times, not proportions much. The figures in
docs/router-performance.md come from benchmarks.router_peers on a quiet machine, never from this.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.router import KEY, _free_port, _load, _pin, _prompt, _settings, _wait_ready

_FRAME = re.compile(r"(?P<function>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
_OURS = re.compile(r"(?:^|/)((?:stack|doctor)/.+\.py)$")
_LIBRARY = re.compile(r"(?:site-packages|python3\.\d+)/([\w.-]+)")


def _frames(stack: str) -> list[tuple[str, str]]:
    """(function, file) for each frame of one collapsed py-spy stack, outermost first."""
    frames = []
    for text in stack.split(";"):
        match = _FRAME.match(text)
        frames.append((match["function"], match["file"]) if match else (text, ""))
    return frames


def _owner(frames: list[tuple[str, str]]) -> str:
    """The innermost of our modules on the stack, else the leaf's library (or its file)."""
    for _function, file in reversed(frames):
        if (ours := _OURS.search(file)) is not None:
            return ours.group(1)
    file = frames[-1][1] if frames else "?"
    library = _LIBRARY.search(file)
    return f"[{library.group(1).removesuffix('.py')}]" if library else f"[{Path(file).name or file}]"


def summarise(raw: str, top: int) -> str:
    """The two tables for py-spy's `--format raw` output (collapsed stacks, one `stack count` per line)."""
    owners: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = _frames(stack)
        owners[_owner(frames)] += int(count)
        function, file = frames[-1]
        leaves[f"{function} ({_OURS.search(file).group(1) if _OURS.search(file) else Path(file).name})"] += int(count)
    total = sum(owners.values()) or 1
    out = [f"{total} samples", "", "by our module (libraries it called included)"]
    out += [f"  {100 * n / total:5.1f}%  {name}" for name, n in owners.most_common(top)]
    out += ["", "by function (own time)"]
    out += [f"  {100 * n / total:5.1f}%  {name}" for name, n in leaves.most_common(top)]
    return "\n".join(out)


async def _profile(args: argparse.Namespace, tmp: Path) -> str:
    p_port, d_port, port = _free_port(), _free_port(), _free_port()
    prefill, decode = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    python = sys.executable
    backend = subprocess.Popen([python, "-m", "benchmarks.router", "--serve-backend", str(p_port), str(d_port),
                                "--stream-tokens", str(args.stream_tokens), "--stream-pace-ms", str(args.stream_pace_ms)])
    log = (tmp / "router.log").open("wb")
    settings = _settings(tmp, prefill if args.mode == "pd" else decode, decode, port, _free_port())
    router = subprocess.Popen([python, "-m", "stack.router", "--config", str(settings)], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "BENCH_ROUTER_KEY": KEY})
    # The router alone on the first core, the backend and the load on the others. py-spy counts a thread that is
    # runnable but not running as busy: sharing a core, the router lost it to the backend its own send had just woken,
    # and the leg's socket write took 22% of the samples (11.5% pinned; perf puts 7% of the router's CPU in the kernel).
    cores = sorted(os.sched_getaffinity(0))
    _pin(router.pid, {cores[0]})
    for pid in (0, backend.pid):
        _pin(pid, set(cores[1:]) or {cores[0]})
    spy = None
    try:
        await _wait_ready(decode + "/v1/models")
        await _wait_ready(f"http://127.0.0.1:{port}/health")
        url, stream = f"http://127.0.0.1:{port}/v1/chat/completions", args.phase == "streams"
        await _load(url, 200, args.concurrency, stream, args.stream_tokens, _prompt(args.prompt))  # warm up: connections, caches
        out = args.raw or tmp / "router.raw"
        spy = subprocess.Popen([str(Path(python).with_name("py-spy")), "record", "--pid", str(router.pid), "--rate", str(args.rate),
                                "--format", "raw", "--output", str(out), "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        await asyncio.sleep(1.0)  # py-spy attaches
        n = args.requests // (10 if stream else 1)
        await _load(url, n, args.concurrency, stream, args.stream_tokens, _prompt(args.prompt))
        spy.send_signal(2)  # SIGINT: py-spy writes what it sampled and exits
        _, err = spy.communicate(timeout=60)
        if spy.returncode not in (0, -2) and not Path(out).exists():
            raise RuntimeError(f"py-spy failed: {err.decode()[-500:]}")
        return Path(out).read_text()
    finally:
        for proc in (spy, router, backend):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(10)
        log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("plain", "pd"), default="plain", help="one upstream leg, or prefill + decode")
    parser.add_argument("--phase", choices=("requests", "streams"), default="requests")
    parser.add_argument("--requests", type=int, default=5000, help="non-streamed requests (streams: a tenth as many)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=64, help="chunks per streamed answer")
    parser.add_argument("--stream-pace-ms", type=float, default=1.0, help="ms between the backend's stream chunks (0: a burst)")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--prompt", choices=("hello", "agentic"), default="hello", help="benchmarks.router's --prompt")
    parser.add_argument("--raw", type=Path, help="keep py-spy's collapsed stacks here (flamegraph.pl or speedscope read them)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="router-profile-") as tmp:
        print(summarise(asyncio.run(_profile(args, Path(tmp))), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
