"""Serving metrics exactly as `vllm bench serve` defines them, as pure functions.

One streamed request becomes a `RequestOutcome` (`outcome_from_chunks`), and a run's outcomes
become the summary (`summarize`) whose keys are vLLM's result JSON field names:

- TTFT: send → first chunk with non-empty `choices` (even if its delta/text is empty).
- ITL: gaps between consecutive `choices` chunks, pooled across all requests.
- E2EL: send → last `choices` chunk (the trailing usage chunk does not count).
- TPOT: (E2EL − TTFT) / (output_tokens − 1) per request with more than one output token;
  a request with ≤ 1 output token has TPOT 0 for goodput and is left out of the TPOT stats.
- output_tokens: the usage chunk's `completion_tokens`; without it, the number of `choices`
  chunks (vLLM re-tokenizes the text instead; our byte-level engine emits one token per chunk).
- goodput: completed requests meeting every given SLO (ms, "≤ SLO" passes) ÷ run duration.

Failed requests keep their error and count in `failed`; they never enter latency statistics.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")
NO_TOKEN_ERROR = "Never received a valid chunk to calculate TTFT."  # vLLM's wording


@dataclass
class RequestOutcome:
    """What the client saw of one request (times in seconds, `start_time` on the run's clock)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    start_time: float = 0.0
    generated_text: str = ""


class SLOError(ValueError):
    """A `--goodput` argument that is not `ttft|tpot|e2el:<non-negative ms>`."""


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not sep or name not in GOODPUT_KEYS or not number >= 0:
            raise SLOError(f"bad --goodput {pair!r}: expected KEY:MS with KEY in {list(GOODPUT_KEYS)} and MS >= 0")
        slos[name] = number
    return slos


def outcome_from_chunks(
    start: float, chunks: Iterable[tuple[float, dict[str, Any]]], prompt_len: int = 0
) -> RequestOutcome:
    """Timestamped parsed SSE chunks of one stream -> its outcome (vLLM's openai request funcs).

    A chunk carrying an `error` object fails the request with that message (the router reports
    mid-stream upstream failures that way); a stream with no `choices` chunk fails with vLLM's
    message.
    """
    outcome = RequestOutcome(prompt_len=prompt_len, start_time=start)
    last: float | None = None
    chunk_count = 0
    usage_tokens = 0
    text: list[str] = []
    for timestamp, data in chunks:
        if data.get("error"):
            error = data["error"]
            outcome.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return outcome
        if choices := data.get("choices"):
            if last is None:
                outcome.ttft = timestamp - start
            else:
                outcome.itl.append(timestamp - last)
            last = timestamp
            chunk_count += 1
            text.append(_choice_text(choices[0]))
        elif usage := data.get("usage"):
            usage_tokens = int(usage.get("completion_tokens") or 0)
            outcome.prompt_len = int(usage.get("prompt_tokens") or prompt_len)
    if last is None:
        outcome.error = NO_TOKEN_ERROR
        return outcome
    outcome.success = True
    outcome.latency = last - start
    outcome.output_tokens = usage_tokens or chunk_count
    outcome.generated_text = "".join(text)
    return outcome


def _choice_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    content = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return content if isinstance(content, str) else ""


def tpot(outcome: RequestOutcome) -> float:
    """(E2EL − TTFT)/(output_tokens − 1); 0 for ≤ 1 output token (vLLM's goodput convention)."""
    if outcome.output_tokens <= 1:
        return 0.0
    return (outcome.latency - outcome.ttft) / (outcome.output_tokens - 1)


def is_good(outcome: RequestOutcome, slos_ms: dict[str, float]) -> bool:
    """A completed request meets every given SLO (value ≤ SLO, in ms)."""
    values = {"ttft": outcome.ttft, "tpot": tpot(outcome), "e2el": outcome.latency}
    return outcome.success and all(values[name] * 1000 <= slo for name, slo in slos_ms.items())


def distribution(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """Mean, median, std and percentiles in ms of values in seconds (all 0 when empty, as vLLM)."""
    array = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000
    stats = {"mean": float(array.mean()), "median": float(np.median(array)), "std": float(array.std())}
    for p in percentiles:
        stats[f"p{percentile_word(p)}"] = float(np.percentile(array, p))
    return stats


def percentile_word(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9" (vLLM's key spelling)."""
    return str(int(p)) if int(p) == p else str(p)


def metric_values(outcomes: Sequence[RequestOutcome]) -> dict[str, list[float]]:
    """Per-metric samples in seconds over completed requests (ITL pooled, TPOT only for >1 token)."""
    done = [o for o in outcomes if o.success]
    return {
        "ttft": [o.ttft for o in done],
        "tpot": [tpot(o) for o in done if o.output_tokens > 1],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }


def peak_concurrency(outcomes: Sequence[RequestOutcome]) -> int:
    """Most completed requests in flight at once (half-open [start, end) intervals)."""
    events = sorted(
        [(o.start_time, 1) for o in outcomes if o.success]
        + [(o.start_time + o.latency, -1) for o in outcomes if o.success]
    )
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def summarize(
    outcomes: Sequence[RequestOutcome],
    duration_s: float,
    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
    percentiles: Sequence[float] = (99,),
    goodput_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run summary with vLLM's JSON field names (`mean_ttft_ms`, `p99_itl_ms`, …)."""
    done = [o for o in outcomes if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    good = sum(is_good(o, goodput_ms) for o in done) if goodput_ms else 0
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": good / duration_s if goodput_ms else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_concurrent_requests": peak_concurrency(outcomes),
    }
    samples = metric_values(outcomes)
    for name in percentile_metrics:
        for stat, value in distribution(samples[name], percentiles).items():
            result[f"{stat}_{name}_ms"] = value
    return result


def detailed_fields(outcomes: Sequence[RequestOutcome]) -> dict[str, list[Any]]:
    """vLLM's per-request lists (kept with `--save-detailed`; the compare charts use them)."""
    return {
        "input_lens": [o.prompt_len for o in outcomes],
        "output_lens": [o.output_tokens if o.success else 0 for o in outcomes],
        "ttfts": [o.ttft for o in outcomes],
        "itls": [o.itl for o in outcomes],
        "latencies": [o.latency for o in outcomes],
        "start_times": [o.start_time for o in outcomes],
        "errors": [o.error for o in outcomes],
    }
