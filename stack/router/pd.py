"""The PD flow: pair, prefill leg, decode leg, relay.

    complete(): decode answers one JSON body          open(): a DecodeStream of decode's SSE chunks, read as lists of
                                                      dicts (raw_model, text_frame: ordinary token chunks as the client's
                                                      frames, undecoded, relay.Passthrough)
    _run, attempt n:   1. pairing.acquire_pair: a decode first, then a prefill running its model (pairing.py)
    _prefill:          2. POST P {max_tokens: 1, stream: false, the hand-off's kv_transfer_params}
                          (P failed: another P, same D; P could not hand its KV to D, or D has no room for it: a new pair)
    _decode:           3. POST D {the client's request, what P's answer hands on}; wait for its first chunk
                          (D failed before its first chunk: a new pair, attempt n+1)
    DecodeStream.next: 4. relay D's chunks; a failure after the first chunk is raised to the caller, who ends the
                          client's stream in-band. A stream that ends without a finish_reason and `[DONE]` is an
                          error, never a silent truncation.

Every leg the router gives up on (its deadline, the client gone, retried elsewhere) has its HTTP connection closed:
the engine sees the disconnect, cancels the work and frees its KV. Each leg's timeout and the request's deadline are
sized by the prompt (deadlines.py). What the legs carry is the hand-off's business (handoff.py); which backends exist
the fleet's (fleet.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from functools import partial
from typing import Any


from stack.common import events
from stack.common.errors import UpstreamError, UpstreamTimeout
from stack.common.logging import log_event, ms
from stack.common.sse import DONE_DATA, FrameReader, WriteNow
from stack.protocol.types import Request
from stack.router.deadlines import budgets, within
from stack.router.fleet import Fleet
from stack.router.handoff import Handed, handed
from stack.router.job import NO_HEADERS, Job
from stack.router.metrics import Metrics
from stack.router.pairing import Pair, Pairing, Tried
from stack.router.relay import Leg, Passthrough, Tally, TextFrame, answer_chunks, parse_chunk, report_cached
from stack.router.engine_http import Response
from stack.router.upstream import LegFailed, exception_failure, leg_timeout, open_stream, post_json


class PDClient:
    """Runs client requests over the fleet's prefill and decode pools (see the module doc)."""

    def __init__(self, fleet: Fleet, metrics: Metrics) -> None:
        self.fleet = fleet
        self.settings = s = fleet.settings
        self.metrics = metrics
        self.pairing = Pairing(s, fleet.scheduler, fleet.monitor, fleet.handoff, metrics)
        # What the API handlers ask of the engines, answered by the fleet.
        self.monitor, self.tokenizer_call, self.health_snapshot = fleet.monitor, fleet.tokenizer_call, fleet.health_snapshot

    @property
    def backend_model(self) -> str:
        """The engines' model id (what the API handlers name upstream and in /v1/models)."""
        return self.monitor.model

    def _job(self, request_id: str, api: str, path: str, req: Request, body: dict[str, Any], headers: Mapping[str, str],
             stream: bool) -> tuple[Job, Tried]:
        job = Job.make(request_id, api, path, req, body, headers, stream, self.settings.default_max_tokens,
                       partial(budgets, self.settings, window=self.monitor.max_model_len))
        return job, self.pairing.tried(headers, job)

    async def complete(self, request_id: str, api: str, path: str, req: Request, body: dict[str, Any],
                       headers: Mapping[str, str] = NO_HEADERS) -> dict[str, Any]:
        """Run a non-streamed request of the client API `api` (`req` parsed, `body` its engine body); the decode
        engine's JSON answer (with usage). `headers`: the client's (session affinity)."""
        job, tried = self._job(request_id, api, path, req, body, headers, False)
        leg = await self._run_within_deadline(job, tried)
        self.pairing.release_decode(tried)
        answer = leg.answer or {}
        if not self.fleet.handoff.prefill_leg:
            self.metrics.observe_prompt_cache(leg.decode, answer.get("usage"))
        answer.pop("kv_transfer_params", None)  # clients never learn PD exists
        report_cached(answer.get("usage"), leg.prefill_cached)
        return answer

    async def open(self, request_id: str, api: str, path: str, req: Request, body: dict[str, Any],
                   headers: Mapping[str, str] = NO_HEADERS, raw_model: str | None = None,
                   text_frame: TextFrame | None = None) -> DecodeStream:
        """Run a streamed request until decode's first chunk (or the prefill's finished answer): the stream the API
        relays (`DecodeStream`). A failure before it raises the client's error, as `complete` does. `headers`: the
        client's (session affinity). `raw_model`: for an API that forwards the engine's chunks as they are, an
        ordinary token chunk comes as its SSE frame, undecoded, with this model id in. `text_frame`: for an API that
        translates, such a chunk comes as the frame this makes of its text, when it can (relay.Passthrough)."""
        job, tried = self._job(request_id, api, path, req, body, headers, True)
        return DecodeStream(self, job, tried, await self._run_within_deadline(job, tried), raw_model, text_frame)

    async def _run_within_deadline(self, job: Job, tried: Tried) -> Leg:
        """_run under the request's deadline (deadlines.py): queue waits, legs and retries together never take longer.
        Giving up cancels the leg in flight, which closes its connection."""
        deadline_s = job.budgets.deadline_s
        try:
            with within(deadline_s):
                return await self._run(job, tried)
        except BaseException as exc:
            decode = tried.held
            if decode is not None:
                self.pairing.release_decode(tried)
            if isinstance(exc, TimeoutError):
                log_event(events.ROUTER_DEADLINE_EXCEEDED, f"no answer within the request deadline ({deadline_s:g}s); legs closed",
                          "WARNING", request_id=job.request_id, deadline_ms=round(deadline_s * 1000), prompt_tokens=job.budgets.tokens,
                          stream=job.stream)
                raise UpstreamTimeout(f"no answer within the router's request deadline ({deadline_s:g}s); retry shortly",
                                      code="deadline_exceeded", headers={"Retry-After": "1"}) from None
            if isinstance(exc, asyncio.CancelledError):
                log_event(events.ROUTER_CLIENT_DISCONNECTED, "client went away before the first byte; upstream legs cancelled",
                          "WARNING", request_id=job.request_id, decode=decode.url if decode else None, chunks_relayed=0)
            raise

    async def _run(self, job: Job, tried: Tried) -> Leg:
        """1. A pair, its prefill leg, its decode leg; another pair (or prefill) after a retryable failure, until decode
        answered (JSON) or yielded its first chunk."""
        while True:
            pair = await self.pairing.acquire_pair(job, tried)
            leg_role = "prefill" if pair.prefill is not None else "decode"
            try:
                handed_on = await self._prefill(job, pair) if pair.prefill is not None else None
                leg_role = "decode"
                if handed_on is not None and handed_on.finished is not None:
                    return Leg(pair.decode, answer=handed_on.finished)
                if handed_on is not None:
                    handed_on.check_lease(self.fleet.clock(), self.settings.kv_lease_ms, job.request_id, pair.decode.url)
                leg = await self._decode(job, pair, handed_on)
                leg.prefill_cached = handed_on.cached_tokens if handed_on else None
                return leg
            except LegFailed as failure:
                retried = self.pairing.failed(pair, tried, failure, leg_role)
                if leg_role == "prefill" and pair.prefill is not None:
                    blame = f"could not hand KV to decode {pair.decode.url}" if failure.blames_decode else "failed"
                    log_event(events.ROUTER_PREFILL_FAILED, f"prefill {pair.prefill.url} {blame}: {failure.error.message}", "WARNING",
                              request_id=job.request_id, prefill=pair.prefill.url, decode=pair.decode.url, status=failure.status,
                              code=failure.code, error=failure.error.message, attempt=pair.prefill_try, retried=retried)
                else:
                    self._decode_failed(job, pair.decode, failure, mid_stream=False, retried=retried)
                if not retried:
                    raise failure.error from None

    async def _prefill(self, job: Job, pair: Pair) -> Handed:
        """2. The prefill leg: what decode gets, or the finished answer when the prefill's one token ended it."""
        prefill, route = pair.prefill, pair.route
        assert prefill is not None, "prefill leg for a pair without a prefill"
        started = time.perf_counter()
        try:
            answer = await post_json(self.fleet.engines, prefill, job.path, job.prefill_body(route.prefill_params), route.request_id,
                                     leg_timeout(self.settings.connect_timeout_ms, round(job.budgets.prefill_s * 1000)))
        finally:
            self.pairing.release_prefill(pair, job)
        self.pairing.outcome(prefill)
        elapsed = time.perf_counter() - started
        self.metrics.prefill.observe(elapsed)
        self.metrics.observe_prompt_cache(prefill, answer.get("usage"))
        try:
            result = handed(self.fleet.handoff, route, prefill.url, answer, self.fleet.clock())
        except UpstreamError as err:
            log_event(events.ROUTER_PREFILL_FAILED, f"prefill {prefill.url} answered without kv_transfer_params", "ERROR",
                      request_id=job.request_id, prefill=prefill.url, status=200, error=err.message, attempt=pair.prefill_try, retried=False)
            raise
        if result.finished is not None:
            log_event(events.ROUTER_PREFILL_FINISHED, f"prefill {prefill.url} finished the answer ({result.finish_reason})",
                      request_id=job.request_id, prefill=prefill.url, decode=pair.decode.url, finish_reason=result.finish_reason)
            return result
        # One line for the leg and the hand-off it starts (the line a request costs is CPU: docs/router-performance.md).
        log_event(events.ROUTER_PREFILL_DONE, f"prefill done in {elapsed * 1000:.1f} ms; handing KV to decode {pair.decode.url}",
                  request_id=job.request_id, prefill=prefill.url, prefill_ms=ms(elapsed), transfer_id=route.transfer_id,
                  decode=pair.decode.url, kv_transfer_params=sorted(result.kv_params or ()))
        return result

    async def _decode(self, job: Job, pair: Pair, handed_on: Handed | None) -> Leg:
        """3. The decode leg; returns once it answered (JSON) or produced its first chunk (stream). A decode that
        computes the prompt itself (no prefill leg) gets the prompt's prefill time too."""
        decode, leg_id = pair.decode, pair.route.request_id
        body = job.decode_body(handed_on.kv_params if handed_on else None)
        computes_prompt = handed_on is None
        sent = time.perf_counter()
        if not job.stream:
            try:
                answer = await post_json(self.fleet.engines, decode, job.path, body, leg_id,
                                         leg_timeout(self.settings.connect_timeout_ms, round(job.budgets.decode_json(computes_prompt) * 1000)))
            except LegFailed as failure:
                self.pairing.outcome(decode, failure)
                raise failure if computes_prompt else failure.after_prefill(decode, self._windows(pair)) from None
            self.pairing.outcome(decode)
            return Leg(decode, answer=answer)
        response: Response | None = None
        try:
            with within(first_chunk_s := job.budgets.first_chunk(computes_prompt)):
                # Until its first chunk a decode waits for the prompt's KV (or computes the prompt): it may stay silent for
                # the whole first-chunk budget; then idle_timeout_ms between chunks.
                work_ms = round(job.budgets.work_s * 1000) if computes_prompt else 0
                stream_timeout = leg_timeout(self.settings.connect_timeout_ms, self.settings.request_timeout_ms + work_ms,
                                             self.settings.idle_timeout_ms, round(first_chunk_s * 1000))
                response = await open_stream(self.fleet.engines, decode, job.path, body, leg_id, stream_timeout)
                reader = FrameReader(response.content)
                frames = [data for _event, data in await reader.batch() or [(None, DONE_DATA)]]
                if frames[0] == DONE_DATA:
                    raise LegFailed(UpstreamError("the decode engine closed the stream before its first chunk"), retryable=True)
                first = parse_chunk(decode, frames[0])
        except BaseException as exc:
            if response is not None:
                response.close()  # given up before the first chunk: the engine sees the disconnect
            if isinstance(exc, (TimeoutError, ConnectionError, ValueError)):
                exc = exception_failure(decode, exc, "before the first chunk")
            if isinstance(exc, LegFailed):
                self.pairing.outcome(decode, exc)
                exc = exc if computes_prompt else exc.after_prefill(decode, self._windows(pair))
            raise exc
        self._first_token(job, pair, sent)
        return Leg(decode, response=response, reader=reader, first=first, rest=frames[1:])

    def _windows(self, pair: Pair) -> tuple[int | None, int | None]:
        windows = self.monitor.windows
        return windows.get(pair.prefill.url) if pair.prefill else None, windows.get(pair.decode.url)

    def _first_token(self, job: Job, pair: Pair, sent: float) -> None:
        """Streams only: a non-streamed answer has no first-token moment the router can see."""
        now = time.perf_counter()
        ttft = now - job.started
        self.metrics.observe_ttft(ttft, self.pairing.mode)
        if self.fleet.handoff.prefill_leg:
            self.metrics.kv_handoff.observe(now - sent)
        log_event(events.ROUTER_DECODE_FIRST_TOKEN, f"first token after {ttft * 1000:.1f} ms", request_id=job.request_id,
                  decode=pair.decode.url, ttft_ms=ms(ttft))

    def _decode_failed(self, job: Job, decode: Any, failure: LegFailed, *, mid_stream: bool, retried: bool) -> None:
        log_event(events.ROUTER_DECODE_FAILED, f"decode {decode.url} failed{' mid-stream' if mid_stream else ''}: {failure.error.message}",
                  "ERROR" if mid_stream else "WARNING", request_id=job.request_id, decode=decode.url, status=failure.status,
                  error=failure.error.message, mid_stream=mid_stream, retried=retried)


