"""The PD flow: pick a decode then a prefill, run the prefill leg, hand its KV params to decode, relay.

    complete(): decode answers one JSON body          stream(): decode's SSE chunks, yielded as lists of dicts
    attempt n: D = acquire(decode)  ─▶ P = acquire(prefill) ─▶ POST P {max_tokens: 1, kv_transfer_params…}
               (prefill failure: another P, same D)  ─▶ POST D {original, kv_transfer_params from P}
               (decode failure before its first chunk: a new pair, n+1)

Colocated (prefill endpoints == decode endpoints) sends one plain request. With vLLM P2pNccl
engines (`registry=True`, p2pnccl.py) the pools are the instances that registered, and the KV route
travels in the legs' request id instead of kv_transfer_params. Failures after the
first chunk was yielded are raised to the caller, who ends the client's stream in-band. A stream
that ends without a finish_reason and `[DONE]` is an error, never a silent truncation.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from loguru import logger

from stack.common import events
from stack.common.errors import REQUEST_ID_HEADER, UpstreamError
from stack.common.health import NOT_SERVING, SERVING, TIMEOUT, UNREACHABLE, probe_async
from stack.common.logging import log_event
from stack.common.sse import DONE, read_event_batches
from stack.router.backends import Backend, Breaker, PoolConfig, build_pool, check_topology, is_colocated
from stack.router.metrics import GaugeSample, Metrics
from stack.router.p2pnccl import leg_request_id
from stack.router.relay import LegFailed, exception_failure, open_stream, post_json, status_failure, timeout
from stack.router.scheduler import NoBackendAvailable, Scheduler, SchedulerConfig

_BREAKER_STATE = {"closed": 0, "half_open": 1, "open": 2}


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A cheap prompt-length estimate for load accounting (~4 characters a token)."""
    prompt = body.get("messages", body.get("prompt", ""))
    if isinstance(prompt, str):
        return 1 + len(prompt) // 4
    chars = 0
    for item in prompt if isinstance(prompt, list) else ():
        content = item.get("content", "") if isinstance(item, dict) else item
        chars += len(content) if isinstance(content, str) else len(str(content))
    return 1 + chars // 4 + 4 * (len(prompt) if isinstance(prompt, list) else 0)


