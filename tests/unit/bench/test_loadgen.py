"""stack.bench.loadgen: arrival process statistics, the concurrency cap and the streaming client."""

from __future__ import annotations

import io
import math

import aiohttp
import numpy as np
import pytest

from stack.bench.loadgen import Job, Progress, arrival_times, gamma_gaps, run_load, stream_request

N = 4000
RATE = 10.0


@pytest.mark.parametrize("burstiness", [1.0, 4.0, 0.25])
def test_gaps_have_mean_one_over_rate_and_cv_one_over_sqrt_burstiness(burstiness: float) -> None:
    """Gamma gaps: mean 1/rate and coefficient of variation 1/sqrt(burstiness) (1 = Poisson)."""
    gaps = gamma_gaps(N, RATE, burstiness, np.random.default_rng(1))
    cv = 1 / math.sqrt(burstiness)
    # The sample mean's standard error is sd/sqrt(N) = (cv/rate)/sqrt(N); allow 5 of them.
    assert abs(gaps.mean() - 1 / RATE) < 5 * (cv / RATE) / math.sqrt(N)
    # The sample CV's spread grows with the gamma's kurtosis (3 + 6/k); ~4% relative covers
    # 5 standard errors for k >= 1 and 2 for k = 0.25 at N = 4000, and a wrong shape is far off.
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1 if burstiness < 1 else 0.04)


def test_poisson_counts_per_window_match_rate() -> None:
    """Poisson arrivals: counts per 1 s window have mean ≈ variance ≈ rate (index of dispersion 1)."""
    times = np.cumsum(gamma_gaps(N, RATE, 1.0, np.random.default_rng(2)))
    counts = np.bincount(times.astype(int))[:-1]  # drop the last, partial window
    # ~400 windows: the mean's standard error is sqrt(10/400) ≈ 0.16, the dispersion's ≈ 0.07.
    assert counts.mean() == pytest.approx(RATE, abs=0.8)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.3)


def test_arrival_times_end_at_n_over_rate() -> None:
    """Send times increase and are rescaled so the last leaves at n/rate (vLLM); inf sends all at 0."""
    times = arrival_times(100, 5.0, 1.0, np.random.default_rng(3))
    assert np.all(np.diff(times) >= 0)
    assert times[-1] == pytest.approx(100 / 5.0)
    assert not arrival_times(10, math.inf, 1.0, np.random.default_rng(3)).any()
    assert np.allclose(np.diff(arrival_times(5, 2.0, math.inf, np.random.default_rng(3))), 0.5)


async def test_max_concurrency_is_never_exceeded(sse_server, plan) -> None:
    """30 requests sent at once with --max-concurrency 4: the server never sees more than 4 in flight."""
    plan.tokens, plan.gap = 3, 0.01
    jobs = [Job({"model": "m", "stream": True}, 5)] * 30
    async with aiohttp.ClientSession() as session:
        outcomes, _ = await run_load(session, str(sse_server.make_url("/v1/chat/completions")), jobs, {},
                                     [0.0] * 30, max_concurrency=4)
    assert all(o.success for o in outcomes)
    assert plan.max_in_flight == 4  # reached (the cap binds) and never exceeded


async def test_client_times_chunks(sse_server, plan) -> None:
    """TTFT and ITL follow the server's delays: 0.2 s to the first token, then 0.1 s gaps."""
    plan.tokens, plan.first_delay, plan.gap = 4, 0.2, 0.1
    url = str(sse_server.make_url("/v1/chat/completions"))
    async with aiohttp.ClientSession() as session:
        outcome = await stream_request(session, url, {"stream": True}, {"Authorization": "Bearer k"}, 5, 0.0)
    assert outcome.success and outcome.output_tokens == 4
    # Lower bounds: the server sleeps at least this long (minus timer granularity); upper bounds
    # (+0.25 s) only catch a client that buffers the stream or hangs on a loaded 2-core box.
    assert 0.195 <= outcome.ttft < 0.45
    assert len(outcome.itl) == 3
    assert all(0.095 <= gap < 0.35 for gap in outcome.itl)
    assert 0.495 <= outcome.latency < 0.9
    assert plan.headers[0]["Authorization"] == "Bearer k"
    assert plan.headers[0]["X-Request-ID"].startswith("bench-")


async def test_http_error_is_a_failed_outcome(sse_server, plan) -> None:
    """A 401 answer becomes a failed outcome carrying status and body, not an exception."""
    plan.status = 401
    async with aiohttp.ClientSession() as session:
        outcome = await stream_request(session, str(sse_server.make_url("/v1/chat/completions")), {}, {}, 5, 0.0)
    assert not outcome.success
    assert outcome.error.startswith("HTTP 401") and "invalid api key" in outcome.error


async def test_unreachable_server_is_a_failed_outcome(unused_tcp_port) -> None:
    """Connection refused becomes a failed outcome with the client error's name."""
    async with aiohttp.ClientSession() as session:
        outcome = await stream_request(session, f"http://127.0.0.1:{unused_tcp_port}/v1/chat/completions",
                                       {}, {}, 5, 0.0)
    assert not outcome.success and "ClientConnectorError" in outcome.error


def test_progress_bar_counts_failures() -> None:
    """The progress line shows done/total and failures, and ends with a newline."""
    from stack.bench.metrics import RequestOutcome

    out = io.StringIO()
    bar = Progress(2, stream=out)
    bar.update(RequestOutcome(success=True))
    bar.update(RequestOutcome(success=False, error="x"))
    assert "2/2 failed=1" in out.getvalue() and out.getvalue().endswith("\n")