class DecodeStream:
    """4. Relay: an open decode stream, read by the API's relay (api/common.relay) one network read at a time.

    `await stream.next()` is the next non-empty list of chunks (dicts; with raw_model or text_frame, ordinary token
    chunks as the client's frames, bytes), or None once the stream ended complete; it always ends with a usage chunk.
    A failure raises the client's APIError, after the good chunks before it were returned. `close()`, always: it
    closes an unfinished leg's connection (the engine cancels and frees the KV) and frees the decode's slot. A
    coroutine the relay awaits, not an async generator it iterates: a streamed chunk passes through one frame here
    (docs/router-performance.md).

    `forward_to(out)`, once the relay has written the first batch: from then on an ordinary token chunk that arrives
    while the relay waits in `next()` (the network read is one frame of the learnt shape, relay.Passthrough.whole) is
    written to the client from the engine connection's read itself, and counted, without waking the relay: at a
    token every few milliseconds, most of a stream's chunks pass so. `sent` counts the token chunks the client was
    sent either way."""

    def __init__(self, client: PDClient, job: Job, tried: Tried, leg: Leg, raw_model: str | None,
                 text_frame: TextFrame | None) -> None:
        self.client, self.job, self.tried, self.leg = client, job, tried, leg
        self.tally = Tally(client.metrics, job.started)
        first = leg.first or {}
        self.passthrough = Passthrough(first.get("model"), raw_model or "", text_frame) \
            if raw_model is not None or text_frame is not None else None
        self._done = leg.answer is not None  # [DONE] seen (a finished answer needs none)
        self._over = leg.answer is not None  # ended complete or failed (or answered whole): nothing to say when closed
        self._bad: Exception | None = None  # a bad frame, raised once the good chunks before it are relayed
        # Chunks not yet handed to the relay: the first, checked before anything reached the client, and the frames
        # that arrived with it; or, when the prefill finished the answer, that answer as the chunks decode would have sent.
        self._ready: list[dict[str, Any] | bytes] = answer_chunks(leg.answer) if leg.answer is not None else [first]
        self._take(leg.rest, self._ready)
        self.sent = 0  # token chunks the client was sent: by the relay, or forwarded
        self._out: WriteNow | None = None

    def forward_to(self, out: WriteNow) -> None:
        """Write token chunks to `out` as they arrive, where that is certain to keep their order (the class doc)."""
        if self.passthrough is not None and self.leg.response is not None:
            self._out = out
            self.leg.response.forward = self._forward

    def _forward(self, block: bytes) -> bool:
        """A network read that arrived while the relay waits with nothing unsent: written on and True, or False and
        the relay wakes for it as usual (anything but a token chunk taken whole, a client behind or gone)."""
        out, reader, passthrough = self._out, self.leg.reader, self.passthrough
        if out is None or passthrough is None or reader is None or self._ready or self._done or self._bad is not None \
                or not reader.idle or not out.ready():
            return False
        relayed = passthrough.whole(block)  # (before it, nothing may decline: a translated frame's text_frame keeps state)
        if relayed is None:
            return False
        out.write(relayed)
        self.tally.token(time.perf_counter())
        self.sent += 1
        return True

    async def next(self) -> list[dict[str, Any] | bytes] | None:
        try:
            chunks, self._ready = self._ready, []
            response, reader, whole = self.leg.response, self.leg.reader, self.passthrough and self.passthrough.whole
            while not chunks and not self._done and self._bad is None:
                assert response is not None and reader is not None, "stream leg opened without a reader"
                block = await response.readany()  # read here, not in reader.batch(): one coroutine less each chunk resumes
                if whole is not None and reader.idle and (relayed := whole(block)) is not None:
                    chunks.append(relayed)  # one token chunk, the whole read (relay.Passthrough.whole)
                    break
                batch = reader.feed(block) if block else reader.end()
                if batch is None:
                    break
                self._take([data for _event, data in batch], chunks)
            if chunks:
                self.tally.count(chunks)
                if self.tally.usage is not None:  # the usage chunk came in this batch
                    report_cached(self.tally.usage, self.leg.prefill_cached)
                return chunks
            if self._bad is not None:
                raise self._bad
            return self._end()
        except (LegFailed, TimeoutError, ConnectionError, ValueError) as exc:
            self._over = True
            decode = self.leg.decode
            failure = exc if isinstance(exc, LegFailed) else exception_failure(decode, exc, "mid-stream")
            self.client.pairing.outcome(decode, failure)
            self.client._decode_failed(self.job, decode, failure, mid_stream=True, retried=False)
            raise failure.error from None

    def _take(self, frames: list[bytes], chunks: list[dict[str, Any] | bytes]) -> None:
        """`frames` onto `chunks`, up to [DONE] or a bad frame (kept for after the good chunks before it)."""
        passthrough = self.passthrough
        for data in frames:
            if data == DONE_DATA:
                self._done = True
                return
            if passthrough is not None and (relayed := passthrough.take(data)) is not None:
                chunks.append(relayed)
                continue
            try:
                chunks.append(parse_chunk(self.leg.decode, data))
            except (LegFailed, ValueError) as exc:
                self._bad = exc
                return

    def _end(self) -> list[dict[str, Any] | bytes] | None:
        """The stream's end: checked complete (never a silent truncation), the decode's outcome and the stream's
        metrics recorded; a usage chunk of the router's own when the engine sent none."""
        if self._over:
            return None
        self._over = True
        job, leg, tally = self.job, self.leg, self.tally
        if not (self._done and tally.finished):
            raise LegFailed(UpstreamError("the decode engine's stream ended early (no finish_reason or [DONE]); the answer is "
                                          "incomplete"), retryable=True)
        self.client.pairing.outcome(leg.decode)
        if not self.client.fleet.handoff.prefill_leg:
            self.client.metrics.observe_prompt_cache(leg.decode, tally.usage)
        self.client.metrics.observe_stream(tally.first - job.started, tally.last - tally.first, tally.tokens)  # TPOT, goodput
        if tally.usage is not None:
            return None
        # Engines that ignore include_usage: count relayed chunks (prompt from the router's estimate).
        first = leg.first or {}
        usage = {"prompt_tokens": job.prompt_tokens, "completion_tokens": tally.tokens, "total_tokens": job.prompt_tokens + tally.tokens}
        return [{"id": first.get("id", ""), "object": first.get("object", "chat.completion.chunk"), "created": first.get("created", 0),
                 "model": first.get("model", ""), "choices": [], "usage": usage}]

    def close(self) -> None:
        if not self._over:
            log_event(events.ROUTER_CLIENT_DISCONNECTED, "client went away; upstream decode cancelled", "WARNING",
                      request_id=self.job.request_id, decode=self.leg.decode.url, chunks_relayed=self.tally.tokens)
            self._over = True
        if self.leg.response is not None:
            self.leg.response.close()  # unless finished, this drops the connection (the engine cancels and frees the KV); it unhooks _forward
        self.client.pairing.release_decode(self.tried)
