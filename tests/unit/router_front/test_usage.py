"""Usage per key lives in SQLite: it is reported at /v1/usage and survives a router restart, quota included."""

from __future__ import annotations

import asyncio
import io
import os
import sqlite3
import time
from pathlib import Path

import aiohttp
import pytest

from stack.common.logging import setup_logging
from stack.router.usage import UsageStore
from tests.unit.router_front.conftest import (
    KEY, KEY_ENV, ServiceProcess, auth, chat_body, free_port, log_events, wait_for_events, write_settings,
)


async def test_usage_counts_requests_and_tokens_per_key(router) -> None:
    """GET /v1/usage returns the caller's requests and the prompt/completion tokens the engine reported."""
    first = await (await router.post("/v1/chat/completions", json=chat_body(), headers=auth())).json()
    await (await router.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth())).read()
    usage = await (await router.get("/v1/usage", headers=auth())).json()
    assert usage["key_name"] == "default" and usage["requests"] == 2
    assert usage["prompt_tokens"] == 2 * first["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == 2 * first["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_stream_without_include_usage_is_still_charged(router) -> None:
    """A stream whose client did not ask for usage is charged anyway (the router asks the engine for it)."""
    await (await router.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth())).read()
    usage = await (await router.get("/v1/usage", headers=auth())).json()
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] > 0


async def test_usage_and_quota_survive_a_restart(make_router) -> None:
    """A new router on the same SQLite file keeps each key's totals, so an exhausted quota stays exhausted."""
    first = await make_router(limits="token_quota = 20")
    assert (await first.post("/v1/chat/completions", json=chat_body(), headers=auth())).status == 200
    before = await (await first.get("/v1/usage", headers=auth())).json()
    await first.close()

    second = await make_router(limits="token_quota = 20")
    after = await (await second.get("/v1/usage", headers=auth())).json()
    assert {k: after[k] for k in ("requests", "prompt_tokens", "completion_tokens")} == \
        {k: before[k] for k in ("requests", "prompt_tokens", "completion_tokens")}
    assert (await second.post("/v1/chat/completions", json=chat_body(), headers=auth())).status == 200
    assert (await second.post("/v1/chat/completions", json=chat_body(), headers=auth())).status == 429
    await second.close()

    third = await make_router(limits="token_quota = 20")
    response = await third.post("/v1/chat/completions", json=chat_body(), headers=auth())
    assert response.status == 429 and (await response.json())["error"]["type"] == "insufficient_quota"
    assert (await (await third.get("/v1/usage", headers=auth())).json())["quota_remaining"] == 0


async def test_finished_requests_reach_the_file_within_the_flush_interval(make_router, tmp_path) -> None:
    """Without a restart, another reader of the SQLite file sees every finished request within flush_interval_ms,
    each one whole (the timer may fire between requests, so the file may first hold only some of them)."""
    router = await make_router(usage="flush_interval_ms = 100")
    for _ in range(3):
        assert (await router.post("/v1/chat/completions", json=chat_body(), headers=auth())).status == 200
    reader = sqlite3.connect(tmp_path / "usage.sqlite3")
    deadline = time.monotonic() + 5  # 50 intervals: only a writer that never runs misses it
    seen: list[tuple[int, int]] = []
    while not seen or seen[-1][0] < 3:
        assert time.monotonic() < deadline, f"usage never reached the file (saw {seen})"
        row = reader.execute("SELECT requests, completion_tokens FROM key_usage WHERE key_name = 'default'").fetchone()
        if row is not None and (not seen or row != seen[-1]):
            seen.append(row)
        await asyncio.sleep(0.05)
    assert all(tokens == 4 * requests for requests, tokens in seen)  # whole requests of 4 completion tokens each
    assert seen[-1] == (3, 12) and seen == sorted(seen)  # all three, and the file only ever grew
    reader.close()


@pytest.mark.parametrize("queued", [1, 3])  # one request is written as one statement; more, in one transaction
def test_a_failed_write_keeps_the_requests_for_the_next_one(tmp_path, queued: int) -> None:
    """If the file cannot be written (here: its table vanished), nothing is lost: the next flush writes it all."""
    store = UsageStore(tmp_path / "usage.sqlite3")
    store.add("alice", 10, 5)  # no event loop: written at once
    assert store.pending == 0
    other = sqlite3.connect(tmp_path / "usage.sqlite3")
    other.execute("ALTER TABLE key_usage RENAME TO moved")
    other.commit()
    for _ in range(queued):
        store.add("alice", 1, 1)  # its write fails: it stays queued
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        store.flush()
    assert store.pending == queued and store.get("alice").total_tokens == 15 + 2 * queued  # memory stays right meanwhile
    other.execute("ALTER TABLE moved RENAME TO key_usage")
    other.commit()
    assert store.flush() == queued and store.pending == 0
    store.close()
    assert other.execute("SELECT requests, prompt_tokens, completion_tokens FROM key_usage").fetchall() == [(1 + queued, 10 + queued, 5 + queued)]
    other.close()


