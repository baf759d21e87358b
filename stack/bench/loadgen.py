"""Open-loop load: gamma/Poisson arrivals, a concurrency cap, and a streaming SSE client.

Arrivals follow `vllm bench serve`: gaps are gamma(shape=burstiness, scale=1/(rate·burstiness)),
so burstiness 1 is a Poisson process and the coefficient of variation of the gaps is
1/sqrt(burstiness); `rate=inf` sends everything at t=0; the cumulative times are rescaled so the
last request leaves at n/rate (vLLM does this to make runs with different seeds comparable).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
import uuid
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TextIO

import aiohttp
import numpy as np

from stack.bench.metrics import RequestOutcome, outcome_from_chunks
from stack.common.sse import DONE, read_events


def gamma_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """(n,) inter-arrival gaps in seconds: gamma(k=burstiness, θ=1/(rate·burstiness)); 0 at rate=inf."""
    assert burstiness > 0, f"burstiness must be > 0, got {burstiness}"
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """(n,) send offsets from the start; rescaled so the last one is at n/rate (as vLLM)."""
    times = np.cumsum(gamma_gaps(n, rate, burstiness, rng))
    if n and times[-1] > 0:
        times *= (n / rate) / times[-1]
    return times


@dataclass
class Progress:
    """A one-line progress bar on stderr (`done/total`, elapsed), redrawn as requests finish."""

    total: int
    stream: TextIO | None = field(default_factory=lambda: sys.stderr)
    done: int = 0
    failed: int = 0
    started: float = field(default_factory=time.perf_counter)

    def update(self, outcome: RequestOutcome) -> None:
        self.done += 1
        self.failed += not outcome.success
        if self.stream is None:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        elapsed = time.perf_counter() - self.started
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
            f" failed={self.failed} {elapsed:6.1f}s"
        )
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    prompt_len: int,
    clock_zero: float,
) -> RequestOutcome:
    """POST one streaming request and time every SSE chunk as it arrives (perf_counter).

    Never raises for a failed request: non-200 answers, broken streams and timeouts become a
    failed outcome carrying the error text.
    """
    start = time.perf_counter()
    chunks: list[tuple[float, dict[str, Any]]] = []
    request_headers = {**headers, "X-Request-ID": f"bench-{uuid.uuid4().hex[:16]}"}
    try:
        async with session.post(url, json=payload, headers=request_headers) as response:
            if response.status != 200:
                body = (await response.text())[:300]
                return _failed(start - clock_zero, prompt_len, f"HTTP {response.status}: {body}")
            async for _event, data in read_events(response.content):
                timestamp = time.perf_counter()
                if data.strip() == DONE:
                    continue
                chunks.append((timestamp, json.loads(data)))
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        return _failed(start - clock_zero, prompt_len, f"{type(exc).__name__}: {exc}")
    outcome = outcome_from_chunks(start, chunks, prompt_len)
    outcome.start_time = start - clock_zero
    return outcome


def _failed(start_time: float, prompt_len: int, error: str) -> RequestOutcome:
    return RequestOutcome(success=False, error=error, prompt_len=prompt_len, start_time=start_time)


@dataclass(frozen=True)
class Job:
    """One request to send: body and the prompt length the summary counts if no usage arrives."""

    payload: dict[str, Any]
    prompt_len: int


async def run_load(
    session: aiohttp.ClientSession,
    url: str,
    jobs: Sequence[Job],
    headers: dict[str, str],
    send_times: Sequence[float],
    max_concurrency: int | None = None,
    progress: Progress | None = None,
) -> tuple[list[RequestOutcome], float]:
    """Send `jobs[i]` at `send_times[i]` (s from start), at most `max_concurrency` in flight.

    Returns outcomes in job order and the run's wall-clock duration (first send → last answer).
    A request that arrives while the cap is reached waits for a slot (vLLM's semaphore).
    """
    limit: AbstractAsyncContextManager[Any] = (
        asyncio.Semaphore(max_concurrency) if max_concurrency else nullcontext()
    )
    clock_zero = time.perf_counter()

    async def one(job: Job, at: float) -> RequestOutcome:
        await asyncio.sleep(max(0.0, clock_zero + at - time.perf_counter()))
        async with limit:
            outcome = await stream_request(session, url, job.payload, headers, job.prompt_len, clock_zero)
        if progress is not None:
            progress.update(outcome)
        return outcome

    outcomes = await asyncio.gather(*(one(job, at) for job, at in zip(jobs, send_times)))
    return list(outcomes), time.perf_counter() - clock_zero
