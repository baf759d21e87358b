"""The PD flow, top to bottom as vLLM's toy proxy reads: pick, prefill leg, decode leg, relay.

    complete(): decode answers one JSON body          stream(): decode's SSE chunks, yielded as lists of dicts
    _run, attempt n:   1. pick D = acquire(decode)
    _prefill:          2. pick P = acquire(prefill); POST P {max_tokens: 1, stream: false, the hand-off's kv_transfer_params}
                          (prefill failure: another P, same D)
    _decode:           3. POST D {the client's request, what P's answer hands on}; wait for its first chunk
                          (decode failure before its first chunk: a new pair, attempt n+1)
    stream:            4. relay D's chunks; a failure after the first chunk is raised to the caller, who ends the
                          client's stream in-band. A stream that ends without a finish_reason and `[DONE]` is an
                          error, never a silent truncation.

What the legs carry, and which request id, is the hand-off's business (handoff.py: our KV push,
vLLM NIXL, vLLM P2pNccl, or colocated, which has no prefill leg). Which backends are up and where
decode takes KV is the health monitor's (monitor.py); slots and the wait queue the scheduler's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from stack.common import events
from stack.common.errors import REQUEST_ID_HEADER, UpstreamError, UpstreamTimeout
from stack.common.logging import log_event
from stack.common.sse import DONE, read_event_batches
from stack.router.backends import Backend, build_pool, is_colocated
from stack.router.config import RouterConfig
from stack.router.discovery import KVDiscovery, kv_hints
from stack.router.handoff import Route, handoff_for
from stack.router.metrics import Metrics
from stack.router.monitor import HealthMonitor
from stack.router.upstream import EngineError, LegFailed, exception_failure, open_stream, post_json, status_failure, timeout
from stack.router.scheduler import NoBackendAvailable, Scheduler, worst_case_s


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
        """One token, not streamed, no stream_options (vLLM's toy proxy). `min_tokens` becomes 1 when the client set
        it: our decode continues from prefill's token, which must not be EOS then (vLLM needs min ≤ max = 1)."""
        body = {k: v for k, v in self.body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
        body.update(stream=False, max_tokens=1)
        if self.body.get("min_tokens"):
            body["min_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return body

    def decode_body(self, kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
        """The client's request; streams always ask for usage (the router counts tokens from it)."""
        body = dict(self.body)
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        else:
            body["stream"] = False
            body.pop("stream_options", None)
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return body


@dataclass
class _Leg:
    """An answered decode leg: the backend (slot held), and the JSON body or the open stream."""

    decode: Backend
    answer: dict[str, Any] | None = None
    response: aiohttp.ClientResponse | None = None
    batches: AsyncIterator[list[tuple[str | None, str]]] | None = None  # the rest of the stream, per network read
    first: dict[str, Any] | None = None  # the first chunk, checked before anything reached the client
    rest: list[str] = field(default_factory=list)  # the other frames that arrived with the first
    prefill_cached: int | None = None  # prompt tokens the prefill found in its prefix cache (what usage reports)


@dataclass(frozen=True)
class _Handed:
    """What a prefill leg hands on: the route, decode's kv_transfer_params, and when its KV lease started; or, when
    its one token ended the answer, that answer (`finished`)."""

    route: Route
    kv_params: dict[str, Any] | None
    prefill_url: str
    answered_at: float  # PDClient's clock when the prefill answered: its blocks' lease runs from here
    finished: dict[str, Any] | None = None
    cached_tokens: int | None = None


def _finish_reason(answer: dict[str, Any]) -> str | None:
    choices = answer.get("choices") or [{}]
    return choices[0].get("finish_reason") if isinstance(choices[0], dict) else None


def _prefill_cached_tokens(answer: dict[str, Any], kv_params: dict[str, Any] | None) -> int | None:
    """The prompt tokens the prefill found cached: what the client's usage reports (decode loaded them all from the
    prefill, so its own count says ~100 %). vLLM names it in kv_transfer_params (`remote_prefill_cached_tokens`, 0.32+)
    and in the prefill answer's usage (with --enable-prompt-tokens-details)."""
    cached = (kv_params or {}).get("remote_prefill_cached_tokens")
    if not isinstance(cached, int) or isinstance(cached, bool):
        cached = ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def _report_cached(usage: Any, cached: int | None) -> None:
    """Usage as the client sees it: cached_tokens from the prefill's view (decode's own count, where it keeps one, is
    every token it loaded from the prefill)."""
    if cached is not None and isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}), "cached_tokens": cached}


def answer_chunks(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """A non-streamed chat or text completion as the stream chunks an engine would have sent for it: one chunk per
    choice with the whole delta and its finish_reason, then the usage chunk (choices [])."""
    chat = answer.get("object") == "chat.completion"
    head = {"id": answer.get("id", ""), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer.get("created", 0), "model": answer.get("model", "")}
    chunks = []
    for choice in answer.get("choices") or []:
        out = {"index": choice.get("index", 0), "logprobs": choice.get("logprobs"), "finish_reason": choice.get("finish_reason")}
        if chat:
            message = choice.get("message") or {}
            delta = {"role": "assistant", "content": message.get("content") or ""}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            out["delta"] = delta
        else:
            out["text"] = choice.get("text") or ""
        chunks.append({**head, "choices": [out]})
    if answer.get("usage"):
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return chunks


class _Tally:
    """What a relayed stream has shown so far: token chunks (ITL observed between them), finish, usage."""

    def __init__(self, metrics: Metrics, started: float) -> None:
        self.metrics = metrics
        self.last = started
        self.first = started  # when the first token chunk arrived
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
                else:
                    self.first = now
                self.tokens += 1
                self.last = now
                self.finished = self.finished or bool(choices[0].get("finish_reason"))
            if chunk.get("usage"):
                self.usage = chunk["usage"]


class PDClient:
    """Runs client requests over the prefill and decode pools (see the module docstring)."""

    def __init__(self, config: RouterConfig, session: aiohttp.ClientSession, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock` times the backends' circuit breakers and the prefill's KV lease (tests pass a fake one)."""
        self.settings = s = config.scheduler
        registry = s.kv_connector == "p2pnccl"  # the pools start empty and fill as vLLM P2pNccl instances register
        self.handoff = handoff_for(s.kv_connector, colocated=not registry and is_colocated(config.prefill, config.decode))
        self.mode = "disaggregated" if self.handoff.prefill_leg else "colocated"
        self._clock = clock
        threshold, cooldown = s.breaker_failures, s.breaker_cooldown_ms / 1000
        pools = {"decode": [] if registry else build_pool(config.decode, "decode" if self.handoff.prefill_leg else "both",
                                                           threshold, cooldown, clock)}
        if self.handoff.prefill_leg:
            pools["prefill"] = [] if registry else build_pool(config.prefill, "prefill", threshold, cooldown, clock)
        self.scheduler = Scheduler(s, pools)
        self.session = session
        self.metrics = metrics
        kv = (KVDiscovery(session, kv_hints(config.decode, config.kv_transfer_port, config.source), timeout(s.connect_timeout_ms, 5000))
              if self.handoff.discovers_kv_addr else None)
        self.monitor = HealthMonitor(config, self.scheduler, session, metrics, kv, clock)
        self._timeouts = {
            "prefill": timeout(s.connect_timeout_ms, s.prefill_timeout_ms),
            "decode_json": timeout(s.connect_timeout_ms, s.decode_timeout_ms),
            "decode_stream": timeout(s.connect_timeout_ms, s.request_timeout_ms, s.idle_timeout_ms),
            "tokenize": timeout(s.connect_timeout_ms, s.first_token_timeout_ms),
        }
        self._first_chunk_s = (s.kv_transfer_timeout_ms + s.first_token_timeout_ms) / 1000

    async def start(self) -> None:
        await self.monitor.start()

    async def close(self) -> None:
        await self.monitor.close()

    @property
    def backend_model(self) -> str:
        """The engines' model id (what the API handlers name upstream and in /v1/models)."""
        return self.monitor.model

    def health_snapshot(self) -> dict[str, Any]:
        return {"mode": self.mode, "kv_connector": self.handoff.kind, "policy": self.settings.policy,
                "queue_depth": self.scheduler.queue_depth, "worst_case_s": worst_case_s(self.settings), "backends": [b.snapshot() for b in self.scheduler.backends]}

    async def count_tokens(self, request_id: str, prompt: dict[str, Any]) -> int | None:
        """The engines' token count for `prompt` ({"messages": …} or {"prompt": …}) from vLLM's POST /tokenize on a
        usable decode, or None if none answers (then the caller estimates). Takes no slot: it is cheap."""
        for backend in self.scheduler.pool("decode"):
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

    async def tokenizer_call(self, request_id: str, path: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        """POST `body` to vLLM's `path` (/tokenize, /detokenize) on a usable decode: (status, JSON answer), or None
        when no decode answers. Takes no slot (issue 10: the router's /tokenize, exact prompt counts)."""
        for backend in self.scheduler.pool("decode"):
            if not backend.usable:
                continue
            try:
                async with self.session.post(backend.url + path, json=body, headers={REQUEST_ID_HEADER: request_id},
                                             timeout=self._timeouts["tokenize"]) as response:
                    return response.status, await response.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
        return None

    # -- the flow: pick, prefill leg, decode leg, relay -------------------------------------------------
    async def complete(self, request_id: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Run a non-streamed request; the decode engine's JSON answer (with usage)."""
        job = _Job.make(request_id, path, body, False, self.settings.default_max_tokens)
        leg = await self._run_within_deadline(job)
        self.scheduler.release(leg.decode, job.decode_tokens)
        answer = leg.answer or {}
        answer.pop("kv_transfer_params", None)  # clients never learn PD exists
        _report_cached(answer.get("usage"), leg.prefill_cached)
        return answer

    async def _run_within_deadline(self, job: _Job) -> _Leg:
        """_run under [scheduler] deadline_ms: queue waits, legs and retries together never take longer."""
        deadline_s = self.settings.deadline_ms / 1000
        try:
            async with asyncio.timeout(deadline_s):
                return await self._run(job)
        except TimeoutError:
            log_event(events.ROUTER_DEADLINE_EXCEEDED, f"no answer within the request deadline ({deadline_s:g}s)", "WARNING",
                      request_id=job.request_id, deadline_ms=self.settings.deadline_ms, stream=job.stream)
            raise UpstreamTimeout(f"no answer within the router's request deadline ({deadline_s:g}s); retry shortly",
                                  code="deadline_exceeded", headers={"Retry-After": "1"}) from None

    async def _run(self, job: _Job) -> _Leg:
        """1. Pick a decode, then its prefill leg and its decode leg; a new pair until decode answered (JSON) or
        yielded its first chunk."""
        tried: set[Backend] = set()
        last_failure: LegFailed | None = None
        for attempt in range(1, self.settings.max_retries + 2):
            try:
                decode = await self.scheduler.acquire("decode", job.decode_tokens, tried)
            except NoBackendAvailable:
                if last_failure is not None:
                    raise last_failure.error from None
                raise
            try:
                if self.handoff.prefill_leg:
                    handed = await self._prefill(job, decode, attempt)
                    if handed.finished is not None:
                        return _Leg(decode, answer=handed.finished)
                    self._check_lease(job, handed, decode)
                    route, kv_params, prefill_cached = handed.route, handed.kv_params, handed.cached_tokens
                else:
                    route, kv_params, prefill_cached = self.handoff.route(job.request_id, decode, decode), None, None
                    log_event(events.ROUTER_SCHEDULED, f"colocated on {decode.url}", request_id=job.request_id, prefill=decode.url,
                              decode=decode.url, policy=self.settings.policy, mode=self.mode, attempt=attempt)
                leg = await self._decode(job, decode, kv_params, route.request_id)
                leg.prefill_cached = prefill_cached
                return leg
            except LegFailed as failure:
                self.scheduler.release(decode, job.decode_tokens)
                self._decode_failed(job, decode, failure, mid_stream=False, retried=failure.retryable and attempt <= self.settings.max_retries)
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

    async def _prefill(self, job: _Job, decode: Backend, attempt: int) -> _Handed:
        """2. The prefill leg, retried on other prefills; the route both legs follow and what decode gets, or the
        finished answer when the prefill's one token ended it."""
        tried: set[Backend] = set()
        last_failure: LegFailed | None = None
        for tries in range(1, self.settings.max_retries + 2):
            try:
                prefill = await self.scheduler.acquire("prefill", job.prompt_tokens, tried)
            except NoBackendAvailable:
                if last_failure is None:
                    raise
                break
            route = self.handoff.route(job.request_id, prefill, decode)
            log_event(events.ROUTER_SCHEDULED, f"prefill {prefill.url} → decode {decode.url}", request_id=job.request_id,
                      prefill=prefill.url, decode=decode.url, policy=self.settings.policy, mode=self.mode, attempt=attempt, prefill_attempt=tries)
            started = time.perf_counter()
            try:
                answer = await post_json(self.session, prefill, job.path, job.prefill_body(route.prefill_params), route.request_id,
                                         self._timeouts["prefill"])
            except LegFailed as failure:
                if failure.blames_decode:
                    # The prefill could not push its KV to this decode: the decode (or the KV path to it) is at fault,
                    # not the prefill. Never retry the prefill leg against it: _run re-picks the pair without it, and its
                    # breaker counts the failure. It is not marked down: the router's own path to it may be fine (a cut
                    # KV network); a dead decode is found by the router's legs and probes (refused: down at once).
                    self._succeeded(prefill)
                    log_event(events.ROUTER_PREFILL_FAILED, f"prefill {prefill.url} could not hand KV to decode {decode.url}: "
                              f"{failure.error.message}", "WARNING", request_id=job.request_id, prefill=prefill.url,
                              status=failure.status, error=failure.error.message, attempt=tries, retried=False)
                    self._failed(decode, LegFailed(failure.error, retryable=True, status=failure.status, code=failure.code))
                    raise
                self._failed(prefill, failure)
                retried = failure.retryable and tries <= self.settings.max_retries
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
            answered_at = self._clock()
            elapsed = time.perf_counter() - started
            self.metrics.prefill.observe(elapsed)
            finish = _finish_reason(answer)
            if finish not in (None, "length"):
                # The one token ended the answer (EOS, a stop string): vLLM then hands on no kv_transfer_params (or
                # params a decode would continue past the end from). The answer is complete; no decode leg.
                log_event(events.ROUTER_PREFILL_FINISHED, f"prefill {prefill.url} finished the answer ({finish})",
                          request_id=job.request_id, prefill=prefill.url, decode=decode.url, finish_reason=finish)
                return _Handed(route, None, prefill.url, answered_at, finished=answer)
            try:
                kv_params = self.handoff.decode_params(route, answer)
            except UpstreamError as err:
                log_event(events.ROUTER_PREFILL_FAILED, f"prefill {prefill.url} answered without kv_transfer_params", "ERROR",
                          request_id=job.request_id, prefill=prefill.url, status=200, error=err.message, attempt=tries, retried=False)
                raise
            log_event(events.ROUTER_PREFILL_DONE, f"prefill done in {elapsed * 1000:.1f} ms", request_id=job.request_id,
                      prefill=prefill.url, prefill_ms=round(elapsed * 1000, 2), transfer_id=route.transfer_id)
            log_event(events.ROUTER_KV_HANDOFF, f"handing KV to decode {decode.url}", request_id=job.request_id, decode=decode.url,
                      transfer_id=route.transfer_id, kv_transfer_params=sorted(kv_params or ()))
            return _Handed(route, kv_params, prefill.url, answered_at, cached_tokens=_prefill_cached_tokens(answer, kv_params))
        assert last_failure is not None, "prefill loop ended without a failure"
        raise last_failure.error

    async def _decode(self, job: _Job, decode: Backend, kv_params: dict[str, Any] | None, leg_id: str) -> _Leg:
        """3. The decode leg (X-Request-ID `leg_id`); returns once it answered (JSON) or produced its first chunk (stream)."""
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

    async def stream(self, request_id: str, path: str, body: dict[str, Any]) -> AsyncIterator[list[dict[str, Any]]]:
        """4. Relay: yield the decode engine's chunks as dicts, in batches: the chunks of one network read, so the
        API writes them in one send (a burst, or a router running behind, costs one send, not one per token).
        Always ends with a usage chunk (see module doc)."""
        job = _Job.make(request_id, path, body, True, self.settings.default_max_tokens)
        leg = await self._run_within_deadline(job)
        if leg.answer is not None:  # the prefill finished the answer: its JSON, as the chunks decode would have sent
            try:
                yield answer_chunks(leg.answer)
            finally:
                self.scheduler.release(leg.decode, job.decode_tokens)
            return
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
                    for chunk in chunks:
                        _report_cached(chunk.get("usage"), leg.prefill_cached)
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
            self.metrics.observe_stream(tally.first - job.started, tally.last - tally.first, tally.tokens)  # TPOT, goodput
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

    def _check_lease(self, job: _Job, handed: _Handed, decode: Backend) -> None:
        """Never send a decode leg after the prefill's KV lease ([scheduler] kv_lease_ms) ran out: vLLM would read
        freed blocks ("Potentially invalid KV blocks …") and still answer 200. Retryable: a new pair, a new prefill."""
        waited_s = self._clock() - handed.answered_at
        if waited_s * 1000 < self.settings.kv_lease_ms:
            return
        log_event(events.ROUTER_KV_EXPIRED, f"prefill {handed.prefill_url}'s KV lease ran out before the decode leg was sent",
                  "WARNING", request_id=job.request_id, prefill=handed.prefill_url, decode=decode.url,
                  lease_ms=self.settings.kv_lease_ms, waited_ms=round(waited_s * 1000, 1))
        raise LegFailed(UpstreamError(f"the prefill's KV blocks expired (kv_lease_ms {self.settings.kv_lease_ms}) before "
                                      "the decode leg could be sent", code="kv_expired"), retryable=True, code="kv_expired")

    # -- outcomes ----------------------------------------------------------------------------------
    def _parse_chunk(self, decode: Backend, data: str) -> dict[str, Any]:
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ValueError("chunk is not a JSON object")
        if "error" in chunk:  # vLLM-style in-band error
            error = chunk["error"]
            code = error.get("code") if isinstance(error, dict) else None  # vLLM: the HTTP status, an int
            status = code if isinstance(code, int) and not isinstance(code, bool) and code >= 400 else 502
            log_event(events.ROUTER_UPSTREAM_ERROR, f"decode {decode.url} sent an in-band error", "WARNING",
                      backend=decode.url, role=decode.role, status=status, body=data[:2000])
            raise status_failure(decode, status, EngineError.parse(data))
        return chunk

    def _first_token(self, job: _Job, decode: Backend, sent: float) -> None:
        """Streams only: a non-streamed answer has no first-token moment the router can see."""
        now = time.perf_counter()
        ttft = now - job.started
        self.metrics.ttft.observe(ttft, mode=self.mode)
        if self.handoff.prefill_leg:
            self.metrics.kv_handoff.observe(now - sent)
        log_event(events.ROUTER_DECODE_FIRST_TOKEN, f"first token after {ttft * 1000:.1f} ms", request_id=job.request_id,
                  decode=decode.url, ttft_ms=round(ttft * 1000, 2))

    def _failed(self, backend: Backend, failure: LegFailed) -> None:
        self.metrics.backend_requests.inc(backend=backend.url, role=backend.role, outcome="error" if failure.retryable else "rejected")
        if not failure.retryable:
            backend.breaker.on_success()  # the engine answered properly; the request itself was bad
            return
        backend.breaker.on_failure()
        if failure.unreachable and self.settings.health_interval_ms:
            self.scheduler.mark(backend, False, "connect failed")  # the health monitor brings it back when SERVING

    def _succeeded(self, backend: Backend) -> None:
        self.metrics.backend_requests.inc(backend=backend.url, role=backend.role, outcome="ok")
        backend.breaker.on_success()

    def _decode_failed(self, job: _Job, decode: Backend, failure: LegFailed, *, mid_stream: bool, retried: bool = False) -> None:
        if mid_stream:
            self._failed(decode, failure)
        log_event(events.ROUTER_DECODE_FAILED, f"decode {decode.url} failed{' mid-stream' if mid_stream else ''}: {failure.error.message}",
                  "ERROR" if mid_stream else "WARNING", request_id=job.request_id, decode=decode.url, status=failure.status,
                  error=failure.error.message, mid_stream=mid_stream, retried=retried)
