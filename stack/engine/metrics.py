"""The engine's Prometheus metrics: vLLM's names where vLLM has the same thing, `pd_` for the rest.

vLLM's names and labels are those of `vllm/v1/metrics/loggers.py` (PrometheusStatLogger, read at
vllm-project/vllm 005a810 and a6f0308; the newer ITL / per-request TPOT names as vLLM dashboards use them): every
series carries `model_name` (the served model id) and `engine` ("0": one engine core per process),
counters end in `_total` (prometheus-client adds it to `vllm:prompt_tokens`), and
`vllm:request_success_total` has `finished_reason`. So a dashboard written for vLLM reads ours:

  vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc     (gauges)
  vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:request_success_total   (counters)
  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds (and its older name
  vllm:time_per_output_token_seconds: the same per-token gaps), vllm:request_time_per_output_token_seconds,
  vllm:e2e_request_latency_seconds,
  vllm:request_queue_time_seconds, vllm:request_prefill_time_seconds,
  vllm:request_decode_time_seconds, vllm:iteration_tokens_total                        (histograms)

The prefix cache (prefix_cache.py) has vLLM v1's `vllm:prefix_cache_queries_total` and
`vllm:prefix_cache_hits_total` (prompt tokens looked up / found cached, at admission: the hit rate is
their ratio) and `vllm:kv_cache_usage_perc` counts cached blocks as free, as vLLM does (they are
reclaimable). Ours (no vLLM equivalent): `pd_prefix_cache_evictions_total` (blocks),
`pd_engine_busy_seconds_total` (step loop computing: its rate is the engine's utilisation),
`pd_engine_steps_total`, `pd_engine_kv_blocks{state="used"|"cached"|"free"}`, and the KV transfer between prefill and decode:
`pd_kv_transfer_bytes_total{side="send"|"receive"}`, `pd_kv_transfer_seconds{side}` (send: header
to ack; receive: header to last byte), `pd_kv_transfer_failures_total{side,reason}` (reason: the
KVTransferError reason or the consumer's reply code) and `pd_kv_receive_buffer_bytes{state="used"|"size"}`.
Histograms and counters are fed by one call per event from the scheduler, the hand-off and the KV
consumer; gauges are read at scrape time.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Protocol

from stack.common.metrics import CONTENT_TYPE, Collector, Counter, GaugeSample, Histogram, render_gauges

# vLLM's buckets (loggers.py), so quantiles compare across both engines.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# KV transfer (s): a few hundred µs for a tiny prompt on loopback up to seconds for long ones.
KV_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


# What the metrics read, described here rather than imported: the scheduler, the prefix cache and the KV consumer
# report to EngineMetrics, so importing their classes back made the engine's only import circle. Read-only
# properties, so a class with plain attributes (list[int] for Collection[int]) matches.

class TimedRequest(Protocol):
    """A request's tokens and its time.perf_counter stamps (stack.engine.sequence.Sequence)."""

    @property
    def prompt(self) -> Collection[int]: ...
    @property
    def output(self) -> Collection[int]: ...
    @property
    def arrival(self) -> float: ...
    @property
    def prefill_started(self) -> float | None: ...
    @property
    def first_token_at(self) -> float: ...
    @property
    def last_token_at(self) -> float: ...


class BlockPool(Protocol):
    @property
    def total_blocks(self) -> int: ...
    @property
    def free_blocks(self) -> int: ...


class CachedBlocks(Protocol):
    @property
    def blocks(self) -> Collection[object]: ...


class QueueView(Protocol):
    """What a scrape reads from the engine's scheduler: its queues and its KV blocks."""

    @property
    def pool(self) -> BlockPool: ...
    @property
    def prefix(self) -> CachedBlocks: ...
    @property
    def running(self) -> Collection[object]: ...
    @property
    def waiting(self) -> Collection[object]: ...


class ReceiveBuffer(Protocol):
    """What a scrape reads from decode's KV consumer."""

    @property
    def buffer_used(self) -> int: ...
    @property
    def buffer_size(self) -> int: ...
    @property
    def held_transfers(self) -> int: ...


