"""stack.bench.metrics: vLLM's TTFT/TPOT/ITL/E2EL/goodput definitions on hand-computed streams."""

from __future__ import annotations

import pytest

from stack.bench.metrics import (
    NO_TOKEN_ERROR,
    SLOError,
    outcome_from_chunks,
    parse_goodput,
    summarize,
    tpot,
)


def chat(content: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}


def usage(completion: int, prompt: int = 7) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


# Sent at t=10.0: first chunk (empty content) at 10.5, tokens at 10.75 and 11.0, usage at 11.25.
THREE_TOKENS = [(10.5, chat("")), (10.75, chat("a")), (11.0, chat("b")), (11.25, usage(3))]
# Sent at t=0: one token at 0.25, usage says 1 completion token.
ONE_TOKEN = [(0.25, chat("x")), (0.5, usage(1, prompt=4))]


def test_ttft_itl_e2el_tpot_of_one_stream() -> None:
    """TTFT counts the first choices chunk even when empty; E2EL stops at the last token, not usage."""
    outcome = outcome_from_chunks(10.0, THREE_TOKENS, prompt_len=99)
    assert outcome.success and outcome.error == ""
    assert outcome.ttft == pytest.approx(0.5)
    assert outcome.itl == pytest.approx([0.25, 0.25])
    assert outcome.latency == pytest.approx(1.0)  # 11.0 − 10.0; the usage chunk at 11.25 is not a token
    assert outcome.output_tokens == 3
    assert outcome.prompt_len == 7  # usage.prompt_tokens wins over the client's estimate
    assert tpot(outcome) == pytest.approx((1.0 - 0.5) / (3 - 1))
    assert outcome.generated_text == "ab"


def test_stream_without_usage_counts_chunks() -> None:
    """With no usage chunk, output tokens are the number of choices chunks and prompt_len stays."""
    outcome = outcome_from_chunks(0.0, [(0.1, chat("a")), (0.2, chat("b")), (0.4, chat("c"))], prompt_len=12)
    assert (outcome.success, outcome.output_tokens, outcome.prompt_len) == (True, 3, 12)
    assert outcome.latency == pytest.approx(0.4)


def test_completions_text_chunks() -> None:
    """/v1/completions chunks carry `text`, not `delta`; they count the same way."""
    chunks = [(1.0, {"choices": [{"index": 0, "text": "hi"}]}), (1.5, {"choices": [{"index": 0, "text": "!"}]})]
    outcome = outcome_from_chunks(0.5, chunks)
    assert (outcome.ttft, outcome.itl, outcome.generated_text) == (pytest.approx(0.5), [pytest.approx(0.5)], "hi!")


def test_single_token_has_zero_tpot() -> None:
    """A one-token answer has TPOT 0 (passes any TPOT SLO) and adds no ITL sample."""
    outcome = outcome_from_chunks(0.0, ONE_TOKEN)
    assert (outcome.output_tokens, outcome.itl, tpot(outcome)) == (1, [], 0.0)


def test_only_usage_chunk_is_a_failure() -> None:
    """A stream whose only chunk has empty choices fails with vLLM's message."""
    outcome = outcome_from_chunks(0.0, [(0.3, usage(0))], prompt_len=5)
    assert not outcome.success
    assert outcome.error == NO_TOKEN_ERROR


def test_in_band_error_chunk_fails_the_request() -> None:
    """An `error` frame after some tokens (router's mid-stream failure) fails the request with its message."""
    chunks = [(0.1, chat("a")), (0.2, {"error": {"message": "decode engine went away", "type": "upstream_error"}})]
    outcome = outcome_from_chunks(0.0, chunks)
    assert not outcome.success
    assert outcome.error == "decode engine went away"


def outcomes():
    """Three requests: three tokens, one token, failed."""
    return [
        outcome_from_chunks(10.0, THREE_TOKENS),
        outcome_from_chunks(0.0, ONE_TOKEN),
        outcome_from_chunks(0.0, [(0.1, {"error": "boom"})]),
    ]


def test_summary_counts_throughput_and_distributions() -> None:
    """Failed requests are counted, never in latency stats; TPOT only over >1-token requests; ITL pooled."""
    result = summarize(outcomes(), duration_s=2.0, percentile_metrics=["ttft", "tpot", "itl", "e2el"],
                       percentiles=[50, 99])
    assert (result["completed"], result["failed"]) == (2, 1)
    assert result["total_input_tokens"] == 7 + 4
    assert result["total_output_tokens"] == 3 + 1
    assert result["request_throughput"] == pytest.approx(1.0)
    assert result["output_throughput"] == pytest.approx(2.0)
    assert result["total_token_throughput"] == pytest.approx(7.5)
    assert result["request_goodput"] is None  # no --goodput given
    assert result["mean_ttft_ms"] == pytest.approx(375.0)  # (500 + 250) / 2
    assert result["std_ttft_ms"] == pytest.approx(125.0)  # population std, as numpy/vLLM
    assert result["mean_tpot_ms"] == pytest.approx(250.0)  # the one-token request is left out
    assert result["median_itl_ms"] == pytest.approx(250.0)
    assert result["p99_e2el_ms"] == pytest.approx(250 + 0.99 * 750)  # linear interpolation between 250 and 1000
    assert result["p50_ttft_ms"] == pytest.approx(375.0)


def test_goodput_needs_every_slo() -> None:
    """Goodput counts completed requests meeting every SLO (≤ passes), divided by the duration."""
    assert summarize(outcomes(), 2.0, goodput_ms={"ttft": 300})["request_goodput"] == pytest.approx(0.5)
    assert summarize(outcomes(), 2.0, goodput_ms={"tpot": 200})["request_goodput"] == pytest.approx(0.5)
    assert summarize(outcomes(), 2.0, goodput_ms={"e2el": 1000})["request_goodput"] == pytest.approx(1.0)
    both = summarize(outcomes(), 2.0, goodput_ms={"ttft": 600, "tpot": 200})
    assert both["request_goodput"] == pytest.approx(0.5)  # the 3-token request misses TPOT


def test_all_failed_gives_zero_stats() -> None:
    """With no completed request every latency stat is 0 (vLLM's `or 0`), not NaN or an exception."""
    result = summarize(outcomes()[2:], 1.0, goodput_ms={"ttft": 1})
    assert (result["completed"], result["failed"], result["request_goodput"]) == (0, 1, 0.0)
    assert result["mean_ttft_ms"] == 0.0 and result["p99_itl_ms"] == 0.0


def test_parse_goodput() -> None:
    """`--goodput` pairs become ms SLOs; unknown keys, negatives and junk are rejected."""
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:0"]) == {"ttft": 500.0, "tpot": 50.5, "e2el": 0.0}
    for bad in ("itl:5", "ttft:-1", "ttft", "ttft:abc"):
        with pytest.raises(SLOError, match="bad --goodput"):
            parse_goodput([bad])
