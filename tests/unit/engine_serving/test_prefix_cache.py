"""Automatic prefix caching: a hit is token-for-token a cold run, eviction never serves a stale block,
another model's blocks never match, and usage/metrics report the cached tokens."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Callable

import numpy as np
import pytest

from stack.engine.kv_cache import KVPool
from stack.engine.metrics import EngineMetrics
from stack.engine.model import Model
from stack.engine.prefix_cache import PrefixCache, chain_hashes
from stack.engine.protocol import SamplingParams
from stack.engine.scheduler import Scheduler

from .conftest import chat

BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)


def make(model: Model, *, caching: bool, pool_blocks: int = 4000) -> Scheduler:
    pool = KVPool(model.config, pool_blocks * BS * model.config.kv_bytes_per_token, BS)
    metrics = EngineMetrics()
    prefix = PrefixCache(pool, model.fingerprint, enabled=caching, metrics=metrics)
    return Scheduler(model, pool, max_num_batched_tokens=256, max_num_seqs=8, chunked_prefill=False, metrics=metrics, prefix=prefix)


@pytest.fixture
def schedulers(tiny: Model, run_schedulers: Callable[[Scheduler], Scheduler]) -> Callable[..., Scheduler]:
    """`schedulers(caching=…, pool_blocks=…)`: a running scheduler with its own prefix cache."""
    return lambda **kw: run_schedulers(make(tiny, **kw))


async def run(s: Scheduler, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    """(output tokens, cached prompt tokens) of one request; its tokens' logprobs are in `LOGPROBS[-1]`."""
    seq = s.submit("r", prompt, params)
    logprobs: list[float] = []
    while True:
        out = await seq.outputs.get()
        logprobs += [lp.logprob for lp in out.logprobs]
        if out.finish_reason is not None:
            break
    LOGPROBS.append(np.array(logprobs))
    return seq.output, seq.cached_tokens


LOGPROBS: list[np.ndarray] = []


def same_logprobs() -> None:
    """The last two runs' token logprobs agree to float32 rounding (another summation order, not other K/V)."""
    np.testing.assert_allclose(LOGPROBS[-1], LOGPROBS[-2], rtol=0, atol=1e-4)


def prompt_of(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(1, 250), k=n)


async def test_a_cache_hit_gives_the_cold_runs_tokens(schedulers) -> None:
    """Repeated and extended prompts hit the cache (only the suffix is computed) and decode exactly as cold."""
    cold, warm = schedulers(caching=False), schedulers(caching=True)
    system = prompt_of(1, 5 * BS + 3)
    turns = [system, system + prompt_of(2, 20), system, system[: 4 * BS]]  # extension, repeat, block-aligned repeat
    for i, prompt in enumerate(turns):
        expected, _ = await run(cold, prompt)
        got, cached = await run(warm, prompt)
        assert got == expected, f"turn {i}"
        same_logprobs()
        if i:
            assert cached > 0 and cached < len(prompt), f"turn {i}: at least one token is always computed"
    assert (await run(warm, turns[3]))[1] == 3 * BS  # block-aligned: the last block is recomputed for the logits
    m = warm.metrics
    assert m.prefix_hits.value() > 0 and m.prefix_queries.value() >= sum(map(len, turns))


async def test_eviction_under_pressure_never_serves_a_stale_block(schedulers) -> None:
    """A pool far smaller than the prompts' blocks evicts constantly; every output still equals the cold one."""
    cold, warm = schedulers(caching=False), schedulers(caching=True, pool_blocks=14)  # one request needs 5-6 blocks
    shared = prompt_of(7, 2 * BS)
    prompts = [shared + prompt_of(100 + i, 2 * BS + i) for i in range(6)] + [prompt_of(200 + i, 3 * BS) for i in range(3)]
    expected = {i: ((await run(cold, p))[0], LOGPROBS[-1]) for i, p in enumerate(prompts)}
    order = random.Random(5).choices(range(len(prompts)), k=30)
    hits = 0
    for i in order:
        got, cached = await run(warm, prompts[i])
        assert got == expected[i][0], f"prompt {i}"
        np.testing.assert_allclose(LOGPROBS[-1], expected[i][1], rtol=0, atol=1e-4)
        hits += cached > 0
    assert warm.metrics.prefix_evictions.value() > 0 and hits > 0
    assert warm.pool.reclaimable_blocks == warm.pool.total_blocks  # nothing stays pinned
    assert len(warm.prefix.blocks) + warm.pool.free_blocks == warm.pool.total_blocks  # cached blocks are inside the budget


