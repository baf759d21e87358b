"""Continuous batching: step composition under the token budget, chunked prefill, batched = sequential,
and the plain hand-off operations (`prefill` lends a prompt's KV, `submit(kv=…)` continues from it)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import numpy as np
import pytest

from stack.engine.kv_cache import KVPool
from stack.engine.model import Model
from stack.engine.protocol import SamplingParams
from stack.engine.scheduler import Scheduler
from stack.engine.sequence import PromptKV, Sequence

from .conftest import chat, wait_until


def scheduler(model: Model, budget: int, chunked: bool, pool_blocks: int = 10_000) -> Scheduler:
    pool = KVPool(model.config, pool_blocks * 16 * model.config.kv_bytes_per_token, 16)
    return Scheduler(model, pool, max_num_batched_tokens=budget, max_num_seqs=8, chunked_prefill=chunked)


@pytest.fixture
def running(tiny: Model, run_schedulers: Callable[[Scheduler], Scheduler]) -> Callable[..., Scheduler]:
    """`running(budget=…, chunked=…, pool_blocks=…)`: a scheduler with its step loop started, stopped after the test."""

    def start(budget: int = 64, chunked: bool = False, pool_blocks: int = 10_000) -> Scheduler:
        return run_schedulers(scheduler(tiny, budget, chunked, pool_blocks))

    return start


async def completion(seq: Sequence) -> tuple[str, str | None, int]:
    """All of a sequence's text, its finish_reason and its token count."""
    text = ""
    while True:
        out = await seq.outputs.get()
        text += out.text
        if out.finish_reason is not None:
            return text, out.finish_reason, len(seq.output)


async def test_colocated_step_mixes_decodes_with_a_prefill_chunk_within_the_budget(tiny: Model) -> None:
    """With chunked prefill a step carries every running decode plus a prompt chunk of budget minus decodes."""
    s = scheduler(tiny, budget=32, chunked=True)
    greedy = SamplingParams(max_tokens=50, temperature=0)
    decoding = [s.submit(f"d{i}", [1, 2, 3], greedy) for i in range(3)]
    work = s._schedule()
    s._commit(work, s._execute(work))  # the three short prompts prefill in one step and sample a token
    assert all(len(seq.output) == 1 for seq in decoding)

    s.submit("long", list(range(100)), greedy)
    work = s._schedule()
    sizes = sorted(w.segment.tokens.size for w in work)
    assert sizes == [1, 1, 1, 29]  # 3 decodes + 29 prompt tokens = the 32-token budget


async def test_unchunked_long_prompt_runs_whole_beside_the_decodes(tiny: Model) -> None:
    """Without chunked prefill a prompt over the budget is not split: it runs whole (alone among prefills)."""
    s = scheduler(tiny, budget=32, chunked=False)
    greedy = SamplingParams(max_tokens=50, temperature=0)
    s.submit("a", list(range(100)), greedy)
    s.submit("b", list(range(60)), greedy)
    work = s._schedule()
    assert [w.segment.tokens.size for w in work] == [100]  # b waits for the next step


async def test_chunked_prefill_gives_the_same_tokens(engine_client) -> None:
    """A prompt prefilled in 16-token chunks yields the same greedy completion as in one piece."""
    whole = await engine_client()
    chunked = await engine_client(chunked_prefill=True, max_num_batched_tokens=16)
    body = chat("the quick brown fox jumps over the lazy dog " * 3, max_tokens=12, temperature=0)
    a = await (await whole.client.post("/v1/chat/completions", json=body)).json()
    b = await (await chunked.client.post("/v1/chat/completions", json=body)).json()
    assert chunked.engine.scheduler.steps > whole.engine.scheduler.steps  # it really took more steps
    assert a["choices"] == b["choices"]


async def test_concurrent_requests_are_batched_and_match_sequential_answers(engine_client) -> None:
    """Eight concurrent requests share steps (fewer steps than run alone) and each gets its sequential answer."""
    engine = await engine_client()
    bodies = [chat(f"prompt number {i}", max_tokens=10, temperature=0.8, seed=i) for i in range(8)]
    alone = [await (await engine.client.post("/v1/chat/completions", json=b)).json() for b in bodies]
    steps_alone = engine.engine.scheduler.steps
    together = await asyncio.gather(*(engine.client.post("/v1/chat/completions", json=b) for b in bodies))
    answers = [await r.json() for r in together]

    assert [a["choices"] for a in answers] == [a["choices"] for a in alone]
    assert engine.engine.scheduler.steps - steps_alone < steps_alone  # batched: far fewer than 8 x 10 steps


