"""The router's prefill budget settings from measured prefills (not a test): run it on a quiet machine.

    python -m benchmarks.prefill_budget [--model dummy:small] [--lengths 1024 2048 4096 8192] [--slack 3]

Times one whole-prompt prefill (the engine's `forward`) at each length, fits t(T) = a·T + b·T² (the weights' linear
cost plus attention's quadratic one, docs/deadlines.md) and prints what [scheduler] prefill_tokens_per_s and
prefill_attention_tokens follow from it: the throughput divided by `--slack` (a floor for a loaded host, not the
quiet one measured here) and T0 = a / b. It also prints the prefill time the fit predicts, and the budget those
settings give, for a 60k-token prompt.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks._common import best_time
from stack.engine.kv_cache import KVCache
from stack.engine.model import Segment, forward, load_model


def prefill_seconds(model_name: str, lengths: list[int], repeat: int) -> list[float]:
    """The fastest of `repeat` prefills of a random prompt at each length."""
    model = load_model(model_name)
    times = []
    for T in lengths:
        tokens = np.random.default_rng(T).integers(0, model.config.vocab_size, T)  # (T,)
        cache = KVCache(model.config, T)

        def run() -> None:
            cache.length = 0
            forward(model, [Segment(tokens, cache, 0)])

        times.append(best_time(run, repeat))
        print(f"  prefill {T:>7} tokens {times[-1]:10.2f} s  {T / times[-1]:8.0f} tok/s")
    return times


def fit(lengths: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares a, b ≥ 0 of t = a·T + b·T²."""
    T = np.asarray(lengths, dtype=np.float64)  # (n,)
    (a, b), *_ = np.linalg.lstsq(np.stack([T, T * T], axis=1), np.asarray(seconds), rcond=None)
    return max(float(a), 1e-12), max(float(b), 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefill_budget", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:small", help="dummy:tiny | dummy:small | an HF checkpoint directory")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="prompt lengths (tokens)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--slack", type=float, default=3.0, help="how much slower than measured a loaded host may be")
    parser.add_argument("--predict", type=int, default=60_000, help="the prompt length to predict for")
    args = parser.parse_args(argv)
    seconds = prefill_seconds(args.model, args.lengths, args.repeat)
    a, b = fit(args.lengths, seconds)
    tokens_per_s, t0 = 1 / a / args.slack, (a / b if b else 0.0)
    T = args.predict
    budget = T / tokens_per_s * (1 + (T / t0 if t0 else 0.0))
    quadratic = f"attention equal to the rest at {t0:.0f} tokens" if t0 else "no quadratic term found (use longer --lengths)"
    print(f"  fit: {1 / a:.0f} tok/s linear, {quadratic}")
    print(f"  [scheduler] prefill_tokens_per_s = {max(1, round(tokens_per_s))}    # measured / {args.slack:g}")
    print(f"  [scheduler] prefill_attention_tokens = {round(t0)}")
    print(f"  {T} tokens: the fit predicts {a * T + b * T * T:.0f} s here; those settings allow {budget:.0f} s of work")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
