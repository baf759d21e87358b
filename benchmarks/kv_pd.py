"""The PD path with prefix caching, measured on two in-process engines (a section of `python -m benchmarks.kv_transfer`).

`prefix_hit`: what a cache hit costs in the contiguous-cache design (copy the cached blocks into the
new sequence's cache) against recomputing those tokens (a prefill of the same length).

`kv_overlap`: one prefill of `--prompt` tokens, three ways, best of `--repeat` each, interleaved —
compute only (no push), serial (the push starts after the prefill: the old design), and streamed
(the engine's path: each layer goes on the wire as soon as it is computed). Each run is split at
the moment the prefill is done: its compute (submit to first token) and its exposed transfer (first
token to decode's ack, `PushResult.tail_ms`), so the shared machine's noise in the compute does
not leak into the transfer figure. Hidden share = 1 - streamed's exposed / serial's.

`kv_session`: one agentic session through the engines' own hand-off (KVHandoff on both sides, the
real KV socket): a system prompt of `--prompt` tokens, then 5 turns that each append the previous
answer and 64 new user tokens. Per turn: bytes decode received against the KV of the tokens it did
not hold yet (its previous prompt + answer), and against a full transfer. float32 and float16.
Each engine runs on its own event loop thread, as the prefill and decode processes would.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from benchmarks._common import Bench, best_time
from stack.common.config import build
from stack.common.logging import setup_logging
from stack.engine.config import EngineConfig
from stack.engine.kv_cache import KVCache, KVPool
from stack.engine.kv_transfer import LayerStream, prompt_hash
from stack.engine.kv_wire import KVHeader, KVTrailer
from stack.engine.model import Segment, forward
from stack.engine.prefix_cache import PrefixCache
from stack.engine.protocol import CompletionRequest, KVTransferParams, SamplingParams
from stack.engine.server import ENGINE, Engine, create_app

USER_TOKENS, ANSWER_TOKENS, TURNS = 64, 16, 5


class LoopEngine:
    """An engine (scheduler, hand-off, KV listener) built as the server builds it, on its own loop thread."""

    def __init__(self, bench: Bench, role: str, **fields: Any) -> None:
        kv = {"kv_port": 0, "kv_ip": "127.0.0.1"} if role == "decode" else {}
        data = {"model": "bench", "role": role, "checkpoint": "dummy:bench", "kv_transfer_config": kv, **fields}
        self.config = build(EngineConfig, data, "benchmark")
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.engine: Engine = self.run(self._start(bench))

    async def _start(self, bench: Bench) -> Engine:
        engine = create_app(self.config, bench.model)[ENGINE]
        engine.scheduler.start()
        await engine.handoff.start()
        return engine

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    @property
    def kv_addr(self) -> str:
        consumer = self.engine.handoff.consumer
        assert consumer is not None, "not a KV consumer"
        return f"127.0.0.1:{consumer.port}"

    def close(self) -> None:
        async def stop() -> None:
            await self.engine.handoff.close()
            await self.engine.scheduler.stop()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


def prefix_hit(bench: Bench) -> None:
    """Admission of `--prompt` cached tokens (their blocks shared by reference into a new table) vs their prefill."""
    cfg, n = bench.model.config, bench.prompt_tokens
    tokens = np.random.default_rng(2).integers(1, cfg.vocab_size, n)
    compute = best_time(lambda: forward(bench.model, [Segment(tokens, KVCache(cfg, n), 0)]), bench.repeat, bench.clock)
    bench.report(f"prefill of {n} tokens (recompute)", f"{compute * 1e3:8.2f} ms")
    pool = KVPool(cfg, 3 * n * cfg.kv_bytes_per_token)
    cache = PrefixCache(pool, bench.model.fingerprint)
    source = pool.allocate(n)
    assert source is not None
    forward(bench.model, [Segment(tokens, source, 0)])
    cache.store(tokens.tolist(), source)
    pool.free(source)
    blocks = cache.match(cache.hashes(tokens.tolist()))

    def hit() -> None:
        shared = cache.allocate(n, blocks)
        assert shared is not None
        pool.free(shared)

    seconds = best_time(hit, bench.repeat, bench.clock)
    bench.report(f"  cache hit: share {len(blocks)} blocks in", f"{seconds * 1e3:8.2f} ms", f"{compute / seconds:.0f} x faster than recomputing")


def _header(bench: Bench, transfer_id: str, prompt: list[int]) -> KVHeader:
    cfg = bench.model.config
    return KVHeader(transfer_id, "bench", bench.model.fingerprint, "float32", cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
                    len(prompt), prompt_hash(prompt))


def kv_overlap(bench: Bench) -> None:
    """Compute only vs serial push vs layer-streamed push of one prefill."""
    setup_logging("benchmark", level="WARNING")
    prefill, decode = LoopEngine(bench, "prefill", prefix_caching=False), LoopEngine(bench, "decode", prefix_caching=False)
    scheduler, producer, consumer = prefill.engine.scheduler, prefill.engine.handoff.producer, decode.engine.handoff.consumer
    assert consumer is not None
    rng, n_layers, runs = np.random.default_rng(11), bench.model.config.n_layers, iter(range(10**9))
    greedy = SamplingParams(max_tokens=1, temperature=0)

    def prompt() -> list[int]:
        return rng.integers(1, bench.model.config.vocab_size, bench.prompt_tokens).tolist()

    async def compute() -> tuple[float, float]:
        started = time.perf_counter()
        (await scheduler.prefill(f"c{next(runs)}", prompt(), greedy)).release()
        return time.perf_counter() - started, 0.0

    async def push(streamed: bool) -> tuple[float, float]:
        tokens, tid = prompt(), f"o{next(runs)}"
        started, stream = time.perf_counter(), LayerStream()
        task = asyncio.ensure_future(producer.push(_header(bench, tid, tokens), stream, decode.kv_addr))
        prefilled = await scheduler.prefill(tid, tokens, greedy, on_layer=stream.layer_done if streamed else None)
        computed = time.perf_counter() - started
        assert prefilled.kv is not None
        if not streamed:
            view = SimpleNamespace(k=prefilled.kv.k, v=prefilled.kv.v)
            for layer in range(n_layers):
                stream.layer_done(layer, view)  # type: ignore[arg-type]
        stream.finish(KVTrailer(prefilled.kv.first_token, prefilled.kv.seed))
        result = await task
        prefilled.release()
        decode.run(consumer.claim(tid, 5000)).release()
        return computed, result.tail_ms / 1000

    arms = {"compute": compute, "serial": lambda: push(False), "streamed": lambda: push(True)}
    best = {name: [1e9, 1e9] for name in arms}  # [compute s, exposed transfer s], each the best of its runs
    prefill.run(compute())  # warm-up
    for _ in range(bench.repeat):  # interleaved: the shared box is noisy; best of each
        for name, make in arms.items():
            best[name] = [min(a, b) for a, b in zip(best[name], prefill.run(make()))]
    nbytes = bench.prompt_tokens * bench.model.config.kv_bytes_per_token
    (c_only, _), (c_serial, t_serial), (c_streamed, t_streamed) = best["compute"], best["serial"], best["streamed"]
    bench.report(f"prefill {bench.prompt_tokens} tokens, compute only", f"{c_only * 1e3:8.1f} ms")
    bench.report(f"  serial push of {nbytes / 1e6:.1f} MB after it", f"{t_serial * 1e3:8.1f} ms exposed",
                 f"compute {c_serial * 1e3:.1f} ms ({c_serial / c_only:.2f} x compute only)")
    bench.report("  layer-streamed push (the engine's path)", f"{t_streamed * 1e3:8.1f} ms exposed",
                 f"compute {c_streamed * 1e3:.1f} ms ({c_streamed / c_only:.2f} x compute only); "
                 f"hidden {1 - t_streamed / max(t_serial, 1e-9):.0%} of the serial push's transfer time")
    prefill.close()
    decode.close()


def kv_session(bench: Bench) -> None:
    """Bytes on the wire per turn of a multi-turn session, float32 and float16 KV."""
    setup_logging("benchmark", level="WARNING")
    for dtype in ("float32", "float16"):
        prefill, decode = LoopEngine(bench, "prefill", kv_dtype=dtype), LoopEngine(bench, "decode", kv_dtype=dtype)
        per_token = bench.model.config.kv_bytes_per_token * np.dtype(dtype).itemsize // 4
        rng = np.random.default_rng(5)
        tokens = rng.integers(1, bench.model.config.vocab_size, bench.prompt_tokens).tolist()
        held, total, total_full = 0, 0, 0
        for turn in range(TURNS):
            tokens += rng.integers(1, bench.model.config.vocab_size, USER_TOKENS).tolist()
            tid = f"{dtype}-{turn}"
            leg = CompletionRequest("completion", "bench", tuple(tokens), SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True),
                                    False, False, KVTransferParams(True, False, tid, decode.kv_addr))
            before = decode.engine.scheduler.metrics.kv_bytes.value(side="receive")
            cached = prefill.run(prefill.engine.handoff.prefill(tid, leg)).cached_tokens
            answer = decode.run(_decode(decode.engine, tid, replace(leg, kv_transfer=KVTransferParams(False, True, tid))))
            shipped = decode.engine.scheduler.metrics.kv_bytes.value(side="receive") - before
            new = len(tokens) - held
            total, total_full = total + shipped, total_full + len(tokens) * per_token
            bench.report(f"{dtype} turn {turn}: {len(tokens)} prompt tokens, {new} new", f"{shipped / 1e6:8.3f} MB",
                         f"{shipped / (new * per_token):.2f} x the new tokens' KV; full transfer {len(tokens) * per_token / 1e6:.2f} MB; "
                         f"prefill computed {len(tokens) - cached}")
            held = len(tokens) + len(answer) - 1  # decode holds the KV of the prompt and the answer but its last token
            tokens += answer
        bench.report(f"{dtype} session total", f"{total / 1e6:8.3f} MB", f"{total / total_full:.2f} x shipping every prompt whole")
        prefill.close()
        decode.close()


async def _decode(engine: Engine, tid: str, req: CompletionRequest) -> list[int]:
    seq = await engine.handoff.decode(tid, req)
    while (await seq.outputs.get()).finish_reason is None:
        pass
    return list(seq.output)
