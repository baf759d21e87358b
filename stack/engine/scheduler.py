"""Continuous batching: one step loop per engine, the numpy forward in a worker thread.

Each step, on the event loop: drop cancelled sequences (their KV goes back to the pool), take every
running decode (one token each), then admit waiting sequences in arrival order while the step's
token budget (`max_num_batched_tokens`, decodes counted first) and `max_num_seqs` allow and the KV
pool has room.

Three ways in, all plain arrays and tokens: `submit(prompt)` prefills and decodes here;
`prefill(prompt)` runs the prompt to its first token and lends out its KV (the cache stays reserved
until released); `submit(prompt, kv=PromptKV)` continues from KV and a first token computed
elsewhere: at admission the arrays are copied into the sequence's pool blocks, the first token is
emitted and it joins the decodes at once. Where the KV comes from or goes to is the caller's
business (handoff.py); the scheduler only says when it no longer reads the arrays (`kv_read`).

The forward pass and sampling run in one dedicated thread, so HTTP and the KV socket stay
responsive. All state changes happen on the event loop between steps, so a cancel never frees a
cache the forward is writing. One algorithm serves every role: a prefill engine mostly sees
prefills, a decode engine mostly decodes, a colocated one mixes them (the interference PD removes);
with `chunked_prefill` a long prompt is cut to what the step budget leaves beside the decodes.

Prefix caching (prefix_cache.py): at admission the leading cached blocks of the prompt head the new
sequence's block table (shared, not copied) and only the rest is computed; a prompt's full blocks
are kept when its prefill is done, and the whole sequence's (prompt and output) when it finishes.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
from loguru import logger

from stack.common import events
from stack.common.logging import log_event
from stack.engine import batched_decode, gemm, stopping
from stack.engine.grammar import Constraint
from stack.engine.kv_cache import KVCache, KVPool
from stack.engine.metrics import EngineMetrics
from stack.engine.model import Model, Segment, forward
from stack.engine.prefix_cache import PrefixCache
from stack.engine.protocol import SamplingParams
from stack.engine.sampling import next_token
from stack.engine.sequence import Output, Prefilled, PromptKV, Sequence, TokenLogprob
from stack.engine.tokenizer import IncrementalDecoder


@dataclass
class _Work:
    """One sequence's part of a step: a prefill chunk or a decode token."""

    seq: Sequence
    segment: Segment
    samples: bool  # this chunk reaches the end of the prompt (or is a decode): sample a token


class _Stopped(Exception):
    """A sequence in the step was cancelled: the forward stops after layer `layer` (its caches are not advanced)."""

    def __init__(self, layer: int) -> None:
        super().__init__(layer)
        self.layer = layer