async def test_http_stays_responsive_while_a_step_runs(engine_client, monkeypatch) -> None:
    """The forward runs in a worker thread: while a step is stuck there, other HTTP requests are still answered."""
    engine = await engine_client()
    scheduler = engine.engine.scheduler
    entered, release = threading.Event(), threading.Event()
    execute = scheduler._execute

    def slow(work):
        entered.set()
        release.wait(10)  # 10 s: a hang guard only
        return execute(work)

    monkeypatch.setattr(scheduler, "_execute", slow)
    pending = asyncio.ensure_future(engine.client.post("/v1/chat/completions", json=chat(max_tokens=2)))
    await asyncio.to_thread(entered.wait, 10)
    models = await engine.client.get("/v1/models")  # answered while the step thread is blocked
    assert models.status == 200 and not pending.done()
    release.set()
    assert (await pending).status == 200


PROMPT = list(range(40, 77))  # 37 tokens: spans chunks of 16
SAMPLINGS = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)]


@pytest.mark.parametrize("params", SAMPLINGS, ids=["greedy", "seeded"])
async def test_decoding_from_plain_kv_arrays_matches_a_colocated_run(running, params: SamplingParams) -> None:
    """prefill → copied numpy arrays + first token → submit(kv=…) on another scheduler gives the colocated tokens."""
    colocated, prefill, decode = running(), running(budget=16, chunked=True), running()
    expected = await completion(colocated.submit("colo", PROMPT, params))

    prefilled = await prefill.prefill("p", PROMPT, params)
    assert prefilled.kv is not None and prefilled.output.num_tokens == 1
    kv = PromptKV(np.array(prefilled.kv.k), np.array(prefilled.kv.v), prefilled.kv.first_token, prefilled.kv.seed)  # plain arrays
    prefilled.release()
    seq = decode.submit("d", PROMPT, params, kv)
    got = await completion(seq)

    assert got == expected and seq.output[0] == kv.first_token
    assert seq.kv_read.done()
    for s in (prefill, decode):
        assert s.pool.reclaimable_blocks == s.pool.total_blocks
    assert decode.steps == expected[2] - 1  # decode never ran the prompt: one step per token after the first


async def test_prefill_keeps_its_cache_until_released(running) -> None:
    """A finished prefill holds its pool blocks (the caller still reads the KV views) until release(), once."""
    s = running()
    prefilled = await s.prefill("p", PROMPT, SamplingParams(max_tokens=50, temperature=0))
    assert prefilled.kv is not None and prefilled.kv.k.shape[1] == len(PROMPT)
    assert prefilled.output.finish_reason == "length" and prefilled.output.num_tokens == 1  # max_tokens is taken as 1
    assert s.pool.reclaimable_blocks == s.pool.total_blocks - s.pool.blocks_for(len(PROMPT) + 1)
    prefilled.release()
    prefilled.release()  # idempotent
    assert s.pool.reclaimable_blocks == s.pool.total_blocks


@pytest.mark.parametrize("when", ["while-its-step-runs", "just-after-its-token"])
async def test_cancelling_a_prefill_frees_its_cache(running, monkeypatch, when: str) -> None:
    """A prefill whose caller gives up, mid-step or once its token is out but not yet read, leaves no blocks behind."""
    s = running()
    entered, gate = threading.Event(), threading.Event()
    execute, finish = s._execute, s._finish

    def held(work):
        entered.set()
        gate.wait(10)  # 10 s: a hang guard only
        return execute(work)

    monkeypatch.setattr(s, "_execute", held)
    task = asyncio.ensure_future(s.prefill("p", PROMPT, SamplingParams(max_tokens=1)))
    if when == "just-after-its-token":  # cancel in the same loop turn the output is queued, before the prefill reads it
        monkeypatch.setattr(s, "_finish", lambda seq, reason: (finish(seq, reason), task.cancel()))
    await asyncio.to_thread(entered.wait, 10)
    if when == "while-its-step-runs":
        task.cancel()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task

    await wait_until(lambda: s.pool.reclaimable_blocks == s.pool.total_blocks and not s.running and not s.waiting)


async def test_given_kv_is_read_until_admission_or_cancel(running) -> None:
    """`kv_read` stays pending while the sequence waits for KV blocks and resolves once it is cancelled."""
    s = running(pool_blocks=16)
    cfg = s.model.config
    shape = (cfg.n_layers, 3, cfg.n_kv_heads, cfg.head_dim)
    kv = PromptKV(np.zeros(shape, np.float32), np.zeros(shape, np.float32), first_token=5, seed=0)
    hog = s.pool.allocate(16 * s.pool.block_size)  # the whole pool: the sequence stays queued
    assert hog is not None
    seq = s.submit("queued", [1, 2, 3], SamplingParams(max_tokens=4), kv)
    await wait_until(lambda: seq.queued_logged)  # the step loop tried to admit it and found no room
    assert not seq.kv_read.done() and s.waiting == [seq]

    s.cancel(seq)
    await asyncio.wait_for(seq.kv_read, 5)  # 5 s: a hang guard only
    assert seq.finish_reason == "abort" and seq.start_kv is None
    s.pool.free(hog)
