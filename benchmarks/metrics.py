"""Per-observe cost of the router's own exposition code against `prometheus-client`.

    python -m benchmarks.metrics [--n 200000]

The hot paths: one unlabelled ITL `observe` per relayed token, one labelled TTFT `observe` and one
labelled counter `inc` per request. Measured with `timeit` (best of 5), in ns per call, on this
machine. prometheus-client is imported only if installed (`pip install prometheus-client`).
A measurement, not a test: it prints figures and ratios.
"""

from __future__ import annotations

import argparse
import timeit

from stack.router.metrics import ITL_BUCKETS, LATENCY_BUCKETS, Counter, Histogram


def _best_ns(stmt, n: int) -> float:
    return min(timeit.repeat(stmt, number=n, repeat=5)) / n * 1e9


def ours(n: int) -> dict[str, float]:
    itl = Histogram("itl", "", ITL_BUCKETS)
    ttft = Histogram("ttft", "", LATENCY_BUCKETS)
    requests = Counter("requests", "")
    return {
        "histogram observe, no labels (ITL)": _best_ns(lambda: itl.observe(0.012), n),
        "histogram observe, 1 label (TTFT)": _best_ns(lambda: ttft.observe(0.3, mode="pd"), n),
        "counter inc, 2 labels (requests)": _best_ns(lambda: requests.inc(api="chat", status="200"), n),
    }


def client(n: int) -> dict[str, float] | None:
    try:
        import prometheus_client as pc
    except ImportError:
        return None
    registry = pc.CollectorRegistry()
    itl = pc.Histogram("itl", "", buckets=ITL_BUCKETS, registry=registry)
    ttft = pc.Histogram("ttft", "", ["mode"], buckets=LATENCY_BUCKETS, registry=registry)
    requests = pc.Counter("requests", "", ["api", "status"], registry=registry)
    return {
        "histogram observe, no labels (ITL)": _best_ns(lambda: itl.observe(0.012), n),
        "histogram observe, 1 label (TTFT)": _best_ns(lambda: ttft.labels(mode="pd").observe(0.3), n),
        "counter inc, 2 labels (requests)": _best_ns(lambda: requests.labels(api="chat", status="200").inc(), n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000, help="calls per repeat")
    args = parser.parse_args()
    a, b = ours(args.n), client(args.n)
    print(f"{'operation':40} {'ours ns':>9} {'prometheus-client ns':>21} {'ratio':>6}")
    for name, ns in a.items():
        other = b[name] if b else float("nan")
        print(f"{name:40} {ns:9.0f} {other:21.0f} {other / ns:6.1f}")
    if b is None:
        print("prometheus-client is not installed: only our figures")


if __name__ == "__main__":
    main()