class EngineMetrics:
    """All engine metrics; the scheduler, hand-off and KV consumer call its `on_*` methods."""

    def __init__(self, model_name: str = "", engine: str = "0") -> None:
        c = {"model_name": model_name, "engine": engine}
        self.const = c
        self.prompt_tokens = Counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", c)
        self.generation_tokens = Counter("vllm:generation_tokens_total", "Number of generation tokens processed.", c)
        self.request_success = Counter("vllm:request_success_total", "Count of processed requests by finished_reason.", c)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS, c)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TPOT_BUCKETS, c)
        # vLLM fed `time_per_output_token_seconds` with every inter-token gap, then renamed it inter_token_latency
        # and kept the old name beside it; the per-request TPOT is `request_time_per_output_token_seconds`.
        self.itl_old = Histogram("vllm:time_per_output_token_seconds", "Inter-token latency (vLLM's older name for it).", TPOT_BUCKETS, c)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Histogram of time per output token per request in seconds.", TPOT_BUCKETS, c)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS, c)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS, c)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS, c)
        self.decode = Histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS, c)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_BUCKETS, c)
        self.busy = Counter("pd_engine_busy_seconds_total", "Seconds the step loop spent computing (rate = utilisation, 0..1).", c)
        self.steps = Counter("pd_engine_steps_total", "Engine steps (forward passes) run.", c)
        self.kv_bytes = Counter("pd_kv_transfer_bytes_total", "KV cache bytes moved between prefill and decode, by side.", c)
        self.kv_seconds = Histogram("pd_kv_transfer_seconds", "KV transfer time per side (send: header to ack; receive: header to last byte).", KV_BUCKETS, c)
        self.prefix_queries = Counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in prompt tokens looked up.", c)
        self.prefix_hits = Counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in prompt tokens found cached.", c)
        self.prefix_evictions = Counter("pd_prefix_cache_evictions_total", "Cached KV blocks evicted (least recently used) to make room.", c)
        self.kv_reused = Counter("pd_kv_transfer_reused_blocks_total", "KV blocks a transfer did not ship: decode already held them.", c)
        self.kv_failures = Counter("pd_kv_transfer_failures_total", "Failed KV transfers by side and reason.", c)
        for counter in (self.prompt_tokens, self.generation_tokens, self.busy, self.steps, self.prefix_queries, self.prefix_hits,
                        self.prefix_evictions):
            counter.inc(0)  # a series from the first scrape: rate() works before the first request
        self._collectors: list[Collector] = []
        self._gauge_help = {
            "vllm:num_requests_running": "Number of requests in model execution batches.",
            "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
            "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
            "pd_engine_kv_blocks": "KV pool blocks by state (used: reserved by requests, cached: prefix cache, free).",
            "pd_kv_receive_buffer_bytes": "Decode's KV receive buffer: bytes used and its size (kv_buffer_size).",
            "pd_kv_held_transfers": "Transfers received and not yet claimed by their decode request.",
        }

    # -- scheduler -----------------------------------------------------------------------------------

    def on_step(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        self.steps.inc()
        self.busy.inc(seconds)
        self.iteration_tokens.observe(prefill_tokens + decode_tokens)

    def on_prefill_done(self, seq: TimedRequest, now: float) -> None:
        started = seq.prefill_started or seq.arrival
        self.prompt_tokens.inc(len(seq.prompt))
        self.queue.observe(started - seq.arrival)
        self.prefill.observe(now - started)

    def on_token(self, seq: TimedRequest, now: float) -> None:
        """A token was appended to `seq` (before its first/last token times are updated)."""
        self.generation_tokens.inc()
        if len(seq.output) == 1:
            self.ttft.observe(now - seq.arrival)
        else:
            self.itl.observe(now - seq.last_token_at)
            self.itl_old.observe(now - seq.last_token_at)

    def on_finish(self, seq: TimedRequest, reason: str, now: float) -> None:
        self.request_success.inc(finished_reason=reason)
        self.e2e.observe(now - seq.arrival)
        if len(seq.output) > 1:
            decode = seq.last_token_at - seq.first_token_at
            self.decode.observe(decode)
            self.tpot.observe(decode / (len(seq.output) - 1))

    # -- prefix cache ----------------------------------------------------------------------------

    def on_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries.inc(queried_tokens)
        self.prefix_hits.inc(hit_tokens)

    def on_prefix_evicted(self, blocks: int) -> None:
        self.prefix_evictions.inc(blocks)

    # -- KV transfer -----------------------------------------------------------------------------

    def on_kv_sent(self, nbytes: int, seconds: float) -> None:
        self.kv_bytes.inc(nbytes, side="send")
        self.kv_seconds.observe(seconds, side="send")

    def on_kv_received(self, nbytes: int, seconds: float, reused_blocks: int = 0) -> None:
        self.kv_reused.inc(reused_blocks)
        self.kv_bytes.inc(nbytes, side="receive")
        self.kv_seconds.observe(seconds, side="receive")

    def on_kv_failed(self, side: str, reason: str) -> None:
        self.kv_failures.inc(side=side, reason=reason)

    # -- scrape time -----------------------------------------------------------------------------

    def watch(self, scheduler: QueueView, consumer: ReceiveBuffer | None) -> None:
        """Read the queue, the KV pool and (decode) the receive buffer at every scrape."""
        c = self.const

        def collect() -> Iterable[GaugeSample]:
            pool, cached = scheduler.pool, len(scheduler.prefix.blocks)
            used = pool.total_blocks - pool.free_blocks - cached
            yield "vllm:num_requests_running", c, len(scheduler.running)
            yield "vllm:num_requests_waiting", c, len(scheduler.waiting)
            yield "vllm:kv_cache_usage_perc", c, used / pool.total_blocks if pool.total_blocks else 0.0
            yield "pd_engine_kv_blocks", {**c, "state": "used"}, used
            yield "pd_engine_kv_blocks", {**c, "state": "cached"}, cached
            yield "pd_engine_kv_blocks", {**c, "state": "free"}, pool.free_blocks
            if consumer is not None:
                yield "pd_kv_receive_buffer_bytes", {**c, "state": "used"}, consumer.buffer_used
                yield "pd_kv_receive_buffer_bytes", {**c, "state": "size"}, consumer.buffer_size
                yield "pd_kv_held_transfers", c, consumer.held_transfers

        self._collectors.append(collect)

    def render(self) -> tuple[str, str]:
        parts: list[str] = []
        for metric in (self.prompt_tokens, self.generation_tokens, self.request_success, self.ttft, self.itl, self.itl_old, self.tpot,
                       self.e2e, self.queue, self.prefill, self.decode, self.iteration_tokens, self.busy, self.steps,
                       self.prefix_queries, self.prefix_hits, self.prefix_evictions, self.kv_bytes, self.kv_seconds, self.kv_reused,
                       self.kv_failures):
            parts.extend(metric.render())
        parts.extend(render_gauges(self._gauge_help, self._collectors))
        return "".join(parts), CONTENT_TYPE
