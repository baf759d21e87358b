"""What the engine benchmarks share: the `Bench` record, timing, the loopback socket baseline, the CLI.

`python -m benchmarks.engine` runs every section; `python -m benchmarks.kv_transfer` only the
socket baseline and the KV-transfer figures. Both take the same flags and print the same header.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from stack.engine import gemm
from stack.engine.model import Model, load_model


@dataclass
class Bench:
    """What the sections share: the model, arguments, and the baselines measured so far."""

    model: Model
    prompt_tokens: int
    repeat: int
    baselines: dict[str, float] = field(default_factory=dict)
    clock: Callable[[], float] = time.perf_counter  # time.process_time with --clock cpu

    def report(self, label: str, value: str, ratio: str = "") -> None:
        print(f"  {label:<44} {value:>22}  {ratio}")


Section = Callable[[Bench], None]


def best_time(fn: Callable[[], object], repeat: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Fastest of `repeat` runs in seconds (the machine is shared: the minimum is the least noisy)."""
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def loopback_socket_bandwidth(nbytes: int = 256 * 2**20, chunk: int = 4 * 2**20) -> float:
    """GB/s of one TCP connection over 127.0.0.1 pushing `nbytes` (the raw baseline for KV transfer)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def drain() -> None:
        conn, _ = server.accept()
        with conn:
            buf = bytearray(chunk)
            while conn.recv_into(buf):
                pass

    reader = threading.Thread(target=drain)
    reader.start()
    payload = memoryview(bytes(chunk))
    with socket.create_connection(("127.0.0.1", port)) as client:
        t0 = time.perf_counter()
        for _ in range(nbytes // chunk):
            client.sendall(payload)
        client.shutdown(socket.SHUT_WR)
        reader.join()
        seconds = time.perf_counter() - t0
    server.close()
    return nbytes / seconds / 1e9


def socket_bandwidth(bench: Bench) -> None:
    gbps = max(loopback_socket_bandwidth() for _ in range(bench.repeat))
    bench.baselines["socket_gbps"] = gbps
    bench.report("loopback TCP socket bandwidth", f"{gbps:8.2f} GB/s")


def main(module: str, name: str, description: str, sections: Sequence[Section], argv: list[str] | None = None) -> None:
    """Parse the shared flags, print the run's header, run `sections` in order on one `Bench`."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("--model", default="dummy:small", help="dummy:tiny | dummy:small | HF checkpoint dir")
    parser.add_argument("--prompt", type=int, default=800, help="prompt / context length in tokens")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is reported")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu = process CPU time: robust on a busy shared machine; needs OPENBLAS_NUM_THREADS=1")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and os.environ.get("OPENBLAS_NUM_THREADS") != "1":
        parser.error("--clock cpu counts every thread's CPU time: run with OPENBLAS_NUM_THREADS=1")
    env = {k: os.environ.get(k, "-") for k in ("OPENBLAS_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_CORETYPE",
                                          "OPENBLAS_L2_SIZE", "KMP_BLOCKTIME")}
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{name} benchmark: model {args.model}, numpy {np.__version__}, cpus {os.cpu_count()}, "
          f"load average {load}, env {env}")
    model = load_model(args.model)
    print(f"weight matmuls: {gemm.describe(model.matmul)}, CPU vendor {gemm.cpu_vendor()} (stack/engine/gemm.py)")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    bench = Bench(model, args.prompt, args.repeat, clock=clock)
    for section in sections:
        print(f"[{section.__name__}]")
        section(bench)