class Scheduler:
    """Owns the KV pool and the step loop; `submit` or `prefill` sequences, read `seq.outputs`, `cancel` them."""

    def __init__(self, model: Model, pool: KVPool, *, max_num_batched_tokens: int, max_num_seqs: int, chunked_prefill: bool,
                 metrics: EngineMetrics | None = None, prefix: PrefixCache | None = None, attention: str = "numba") -> None:
        self.metrics = metrics or EngineMetrics()
        self.model = model
        self.attention = attention  # forward's decode attention: "numba" (the compiled kernel) | "numpy"
        self.pool = pool
        self.prefix = prefix or PrefixCache(pool, model.fingerprint, enabled=False)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunked_prefill = chunked_prefill
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._task: asyncio.Task[None] | None = None
        self.steps = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-step-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for seq in [*self.waiting, *self.running]:
            self._finish(seq, "abort")
        self._executor.shutdown(wait=True)

    async def warmup(self) -> None:
        """One real forward (prefill + decode) on a throwaway cache: loads BLAS, touches the weights, and compiles the
        attention kernel (or loads it from numba's cache), so no request pays for it."""
        batched_decode.log_attention(self.attention)
        gemm.log_matmuls(self.model.matmul)
        cache = KVCache(self.model.config, 8)
        loop = asyncio.get_running_loop()
        step = partial(forward, self.model, attention=self.attention)
        await loop.run_in_executor(self._executor, step, [Segment(np.arange(4), cache, 0)])
        await loop.run_in_executor(self._executor, step, [Segment(np.arange(1), cache, 4)])

    # -- requests --------------------------------------------------------------------------------

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, kv: PromptKV | None = None, choice: int = 0) -> Sequence:
        """Queue a request (raises CacheCapacityError if it can never fit); read `seq.outputs`.

        With `kv` the prompt is not run here: decoding continues from those arrays and first token.
        The caller keeps the arrays intact until `seq.kv_read` is done.
        """
        if kv is not None:
            cfg = self.model.config
            shape = (cfg.n_layers, len(prompt) - len(kv.prefix) * self.pool.block_size, cfg.n_kv_heads, cfg.head_dim)
            assert kv.k.shape == kv.v.shape == shape, f"prompt KV of shape {kv.k.shape}, {kv.v.shape}; expected {shape}"
        return self._queue(request_id, prompt, params, kv, keeps_cache=False, choice=choice)

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams,
                      on_layer: Callable[[int, KVCache], None] | None = None) -> Prefilled:
        """Run `prompt` to its first token (sampled as `submit` would) and lend out its KV.

        `params.max_tokens` is taken as 1. The cache stays reserved until `release()`; cancelling
        the wait cancels the sequence and frees it. `on_layer(i, cache)` is called from the step
        thread as soon as layer i of the whole prompt is in `cache` (its last chunk's forward).
        """
        seq = self._queue(request_id, prompt, replace(params, max_tokens=1), None, keeps_cache=True)
        seq.on_layer = on_layer
        release = partial(self._release_kept, seq)
        try:
            out = await seq.outputs.get()  # one token: its output is the last one
        except BaseException:
            self.cancel(seq)  # still running: the next step frees its cache
            release()  # already finished: its kept cache goes now
            raise
        assert out.finish_reason is not None, f"prefill of {request_id} gave a partial output"
        cache = seq.cache
        if cache is None:  # error or abort: nothing was kept
            return Prefilled(out, None, release)
        n = len(prompt)
        first_logprob = out.logprobs[0] if out.logprobs else None
        return Prefilled(out, PromptKV(*cache.head(n), seq.output[0], seq.seed, first_logprob,
                                       cached_tokens=seq.cached_tokens), release)

    def cancel(self, seq: Sequence) -> None:
        """The client went away: stop the sequence and free its KV before the next step."""
        if not seq.finished:
            seq.cancelled = True
            self._wake.set()

    def load(self) -> dict[str, int]:
        """Numbers for /health and the router: queue, running sequences, free KV blocks."""
        return {
            "waiting": len(self.waiting),
            "running": len(self.running),
            "kv_free_blocks": self.pool.reclaimable_blocks,  # unpinned cached blocks count as free
            "kv_total_blocks": self.pool.total_blocks,
            "kv_cached_blocks": len(self.prefix.blocks),
        }

    def _queue(self, request_id: str, prompt: list[int], params: SamplingParams, kv: PromptKV | None, *, keeps_cache: bool,
               choice: int = 0) -> Sequence:
        self.pool.check_fits(len(prompt) + params.max_tokens)
        if kv is not None:
            seed = kv.seed
        else:
            seed = params.seed if params.seed is not None else random.getrandbits(63)
        kv_read = asyncio.get_running_loop().create_future()
        if kv is None:
            kv_read.set_result(None)
        seq = Sequence(request_id, list(prompt), params, seed, kv_read, start_kv=kv, keeps_cache=keeps_cache, choice=choice)
        seq.detok = IncrementalDecoder(self.model.tokenizer, context=prompt)
        seq.block_hashes = self.prefix.hashes(prompt)
        vocab = self.model.config.vocab_size
        if params.grammar is not None:
            seq.constraint = Constraint(params.grammar, self.model.tokenizer, vocab)
        if params.penalised:
            seq.counts = np.zeros(vocab, np.int32)  # (vocab,)
            if params.repetition_penalty != 1:
                seq.in_prompt = np.zeros(vocab, bool)  # (vocab,)
                seq.in_prompt[np.asarray(prompt, dtype=np.int64)] = True
        self.waiting.append(seq)
        self._wake.set()
        return seq

    def _release_kept(self, seq: Sequence) -> None:
        if seq.finished and seq.cache is not None:
            self.pool.free(seq.cache)
            seq.cache = None

    # -- the step loop ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            work = self._schedule()
            if not work:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                started = time.perf_counter()
                tokens = await loop.run_in_executor(self._executor, self._execute, work)
                self.metrics.on_step(sum(len(w.segment.tokens) for w in work if w.seq.prefilling), sum(not w.seq.prefilling for w in work),
                                     time.perf_counter() - started)
            except _Stopped as stop:  # a cancelled prefill: the next _schedule frees it; the rest of the batch runs again
                for item in work:
                    if item.seq.cancelled and item.seq.prefilling:
                        log_event(events.ENGINE_PREFILL_STOPPED, f"stopped the cancelled prefill after layer {stop.layer + 1} of "
                                  f"{self.model.config.n_layers}", "WARNING", request_id=item.seq.request_id,
                                  prompt_tokens=len(item.seq.prompt), computed_tokens=item.seq.num_computed, layers_done=stop.layer + 1)
                continue
            except Exception:  # a bug in the forward: fail this batch, keep serving
                logger.bind(event=events.ENGINE_STEP_FAILED, sequences=len(work)).opt(exception=True).error(
                    "engine step failed; its sequences end with an error")
                for item in work:
                    self._finish(item.seq, "error")
                continue
            self.steps += 1
            self._commit(work, tokens)

    def _schedule(self) -> list[_Work]:
        for seq in [s for s in [*self.waiting, *self.running] if s.cancelled]:
            self._cancel_now(seq)
        work = [self._decode_work(seq) for seq in self.running if not seq.prefilling]
        budget = self.max_num_batched_tokens - len(work)
        # Chunked prefills already under way continue first, then new admissions in arrival order.
        for seq in [s for s in self.running if s.prefilling]:
            chunk = self._chunk(seq, budget, first=False)  # only chunked prefills span steps
            if chunk:
                work.append(self._prefill_work(seq, chunk))
                budget -= chunk
        prefills = sum(1 for w in work if w.seq.prefilling)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            chunk, hit = 0, list(seq.start_kv.prefix) if seq.start_kv is not None else []
            if seq.start_kv is None:
                hit = self.prefix.match_prompt(seq.block_hashes, len(seq.prompt))
                seq.num_computed = len(hit) * self.pool.block_size  # what _chunk sees; undone if it waits
                chunk = self._chunk(seq, budget, first=prefills == 0)
                if chunk == 0:
                    seq.num_computed = 0
                    break
            cache = self.prefix.allocate(len(seq.prompt) + seq.params.max_tokens, hit)
            if cache is None:
                seq.num_computed = 0
                self._log_queued(seq)
                break
            self.waiting.pop(0)
            seq.cache = cache
            if seq.start_kv is None:
                cache.set_length(len(hit) * self.pool.block_size)
                seq.cached_tokens = cache.length
                self.prefix.record(len(seq.prompt), cache.length)
            self.running.append(seq)
            if seq.start_kv is not None:
                self._load_start_kv(seq)
                if not seq.finished:
                    work.append(self._decode_work(seq))
                    budget -= 1
                continue
            work.append(self._prefill_work(seq, chunk))
            budget -= chunk
            prefills += 1
        return work

    def _chunk(self, seq: Sequence, budget: int, first: bool) -> int:
        """Prompt tokens of `seq` this step: all the rest, a budget-sized chunk, or 0 (wait)."""
        rest = len(seq.prompt) - seq.num_computed
        if rest <= budget:
            return rest
        if self.chunked_prefill:
            return max(budget, 0)
        # Unchunked and too big for what is left: it runs alone with the decodes, or next step.
        return rest if first else 0

    def _decode_work(self, seq: Sequence) -> _Work:
        assert seq.cache is not None, f"running sequence {seq.request_id} has no cache"
        return _Work(seq, Segment(np.array([seq.output[-1]]), seq.cache, seq.cache.length), samples=True)

    def _prefill_work(self, seq: Sequence, chunk: int) -> _Work:
        assert seq.cache is not None, f"prefilling sequence {seq.request_id} has no cache"
        if seq.prefill_started is None:
            seq.prefill_started = time.perf_counter()
        start = seq.num_computed
        tokens = np.asarray(seq.prompt[start : start + chunk])  # (chunk,)
        return _Work(seq, Segment(tokens, seq.cache, start), samples=start + chunk == len(seq.prompt))

    def _execute(self, work: list[_Work]) -> list[tuple[int, TokenLogprob | None] | None]:
        """Worker thread: one forward over the whole batch, then sample where a token is due."""
        hooks = [(w.seq.on_layer, w.segment.cache) for w in work if w.samples and w.seq.on_layer is not None and w.seq.prefilling]
        prefills = [w.seq for w in work if w.seq.prefilling]

        def on_layer(layer: int) -> None:
            if any(seq.cancelled for seq in prefills):  # a long prefill nobody waits for stops here, not after its last layer
                raise _Stopped(layer)
            for hook, cache in hooks:
                hook(layer, cache)

        logits = forward(self.model, [w.segment for w in work], on_layer=on_layer if prefills else None,
                         attention=self.attention)  # (len(work), vocab)
        return [self._sample(w.seq, row) if w.samples else None for w, row in zip(work, logits)]

    def _sample(self, seq: Sequence, row: np.ndarray) -> tuple[int, TokenLogprob | None]:
        """(vocab,) raw logits -> the next token of `seq` (and its logprobs if asked for)."""
        return next_token(seq, row, self.model.tokenizer.stop_ids)

    def _commit(self, work: list[_Work], tokens: list[tuple[int, TokenLogprob | None] | None]) -> None:
        for item, token in zip(work, tokens):
            seq = item.seq
            if seq.finished:
                continue
            if seq.prefilling:
                seq.num_computed += len(item.segment.tokens)
                if not seq.prefilling:
                    self.prefix.store(seq.prompt, item.segment.cache, seq.block_hashes)  # same-prefix requests hit from now on
                    self.metrics.on_prefill_done(seq, time.perf_counter())
                    self._log_prefill_done(seq)
            if token is not None and not seq.cancelled:
                self._append_token(seq, *token)

    # -- per-sequence transitions ----------------------------------------------------------------

    def _load_start_kv(self, seq: Sequence) -> None:
        """Copy the given prompt KV into the pool blocks after the shared prefix and emit its first token."""
        kv, cache = seq.start_kv, seq.cache
        assert kv is not None and cache is not None, f"sequence {seq.request_id} has no KV to load or no cache"
        n, reused = len(seq.prompt), len(kv.prefix) * self.pool.block_size  # blocks this engine held, then the shipped rest
        for layer in range(self.model.config.n_layers):
            cache.write(layer, reused, kv.k[layer], kv.v[layer])  # (n - reused, n_kv_heads, head_dim) each
        cache.set_length(n)
        seq.cached_tokens = kv.cached_tokens
        self.prefix.store(seq.prompt, cache, seq.block_hashes)  # later turns of this session reuse it (and skip its transfer)
        self._drop_start_kv(seq)
        seq.num_computed = n
        self._append_token(seq, kv.first_token, kv.first_logprob)

    def _drop_start_kv(self, seq: Sequence) -> None:
        """The given arrays are no longer read; their owner may reuse them."""
        seq.start_kv = None
        if not seq.kv_read.done():
            seq.kv_read.set_result(None)

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> None:
        seq.output.append(token)
        now = time.perf_counter()
        self.metrics.on_token(seq, now)
        seq.first_token_at, seq.last_token_at = seq.first_token_at or now, now
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.counts is not None:
            seq.counts[token] += 1
        if seq.constraint is not None:
            seq.constraint.consume(token)  # the first token of a PD decode leg too: it came from prefill
        if len(seq.output) == 1:
            log_event(events.ENGINE_FIRST_TOKEN, "first token", request_id=seq.request_id,
                      ttft_ms=round((time.perf_counter() - seq.arrival) * 1000, 2))
        reason = stopping.add_token_text(seq, token, self.model.tokenizer.stop_ids)
        if reason is not None:
            self._finish(seq, reason)
            return
        seq.outputs.put_nowait(Output(stopping.releasable_text(seq), len(seq.output), logprobs=self._take_logprobs(seq)))

    @staticmethod
    def _take_logprobs(seq: Sequence) -> tuple[TokenLogprob, ...]:
        taken = tuple(seq.logprobs)
        seq.logprobs.clear()
        return taken

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.finished:
            return
        seq.finish_reason = reason
        tail = seq.text[seq.sent :] if reason in ("stop", "length") else ""
        seq.sent = len(seq.text)
        self._remove(seq)
        if seq.cache is not None and not (seq.keeps_cache and reason in ("stop", "length")):
            if reason in ("stop", "length"):  # the next turn of a conversation starts with these tokens
                self.prefix.store(seq.prompt + seq.output, seq.cache, seq.block_hashes)
            self.pool.free(seq.cache)  # a finished `prefill` keeps it until Prefilled.release
            seq.cache = None
        self._drop_start_kv(seq)
        self.metrics.on_finish(seq, reason, time.perf_counter())
        seq.outputs.put_nowait(Output(tail, len(seq.output), reason, self._take_logprobs(seq), seq.stop_reason))
        if reason in ("stop", "length"):
            log_event(events.ENGINE_REQUEST_FINISHED, f"finished ({reason}) after {len(seq.output)} tokens", request_id=seq.request_id,
                      prompt_tokens=len(seq.prompt), completion_tokens=len(seq.output), finish_reason=reason,
                      e2e_ms=round((time.perf_counter() - seq.arrival) * 1000, 2))

    def _cancel_now(self, seq: Sequence) -> None:
        blocks = seq.cache.blocks if seq.cache is not None else 0
        self._finish(seq, "abort")
        log_event(events.ENGINE_REQUEST_CANCELLED, f"client went away; freed {blocks} KV blocks", "WARNING",
                  request_id=seq.request_id, kv_blocks_freed=blocks, completion_tokens=len(seq.output))

    def _remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _log_queued(self, seq: Sequence) -> None:
        if not seq.queued_logged:
            seq.queued_logged = True
            log_event(events.ENGINE_REQUEST_QUEUED, "waiting for KV blocks", request_id=seq.request_id,
                      blocks_needed=self.pool.blocks_for(len(seq.prompt) + seq.params.max_tokens), blocks_free=self.pool.free_blocks)

    def _log_prefill_done(self, seq: Sequence) -> None:
        started = seq.prefill_started or seq.arrival
        log_event(events.ENGINE_PREFILL_DONE, f"prefilled {len(seq.prompt)} tokens", request_id=seq.request_id,
                  prompt_tokens=len(seq.prompt), prefill_ms=round((time.perf_counter() - started) * 1000, 2),
                  queue_ms=round((started - seq.arrival) * 1000, 2))