async def test_requests_finished_in_one_loop_turn_share_one_commit(tmp_path) -> None:
    """On an event loop, adds are queued and written together in the next turn; durable() waits for that write."""
    store = UsageStore(tmp_path / "usage.sqlite3")
    reader = sqlite3.connect(tmp_path / "usage.sqlite3")
    for tokens in (1, 2, 3):
        store.add("alice", tokens, 0)
    assert reader.execute("SELECT * FROM key_usage").fetchall() == []  # nothing written inside the turn
    assert store.get("alice").prompt_tokens == 6  # but the quota already sees them
    await store.durable()
    assert reader.execute("SELECT requests, prompt_tokens FROM key_usage").fetchall() == [(3, 6)]
    await store.durable()  # nothing queued: returns at once
    reader.close()
    store.close()


class _FileCheckingSink(io.StringIO):
    """A log sink that, whenever a router.request_done line is written, reads how many requests the usage file holds."""

    def __init__(self, db: Path) -> None:
        super().__init__()
        self.db = db
        self.done_vs_file: list[tuple[int, int]] = []  # (request_done lines so far, requests in the file then)

    def write(self, text: str) -> int:
        if '"router.request_done"' in text:
            with sqlite3.connect(self.db) as reader:
                row = reader.execute("SELECT requests FROM key_usage WHERE key_name = 'default'").fetchone()
            self.done_vs_file.append((len(self.done_vs_file) + 1, row[0] if row else 0))
        return super().write(text)


async def test_request_done_is_logged_only_once_the_request_is_in_the_file(make_router, tmp_path) -> None:
    """The kill -9 promise: every router.request_done line is written after its request's usage commit."""
    sink = _FileCheckingSink(tmp_path / "usage.sqlite3")
    setup_logging("router", sink=sink)
    router = await make_router()
    answers = await asyncio.gather(*(router.post("/v1/chat/completions", json=chat_body(stream=i % 2 == 0), headers=auth())
                                     for i in range(8)))
    assert [a.status for a in answers] == [200] * 8
    await wait_for_events(sink, "router.request_done", 8)  # a whole answer leaves before its commit and its line
    assert len(sink.done_vs_file) == 8
    assert all(in_file >= logged for logged, in_file in sink.done_vs_file), sink.done_vs_file


async def test_a_whole_answer_leaves_charged_without_waiting_for_the_usage_file(make_router, logs, monkeypatch) -> None:
    """A non-streamed answer does not wait for the usage file's commit, but its tokens are charged before it leaves:
    with the commit held, the client has its answer, GET /v1/usage counts it and the next request meets the quota it
    used up. Its router.request_done line still waits for the commit (the kill -9 promise)."""
    held: list[UsageStore] = []
    commit = UsageStore._group_commit
    monkeypatch.setattr(UsageStore, "_group_commit", lambda store: held.append(store))
    router = await make_router(limits="token_quota = 1")  # one request of any size uses it up
    # Its own connection: a keep-alive connection takes its next request once this one's handler is done, commit included.
    answer = await asyncio.wait_for(router.post("/v1/chat/completions", json=chat_body(), headers={**auth(), "Connection": "close"}), 10)
    assert answer.status == 200 and held, "the answer came, and the commit it could have waited for is still held"
    used = (await answer.json())["usage"]["total_tokens"]
    usage = await (await router.get("/v1/usage", headers=auth())).json()
    assert (usage["requests"], usage["total_tokens"]) == (1, used)
    refused = await router.post("/v1/chat/completions", json=chat_body(), headers=auth())
    assert refused.status == 429 and (await refused.json())["error"]["type"] == "insufficient_quota"
    assert [e for e in log_events(logs) if e["event"] == "router.request_done"] == []
    commit(held[0])
    [done] = await wait_for_events(logs, "router.request_done", 1)
    assert done["status"] == 200 and done["completion_tokens"] + done["prompt_tokens"] == used


async def test_kill_9_under_load_loses_no_request_whose_done_line_was_logged(real_engine, tmp_path) -> None:
    """A router process killed -9 while 8 clients keep it busy: the usage file holds every request whose
    router.request_done reached the log, and at most the 8 in flight more (committed, line not yet written)."""
    settings = write_settings(tmp_path, real_engine.url, health=real_engine.health_addr)
    port, health_port = free_port(), free_port()
    router = ServiceProcess("router", ["stack.router", "--config", str(settings), "--host", "127.0.0.1", "--port", str(port),
                                       "--health-port", str(health_port)], tmp_path / "router.log", f"127.0.0.1:{health_port}",
                            env={**os.environ, KEY_ENV: KEY})
    log = tmp_path / "router.log"

    def done_lines() -> int:
        return log.read_text().count('"router.request_done"')

    async def client(session: aiohttp.ClientSession) -> None:
        while True:
            try:
                async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat_body(), headers=auth()) as answer:
                    await answer.read()
            except aiohttp.ClientError:
                return  # the router is gone

    try:
        async with aiohttp.ClientSession() as session:
            clients = [asyncio.create_task(client(session)) for _ in range(8)]
            deadline = time.monotonic() + 60  # a slow shared host; only a router that answers nothing misses it
            while done_lines() < 40:
                assert time.monotonic() < deadline, f"only {done_lines()} requests done in 60 s"
                await asyncio.sleep(0.05)
            router.process.kill()
            router.process.wait()
            await asyncio.gather(*clients)
    finally:
        router.stop()
    logged = done_lines()
    with sqlite3.connect(tmp_path / "usage.sqlite3") as reader:
        [(in_file,)] = reader.execute("SELECT requests FROM key_usage WHERE key_name = 'default'").fetchall()
    assert logged <= in_file <= logged + 8, f"{logged} request_done lines, {in_file} requests in the usage file"
