"""Our router next to the routers a user would pick instead (smg, vllm-router, sglang-router, LiteLLM), in one run.

    cd <repo> && WORK/venv-harness/bin/python -m benchmarks.router_peers --peers PEERS -- \
        --work WORK --pd-python $PWD/.cache/deployed-venv/bin/python --targets direct pd-deploy pd-deploy-asyncio \
        pd-deploy-redis smg vllm-router vllm-router-rr sglang-router --repeats 2 --out WORK/A.json

`--pd-python` must be an absolute path: bench.py starts each router in its own run folder (cwd). Give it the
interpreter the image runs (`scripts/deployed-python.sh` makes .cache/deployed-venv: Debian's CPython 3.11 and the
image's wheelhouse); another build of 3.11 measures another router (pyenv's default build: ~10% slower).
PEERS is the peers harness (its README: `setup.sh WORK` makes one venv per peer, each `pip install`ed from
PyPI, outside this project's venv; `bench.py` starts a fake backend and each router pinned to one core,
and reads the router's CPU from /proc). Everything after `--` goes to its bench.py unchanged. This script
adds arms of our own router to the harness's targets, so a choice that only exists to be measured is made
here, by how the process is started, never by a switch in the product:

  pd-deploy          the router as shipped (uvloop)
  pd-deploy-asyncio  the same with the stock asyncio event loop (uvloop's loop factory swapped before start)
  pd-deploy-redis    per-key limits in a Redis (a redis-server this script starts on the client core, with the
                     deployments' append-only persistence): the limiter's cost is this row minus pd-deploy's
  pd-deploy-floor    benchmarks/floor_router.py: aiohttp's server, uvloop and the legs' client with nothing else (no
                     checks, limits, usage or logs), the least a router built on these parts spends
  pd-deploy-before   the router of another checkout (`--before DIR`, e.g. `git worktree add DIR HEAD~1`), started
                     the same way: a change's effect measured in the same run as the peers

`--log-pipe` writes every pd-deploy arm's stdout (its JSON log lines) into a pipe that a process outside the router's
process tree drains, as Docker's log driver does in a deployment; without it the harness writes it to a file.

Each row: CPU µs per request (plain / PD), µs per relayed stream chunk, added latency; `report.py A.json`
prints the table (docs/router-performance.md). Tiny check that everything starts and answers:
`-- --work WORK --pd-python $PWD/.cache/deployed-venv/bin/python --targets direct pd-deploy pd-deploy-redis --repeats 1
--requests 50 --seq-requests 20 --streams 8 --ttft-streams 2 --chunks 8 --max-s 5`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

_REPO = Path(__file__).resolve().parents[1]
_MAIN = "import sys\nfrom stack.router.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"
# The arms' code runs in the router process before its main(): `python -c CODE --config settings.toml`.
_ARMS = {
    "asyncio": "import asyncio, uvloop\nuvloop.new_event_loop = asyncio.new_event_loop\n" + _MAIN,
    "redis": _MAIN,
}


# --log-pipe: the router's fd 1 becomes the write end of a FIFO before its main() runs (its stdout is made on fd 1).
_TO_PIPE = "import os\nos.dup2(os.open(os.environ['PD_BENCH_LOG_FIFO'], os.O_WRONLY), 1)\n"
_DRAIN = "import os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\nwhile os.read(fd, 1 << 16):\n    pass\n"


def _load_harness(peers: Path) -> ModuleType:
    sys.path.insert(0, str(peers))  # bench.py imports its siblings (loadgen, report) by name
    return importlib.import_module("bench")


def _with_arms(bench: ModuleType, redis_url: str | None, before: Path | None, drains: list[subprocess.Popen[bytes]] | None,
               client_core: int) -> type:
    """The harness's Target, knowing our arms too; `drains` (--log-pipe): the pipes' readers started so far."""

    harness = bench.Target

    def to_pipe(argv: list[str], env: dict, rundir: Path, name: str, mode: str, port: int) -> list[str]:
        """`argv` with its stdout a FIFO, and the FIFO's reader started (on the client core, outside the router's tree)."""
        if drains is None or not argv:
            return argv
        fifo = rundir / f"{name}-{mode}-{port}.log.fifo"
        os.mkfifo(fifo)
        taskset = shutil.which("taskset")
        drains.append(subprocess.Popen(([taskset, "-c", str(client_core)] if taskset else []) + [sys.executable, "-c", _DRAIN, str(fifo)],
                                       start_new_session=True))
        env["PD_BENCH_LOG_FIFO"] = str(fifo)
        python, flag, what, *rest = argv
        code = what if flag == "-c" else f"import runpy\nrunpy.run_module({what!r}, run_name='__main__', alter_sys=True)\n"
        return [python, "-c", _TO_PIPE + code, *rest]

    class Target(harness):
        def modes(self) -> list[str]:
            return ["plain", "pd"] if self.name.startswith("pd-deploy-") else super().modes()

        def command(self, mode: str, port: int, rundir: Path) -> tuple[list[str], dict, str, str | None]:
            if not self.name.startswith("pd-deploy"):
                return super().command(mode, port, rundir)
            argv, env, ready, skip = self._ours(mode, port, rundir)
            return to_pipe(argv, env, rundir, self.name, mode, port), env, ready, skip

        def _ours(self, mode: str, port: int, rundir: Path) -> tuple[list[str], dict, str, str | None]:
            shipped = harness("pd-deploy", self.work, self.pd_python, self.prefill, self.decode)
            argv, env, ready, skip = shipped.command(mode, port, rundir)
            env["PYTHONPATH"] = str(_REPO)  # this checkout's router, whichever checkout --pd-python was installed from
            if self.name == "pd-deploy":
                return argv, env, ready, skip
            if self.name == "pd-deploy-before":
                if before is None:
                    return [], env, "", "pd-deploy-before needs --before DIR (a checkout of the router to compare)"
                env["PYTHONPATH"] = str(before)
                return argv, env, ready, skip
            if self.name == "pd-deploy-floor":
                return [self.pd_python, "-m", "benchmarks.floor_router", *argv[argv.index("--config"):]], env, ready, skip
            arm = self.name.removeprefix("pd-deploy-")
            if arm not in _ARMS:
                return [], env, "", f"unknown arm {arm!r} (known: {', '.join(_ARMS)})"
            if arm == "redis":
                if redis_url is None:
                    return [], env, "", "redis-server not found (scripts/redis-server.sh installs it)"
                env["LIMITS_REDIS_URL"] = redis_url
            return [self.pd_python, "-c", _ARMS[arm], *argv[argv.index("--config"):]], env, ready, skip

    return Target


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_redis(folder: Path, core: int) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server on a free loopback port, persisted as the deployments run it; returns once it answers PING."""
    port = _free_port()
    taskset = shutil.which("taskset")
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--appendonly", "yes",
            "--appendfsync", "everysec", "--save", "", "--protected-mode", "no"]
    process = subprocess.Popen(([taskset, "-c", str(core)] if taskset else []) + argv, stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit("redis-server did not answer PING within 20 s")
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__)
    parser.add_argument("--peers", required=True, type=Path, help="the peers harness folder (bench.py, setup.sh)")
    parser.add_argument("--before", type=Path, default=None, help="the checkout the pd-deploy-before arm runs")
    parser.add_argument("--log-pipe", action="store_true", help="our routers log into a pipe another process drains (as under Docker)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench.py's own arguments")
    args = parser.parse_args()
    forwarded = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    bench = _load_harness(args.peers.resolve())
    wants_redis = any(arg == "pd-deploy-redis" for arg in forwarded)
    client_core = int(forwarded[forwarded.index("--client-core") + 1]) if "--client-core" in forwarded else 0
    redis, redis_url = None, None
    drains: list[subprocess.Popen[bytes]] | None = [] if args.log_pipe else None
    with tempfile.TemporaryDirectory(prefix="router-peers-redis-") as folder:
        try:
            if wants_redis and shutil.which("redis-server"):
                redis, redis_url = _start_redis(Path(folder), client_core)
            bench.Target = _with_arms(bench, redis_url, args.before.resolve() if args.before else None, drains, client_core)
            sys.argv = [str(args.peers / "bench.py"), *forwarded]
            return bench.main()
        finally:
            if redis is not None:
                redis.terminate()
                redis.wait(timeout=10)
            for drain in drains or ():  # each ends at its router's exit; one whose router never started is stopped here
                drain.kill()
                drain.wait(timeout=10)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