@dataclass
class _Job:
    """One client request as the PD flow sees it."""

    request_id: str
    path: str
    body: dict[str, Any]
    stream: bool
    prompt_tokens: int
    max_tokens: int
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def make(cls, request_id: str, path: str, body: dict[str, Any], stream: bool, default_max_tokens: int) -> _Job:
        # kv_transfer_params belong to the router: a client must not steer the engines' KV plumbing.
        clean = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        limit = clean.get("max_completion_tokens") or clean.get("max_tokens") or default_max_tokens
        return cls(request_id, path, clean, stream, estimate_prompt_tokens(clean), int(limit) if isinstance(limit, int) else default_max_tokens)

    @property
    def decode_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens

    def prefill_body(self, kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
        body = {k: v for k, v in self.body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
        body.update(stream=False, max_tokens=1)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return body

    def decode_body(self, kv_params: dict[str, Any] | None) -> dict[str, Any]:
        body = dict(self.body)
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        else:
            body["stream"] = False
            body.pop("stream_options", None)
        if kv_params is not None:
            body["kv_transfer_params"] = kv_params
        return body


def _push_params(transfer_id: str, decode_kv_addr: str) -> dict[str, Any]:
    """The prefill leg's kv_transfer_params. Ours: transfer_id + decode_kv_addr (push). vLLM NixlConnector:
    the None fields, as its toy proxy sends them."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id, "decode_kv_addr": decode_kv_addr,
            "remote_engine_id": None, "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass
class _Leg:
    """An answered decode leg: the backend (slot held), and the JSON body or the open stream."""

    decode: Backend
    answer: dict[str, Any] | None = None
    response: aiohttp.ClientResponse | None = None
    batches: AsyncIterator[list[tuple[str | None, str]]] | None = None  # the rest of the stream, per network read
    first: dict[str, Any] | None = None  # the first chunk, checked before anything reached the client
    rest: list[str] = field(default_factory=list)  # the other frames that arrived with the first


class _Tally:
    """What a relayed stream has shown so far: token chunks (ITL observed between them), finish, usage."""

    def __init__(self, metrics: Metrics, started: float) -> None:
        self.metrics = metrics
        self.last = started
        self.tokens = 0
        self.finished = False
        self.usage: dict[str, Any] | None = None

    def count(self, chunks: list[dict[str, Any]]) -> None:
        now = time.perf_counter()  # chunks of one batch arrived together: the gaps inside it are 0
        for chunk in chunks:
            choices = chunk.get("choices")
            if choices:
                if self.tokens:
                    self.metrics.itl.observe(now - self.last)
                self.tokens += 1
                self.last = now
                self.finished = self.finished or bool(choices[0].get("finish_reason"))
            if chunk.get("usage"):
                self.usage = chunk["usage"]


class PDClient:
    """Runs client requests over the prefill and decode pools (see the module docstring)."""

    def __init__(self, prefill: PoolConfig, decode: PoolConfig, scheduler: SchedulerConfig, session: aiohttp.ClientSession,
                 metrics: Metrics, model_id: str = "", registry: bool = False) -> None:
        """`registry`: the pools start empty and fill as vLLM P2pNccl instances register (add_backend)."""
        if not registry:
            check_topology(prefill, decode)
        self.config = scheduler
        self.p2pnccl = registry
        self.colocated = not registry and is_colocated(prefill, decode)
        self.mode = "colocated" if self.colocated else "disaggregated"
        self._pool_configs = {"prefill": prefill, "decode": decode}
        threshold, cooldown = scheduler.breaker_failures, scheduler.breaker_cooldown_ms / 1000
        pools = {"decode": [] if registry else build_pool(decode, "both" if self.colocated else "decode", threshold, cooldown)}
        if not self.colocated:
            pools["prefill"] = [] if registry else build_pool(prefill, "prefill", threshold, cooldown)
        self.backends: list[Backend] = [b for pool in pools.values() for b in pool]
        self._background: set[asyncio.Task[None]] = set()
        self.scheduler = Scheduler(scheduler, pools)
        self.session = session
        self.metrics = metrics
        self.backend_model = model_id
        self._model_learned = False
        self._monitor: asyncio.Task[None] | None = None
        self._timeouts = {
            "prefill": timeout(scheduler.connect_timeout_ms, scheduler.prefill_timeout_ms),
            "decode_json": timeout(scheduler.connect_timeout_ms, scheduler.request_timeout_ms),
            "decode_stream": timeout(scheduler.connect_timeout_ms, scheduler.request_timeout_ms, scheduler.idle_timeout_ms),
            "tokenize": timeout(scheduler.connect_timeout_ms, scheduler.first_token_timeout_ms),
        }
        self._first_chunk_s = (scheduler.kv_transfer_timeout_ms + scheduler.first_token_timeout_ms) / 1000
        metrics.add_gauges({
            "pd_router_backend_up": "1 if the backend's gRPC health is SERVING (as last probed).",
            "pd_router_backend_in_flight": "Requests the router has in flight on the backend.",
            "pd_router_backend_outstanding_tokens": "Prompt + max tokens the router has outstanding on the backend.",
            "pd_router_backend_circuit": "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
            "pd_router_queue_depth": "Requests waiting for a backend slot.",
        }, self._gauges)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Probe health once (so the first requests see real states), learn the model id, start the monitor."""
        if self.config.health_interval_ms:
            await self._probe_all()
            self._monitor = asyncio.create_task(self._monitor_loop(), name="pd-health-monitor")
        await self._learn_model()

    def add_backend(self, role: str, url: str, zmq_address: str) -> None:
        """A registered vLLM P2pNccl instance joins its pool; its health is vLLM's GET /health."""
        pool = self._pool_configs[role]
        breaker = Breaker(url, self.config.breaker_failures, self.config.breaker_cooldown_ms / 1000)
        backend = Backend(url, role, pool.max_concurrent, zmq_address, f"{url}/health", breaker, "http")  # type: ignore[arg-type]
        self.scheduler.pools[role].append(backend)
        self.backends.append(backend)
        self.scheduler.wake_all(role)
        if role == "decode" and not self._model_learned:
            task = asyncio.get_running_loop().create_task(self._learn_model())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def remove_backend(self, url: str) -> None:
        """A registered instance left: no new requests go there (those in flight finish or fail on their own)."""
        for pool in self.scheduler.pools.values():
            pool[:] = [b for b in pool if b.url != url]
        self.backends[:] = [b for b in self.backends if b.url != url]

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
            self._monitor = None

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_ms / 1000)
            try:
                await self._probe_all()
            except Exception:  # noqa: BLE001 - a probe bug must not silently end health checking
                logger.opt(exception=True).error("backend health round failed; retrying next interval")

    async def _probe_all(self) -> None:
        probe_timeout = min(2.0, max(0.2, self.config.health_interval_ms / 1000))
        backends = list(self.backends)  # P2pNccl instances may join or leave while the probes run
        states = await asyncio.gather(*(self._probe(b, probe_timeout) for b in backends))
        changed = False
        for backend, state in zip(backends, states):
            backend.probe_timeouts = backend.probe_timeouts + 1 if state == TIMEOUT else 0
            if 0 < backend.probe_timeouts < self.config.health_timeouts_to_down:
                continue
            times = f" x{backend.probe_timeouts}" if backend.probe_timeouts else ""
            if backend.set_up(state == SERVING, f"{backend.health_check} health {state}{times} at {backend.health_addr}"):
                self.scheduler.wake_all(self.scheduler.role_of(backend))
                changed = True
        if changed and not self._model_learned:
            await self._learn_model()  # the engines were down at start-up

    async def _probe(self, backend: Backend, timeout_s: float) -> str:
        """SERVING, NOT_SERVING, UNREACHABLE or TIMEOUT, over gRPC health or (vLLM engines) GET /health."""
        if backend.health_check == "grpc":
            return await probe_async(backend.health_addr, timeout_s)
        try:
            async with self.session.get(backend.health_addr, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                return SERVING if response.status == 200 else NOT_SERVING
        except asyncio.TimeoutError:
            return TIMEOUT
        except aiohttp.ClientError:
            return UNREACHABLE

    async def _learn_model(self) -> None:
        """The engines' model id from a decode's /v1/models (the config's model_id until one answers)."""
        for backend in self.scheduler.pools["decode"]:
            try:
                async with self.session.get(backend.url + "/v1/models", timeout=timeout(self.config.connect_timeout_ms, 5000)) as response:
                    data = await response.json(content_type=None)
                self.backend_model = data["data"][0]["id"]
                self._model_learned = True
                return
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
                continue

    async def count_tokens(self, request_id: str, prompt: dict[str, Any]) -> int | None:
        """The engines' token count for `prompt` ({"messages": …} or {"prompt": …}) from vLLM's POST /tokenize on a
        usable decode, or None if none answers (then the caller estimates). Takes no slot: it is cheap."""
        for backend in self.scheduler.pools["decode"]:
            if not backend.usable:
                continue
            try:
                async with self.session.post(backend.url + "/tokenize", json={"model": self.backend_model, **prompt},
                                             headers={REQUEST_ID_HEADER: request_id}, timeout=self._timeouts["tokenize"]) as response:
                    count = (await response.json(content_type=None)).get("count") if response.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
                continue
            if isinstance(count, int) and not isinstance(count, bool):
                return count
        return None

    def health_snapshot(self) -> dict[str, Any]:
        return {"mode": self.mode, "policy": self.config.policy, "queue_depth": self.scheduler.queue_depth,
                "backends": [b.snapshot() for b in self.backends]}

    def _gauges(self) -> Iterable[GaugeSample]:
        for b in self.backends:
            labels = {"backend": b.url, "role": b.role}
            yield "pd_router_backend_up", labels, float(b.up)
            yield "pd_router_backend_in_flight", labels, float(b.in_flight)
            yield "pd_router_backend_outstanding_tokens", labels, float(b.outstanding_tokens)
            yield "pd_router_backend_circuit", labels, float(_BREAKER_STATE[b.breaker.state])
        yield "pd_router_queue_depth", {}, float(self.scheduler.queue_depth)

    # -- outcomes ----------------------------------------------------------------------------------
    def _failed(self, backend: Backend, failure: LegFailed) -> None:
        self.metrics.backend_requests.inc(backend=backend.url, role=backend.role, outcome="error" if failure.retryable else "rejected")
        if not failure.retryable:
            backend.breaker.on_success()  # the engine answered properly; the request itself was bad
            return
        backend.breaker.on_failure()
        if failure.unreachable and self.config.health_interval_ms:
            backend.set_up(False, "connect failed")  # the health monitor brings it back when SERVING

    def _succeeded(self, backend: Backend) -> None:
        self.metrics.backend_requests.inc(backend=backend.url, role=backend.role, outcome="ok")
        backend.breaker.on_success()

    # -- the flow ------------------------------------------------------------------------------------
    async def complete(self, request_id: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Run a non-streamed request; the decode engine's JSON answer (with usage)."""
        job = _Job.make(request_id, path, body, False, self.config.default_max_tokens)
        leg = await self._run(job)
        self.scheduler.release(leg.decode, job.decode_tokens)
        answer = leg.answer or {}
        answer.pop("kv_transfer_params", None)  # clients never learn PD exists
        return answer

    async def stream(self, request_id: str, path: str, body: dict[str, Any]) -> AsyncIterator[list[dict[str, Any]]]:
        """Yield the decode engine's chunks as dicts, in batches: the chunks of one network read, so the
        relay forwards them in one write (a burst, or a router running behind, costs one send, not one
        per token). Always ends with a usage chunk (see module doc)."""
        job = _Job.make(request_id, path, body, True, self.config.default_max_tokens)
        leg = await self._run(job)
        decode, response, batches = leg.decode, leg.response, leg.batches
        assert response is not None and batches is not None and leg.first is not None, "stream leg opened without a first chunk"
        tally = _Tally(self.metrics, job.started)
        done = False
        try:
            chunks, frames = [leg.first], leg.rest
            while True:
                bad: Exception | None = None  # a bad frame fails the stream after the good ones before it
                for data in frames:
                    if data == DONE:
                        done = True
                        break
                    try:
                        chunks.append(self._parse_chunk(decode, data))
                    except (LegFailed, ValueError) as exc:
                        bad = exc
                        break
                if chunks:
                    tally.count(chunks)
                    yield chunks
                if bad is not None:
                    raise bad
                if done:
                    break
                batch = await anext(batches, None)
                if batch is None:
                    break
                chunks, frames = [], [data for _event, data in batch]
            if not (done and tally.finished):
                raise LegFailed(UpstreamError("the decode engine's stream ended early (no finish_reason or [DONE]); the answer is incomplete"),
                                retryable=True)
            if tally.usage is None:
                # Engines that ignore include_usage: count relayed chunks (prompt from the router's estimate).
                usage = {"prompt_tokens": job.prompt_tokens, "completion_tokens": tally.tokens, "total_tokens": job.prompt_tokens + tally.tokens}
                yield [{"id": leg.first.get("id", ""), "object": leg.first.get("object", "chat.completion.chunk"),
                        "created": leg.first.get("created", 0), "model": leg.first.get("model", ""), "choices": [], "usage": usage}]
            self._succeeded(decode)
        except (GeneratorExit, asyncio.CancelledError):
            log_event(events.ROUTER_CLIENT_DISCONNECTED, "client went away; upstream decode cancelled", "WARNING",
                      request_id=job.request_id, decode=decode.url, chunks_relayed=tally.tokens)
            raise
        except LegFailed as failure:
            self._decode_failed(job, decode, failure, mid_stream=True)
            raise failure.error from None
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError) as exc:
            failure = exception_failure(decode, exc, "mid-stream")
            self._decode_failed(job, decode, failure, mid_stream=True)
            raise failure.error from None
        finally:
            response.close()  # unless finished, this drops the connection: the engine cancels and frees the KV
            self.scheduler.release(decode, job.decode_tokens)

    def _parse_chunk(self, decode: Backend, data: str) -> dict[str, Any]:
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ValueError("chunk is not a JSON object")
        if "error" in chunk:  # vLLM-style in-band error
            error = chunk["error"]
            message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            code = error.get("code") if isinstance(error, dict) else None
            log_event(events.ROUTER_UPSTREAM_ERROR, f"decode {decode.url} sent an in-band error", "WARNING",
                      backend=decode.url, role=decode.role, status=code, body=data[:2000])
            raise status_failure(decode, code if isinstance(code, int) and code >= 400 else 502, message)
        return chunk

    async def _run(self, job: _Job) -> _Leg:
        """Attempts with new pairs until the decode leg answers (JSON) or yields its first chunk."""
        tried: set[Backend] = set()
        last_failure: LegFailed | None = None
        for attempt in range(1, self.config.max_retries + 2):
            try:
                decode = await self.scheduler.acquire("decode", job.decode_tokens, tried)
            except NoBackendAvailable:
                if last_failure is not None:
                    raise last_failure.error from None
                raise
            try:
                kv_params, leg_id = (None, job.request_id) if self.colocated else await self._prefill(job, decode, attempt)
                if self.colocated:
                    log_event(events.ROUTER_SCHEDULED, f"colocated on {decode.url}", request_id=job.request_id, prefill=decode.url,
                              decode=decode.url, policy=self.config.policy, mode=self.mode, attempt=attempt)
                return await self._decode(job, decode, kv_params, leg_id)
            except LegFailed as failure:
                self.scheduler.release(decode, job.decode_tokens)
                self._decode_failed(job, decode, failure, mid_stream=False, retried=failure.retryable and attempt <= self.config.max_retries)
                if not failure.retryable:
                    raise failure.error from None
                tried.add(decode)
                last_failure = failure
                self.metrics.retries.inc(role="decode")
            except BaseException:
                self.scheduler.release(decode, job.decode_tokens)
                raise
        assert last_failure is not None, "retry loop ended without a failure"
        raise last_failure.error

    async def _prefill(self, job: _Job, decode: Backend, attempt: int) -> tuple[dict[str, Any] | None, str]:
        """Prefill leg with retries on other prefills; returns the kv_transfer_params for decode (None for P2pNccl)
        and the request id both legs carry."""
        tried: set[Backend] = set()
        last_failure: LegFailed | None = None
        for tries in range(1, self.config.max_retries + 2):
            try:
                prefill = await self.scheduler.acquire("prefill", job.prompt_tokens, tried)
            except NoBackendAvailable:
                if last_failure is None:
                    raise
                break
            if self.p2pnccl:  # the KV route is in the request id (both registered zmq addresses)
                transfer_id = leg_id = leg_request_id(prefill.kv_addr, decode.kv_addr)
                body = job.prefill_body(None)
            else:
                transfer_id, leg_id = uuid.uuid4().hex, job.request_id
                body = job.prefill_body(_push_params(transfer_id, decode.kv_addr))
            log_event(events.ROUTER_SCHEDULED, f"prefill {prefill.url} → decode {decode.url}", request_id=job.request_id,
                      prefill=prefill.url, decode=decode.url, policy=self.config.policy, mode=self.mode, attempt=attempt, prefill_attempt=tries)
            started = time.perf_counter()
            try:
                answer = await post_json(self.session, prefill, job.path, body, leg_id, self._timeouts["prefill"])
            except LegFailed as failure:
                self._failed(prefill, failure)
                retried = failure.retryable and tries <= self.config.max_retries
                log_event(events.ROUTER_PREFILL_FAILED, f"prefill {prefill.url} failed: {failure.error.message}", "WARNING",
                          request_id=job.request_id, prefill=prefill.url, status=failure.status, error=failure.error.message,
                          attempt=tries, retried=retried)
                if not failure.retryable:
                    raise failure.error from None
                tried.add(prefill)
                last_failure = failure
                if retried:
                    self.metrics.retries.inc(role="prefill")
                continue
            finally:
                self.scheduler.release(prefill, job.prompt_tokens)
            self._succeeded(prefill)
            elapsed = time.perf_counter() - started
            self.metrics.prefill.observe(elapsed)
            kv_params = None if self.p2pnccl else answer.get("kv_transfer_params")  # P2pNccl: P pushed to D's zmq address
            if not self.p2pnccl and not isinstance(kv_params, dict):
                log_event(events.ROUTER_PREFILL_FAILED, f"prefill {prefill.url} answered without kv_transfer_params", "ERROR",
                          request_id=job.request_id, prefill=prefill.url, status=200, error="no kv_transfer_params", attempt=tries, retried=False)
                raise UpstreamError("the prefill engine returned no kv_transfer_params (is it running as a KV producer?)")
            transfer_id = (kv_params or {}).get("transfer_id", transfer_id)
            log_event(events.ROUTER_PREFILL_DONE, f"prefill done in {elapsed * 1000:.1f} ms", request_id=job.request_id,
                      prefill=prefill.url, prefill_ms=round(elapsed * 1000, 2), transfer_id=transfer_id)
            log_event(events.ROUTER_KV_HANDOFF, f"handing KV to decode {decode.url}", request_id=job.request_id, decode=decode.url,
                      transfer_id=transfer_id, kv_transfer_params=sorted(kv_params or ()))
            return kv_params, leg_id
        assert last_failure is not None, "prefill loop ended without a failure"
        raise last_failure.error

    async def _decode(self, job: _Job, decode: Backend, kv_params: dict[str, Any] | None, leg_id: str) -> _Leg:
        """Send the decode leg (X-Request-ID `leg_id`); return once it answered (JSON) or produced its first chunk (stream)."""
        body = job.decode_body(kv_params)
        sent = time.perf_counter()
        if not job.stream:
            try:
                answer = await post_json(self.session, decode, job.path, body, leg_id, self._timeouts["decode_json"])
            except LegFailed as failure:
                self._failed(decode, failure)
                raise
            self._succeeded(decode)
            return _Leg(decode, answer=answer)
        response: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(self._first_chunk_s):
                response = await open_stream(self.session, decode, job.path, body, leg_id, self._timeouts["decode_stream"])
                batches = aiter(read_event_batches(response.content))
                frames = [data for _event, data in await anext(batches, [(None, DONE)])]
                if frames[0] == DONE:
                    raise LegFailed(UpstreamError("the decode engine closed the stream before its first chunk"), retryable=True)
                first = self._parse_chunk(decode, frames[0])
        except LegFailed as failure:
            if response is not None:
                response.close()
            self._failed(decode, failure)
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError) as exc:
            if response is not None:
                response.close()
            failure = exception_failure(decode, exc, "before the first chunk")
            self._failed(decode, failure)
            raise failure from exc
        except BaseException:
            if response is not None:
                response.close()
            raise
        self._first_token(job, decode, sent)
        return _Leg(decode, response=response, batches=batches, first=first, rest=frames[1:])

    def _first_token(self, job: _Job, decode: Backend, sent: float) -> None:
        """Streams only: a non-streamed answer has no first-token moment the router can see."""
        now = time.perf_counter()
        ttft = now - job.started
        self.metrics.ttft.observe(ttft, mode=self.mode)
        if not self.colocated:
            self.metrics.kv_handoff.observe(now - sent)
        log_event(events.ROUTER_DECODE_FIRST_TOKEN, f"first token after {ttft * 1000:.1f} ms", request_id=job.request_id,
                  decode=decode.url, ttft_ms=round(ttft * 1000, 2))

    def _decode_failed(self, job: _Job, decode: Backend, failure: LegFailed, *, mid_stream: bool, retried: bool = False) -> None:
        if mid_stream:
            self._failed(decode, failure)
        log_event(events.ROUTER_DECODE_FAILED, f"decode {decode.url} failed{' mid-stream' if mid_stream else ''}: {failure.error.message}",
                  "ERROR" if mid_stream else "WARNING", request_id=job.request_id, decode=decode.url, status=failure.status,
                  error=failure.error.message, mid_stream=mid_stream, retried=retried)