async def test_concurrent_requests_and_pins_survive_eviction(schedulers) -> None:
    """Requests racing for a tiny pool all finish correctly; a pinned block is never evicted."""
    warm = schedulers(caching=True, pool_blocks=10)
    prompt = prompt_of(3, 3 * BS + 1)
    await run(warm, prompt)
    blocks = warm.prefix.match(warm.prefix.hashes(prompt))
    assert len(blocks) == 3
    warm.prefix.pin(blocks)
    others = await asyncio.gather(*(run(warm, prompt_of(50 + i, 3 * BS)) for i in range(4)))
    assert all(len(out) == GREEDY.max_tokens for out, _ in others)
    assert warm.prefix.match(warm.prefix.hashes(prompt)) == blocks  # pinned: still there, same arrays
    warm.prefix.unpin(blocks)


def test_another_fingerprint_never_reuses_blocks(tiny: Model, tiny_other_seed: Model) -> None:
    """The chain's root is the model fingerprint: equal tokens under another model hash differently."""
    s = make(tiny, caching=True)
    prompt = prompt_of(4, 4 * BS)
    cache = s.pool.allocate(len(prompt))
    assert cache is not None
    cache.set_length(len(prompt))
    s.prefix.store(prompt, cache)
    assert len(s.prefix.match(chain_hashes(tiny.fingerprint, prompt, BS))) == 4
    assert tiny.fingerprint != tiny_other_seed.fingerprint
    assert s.prefix.match(chain_hashes(tiny_other_seed.fingerprint, prompt, BS)) == []


async def test_a_hit_shares_the_cached_blocks_in_place(schedulers) -> None:
    """A hit puts the cached block ids at the head of the new table (no copy, no new blocks for them); while two
    sequences share them they are pinned, and they become evictable again when both are done."""
    warm = schedulers(caching=True, pool_blocks=64)
    prompt = prompt_of(9, 6 * BS + 5)
    expected, _ = await run(warm, prompt)
    cached_ids = [b.id for b in warm.prefix.match(warm.prefix.hashes(prompt))]
    assert len(cached_ids) == 6
    free_before = warm.pool.reclaimable_blocks
    seqs = [warm.submit(f"r{i}", prompt + prompt_of(10 + i, 7), GREEDY) for i in range(2)]
    while any(s.cache is None for s in seqs):  # admitted on the next step
        await asyncio.sleep(0)
    assert [s.cache.table[:6].tolist() for s in seqs] == [cached_ids, cached_ids]
    assert warm.pool.refs[cached_ids].tolist() == [2] * 6 and warm.prefix.pinned >= 6
    need = warm.pool.blocks_for(len(prompt) + 7 + GREEDY.max_tokens) - 6  # each takes only its own blocks
    assert warm.pool.reclaimable_blocks == free_before - 2 * need - 6
    for s in seqs:
        while (await s.outputs.get()).finish_reason is None:
            pass
    assert warm.pool.refs.sum() == 0 and warm.pool.reclaimable_blocks == warm.pool.total_blocks
    assert [s.cached_tokens for s in seqs] == [6 * BS, 6 * BS]


async def test_usage_and_metrics_report_cached_tokens(engine_client) -> None:
    """The second identical chat request reports cached_tokens in usage (and the stream's usage chunk) and /metrics."""
    engine = await engine_client(block_size=BS)
    body = chat("a long enough system prompt to fill some blocks of sixteen tokens " * 3, max_tokens=4, temperature=0)
    first = await (await engine.client.post("/v1/chat/completions", json=body)).json()
    second = await (await engine.client.post("/v1/chat/completions", json=body)).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (second["usage"]["prompt_tokens"] - 1) // BS * BS > 0
    assert second["choices"] == first["choices"]
    stream = await engine.client.post("/v1/chat/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in (await stream.text()).splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    text = await (await engine.client.get("/metrics")).text()
    hits = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M)
    assert hits is not None and float(hits.group(1)) == 2 * cached


async def test_prefix_caching_off_by_config(engine_client) -> None:
    engine = await engine_client(block_size=BS, prefix_caching=False)
    body = chat("the same prompt twice, no cache " * 3, max_tokens=2)
    for _ in range(2):
        usage = (await (await engine.client.post("/v1/chat/completions", json=body)).json())["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert not engine.engine.scheduler.prefix.blocks
