"""Continuous batching: step composition under the token budget, chunked prefill, batched = sequential."""

from __future__ import annotations

import asyncio
import threading

from stack.engine.kv_cache import KVPool
from stack.engine.model import Model
from stack.engine.protocol import SamplingParams
from stack.engine.scheduler import Scheduler

from .conftest import chat


def scheduler(model: Model, budget: int, chunked: bool) -> Scheduler:
    return Scheduler(model, KVPool(model.config, 10**8, 16), max_num_batched_tokens=budget, max_num_seqs=8, chunked_prefill=chunked)


async def test_colocated_step_mixes_decodes_with_a_prefill_chunk_within_the_budget(tiny: Model) -> None:
    """With chunked prefill a step carries every running decode plus a prompt chunk of budget minus decodes."""
    s = scheduler(tiny, budget=32, chunked=True)
    greedy = SamplingParams(max_tokens=50, temperature=0)
    decoding = [s.new_sequence(f"d{i}", [1, 2, 3], greedy) for i in range(3)]
    work = s._schedule()
    s._commit(work, s._execute(work))  # the three short prompts prefill in one step and sample a token
    assert all(len(seq.output) == 1 for seq in decoding)

    s.new_sequence("long", list(range(100)), greedy)
    work = s._schedule()
    sizes = sorted(w.segment.tokens.size for w in work)
    assert sizes == [1, 1, 1, 29]  # 3 decodes + 29 prompt tokens = the 32-token budget


async def test_unchunked_long_prompt_runs_whole_beside_the_decodes(tiny: Model) -> None:
    """Without chunked prefill a prompt over the budget is not split: it runs whole (alone among prefills)."""
    s = scheduler(tiny, budget=32, chunked=False)
    greedy = SamplingParams(max_tokens=50, temperature=0)
    s.new_sequence("a", list(range(100)), greedy)
    s.new_sequence("b", list(range(60)), greedy)
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
