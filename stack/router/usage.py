"""Per-key usage (requests, prompt and completion tokens) in an SQLite file that outlives the router.

Totals are loaded into memory at start so quota checks cost nothing; every finished request
updates memory at once and is queued for the file. The queue is written as a group commit: the
first `add()` of an event-loop turn schedules one transaction for the next turn, which writes every
request finished meanwhile (WAL, `synchronous=NORMAL`: no fsync, so a commit survives the process
being killed, not the host losing power). One commit a request cost about a tenth of the router's
CPU per request; under load one commit now carries every request that finished in a turn.

The promise is unchanged: `await durable()` returns once every request added so far is committed,
and the router awaits it before it logs `router.request_done`, so a `kill -9` loses no request
whose `request_done` was logged (tests/chaos: router kill -9). What a kill can lose is only the
requests of the turn it interrupts, none of which has its line yet. A non-streamed answer is sent once
its tokens are charged in memory, before that turn's commit (the front middleware in app.py): it does not wait for
the file, so a kill in that turn can lose the charge of an answer its client already has. A failed write (a full disk)
keeps the requests queued and does not hold up the requests (the totals in memory stay right);
`flush()`, called every `usage.flush_interval_ms` and at shutdown, retries the queue.
Without a running event loop (tools, tests) `add()` commits at once.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS key_usage (
    key_name TEXT PRIMARY KEY,
    requests INTEGER NOT NULL DEFAULT 0,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL
)
"""

# One row per finished request, summed per key by SQLite: a group commit stays one statement.
_UPSERT = """
INSERT INTO key_usage (key_name, requests, prompt_tokens, completion_tokens, updated_at)
VALUES (?, 1, ?, ?, ?)
ON CONFLICT (key_name) DO UPDATE SET
    requests = requests + 1,
    prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    completion_tokens = completion_tokens + excluded.completion_tokens,
    updated_at = excluded.updated_at
"""


@dataclass(frozen=True)
class Usage:
    """One key's totals since the usage file was created."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageStore:
    """Reads all totals at open, then adds each finished request to memory at once and to the file once a turn."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a commit survives kill -9 (not power loss)
        self._db.execute(_SCHEMA)
        rows = self._db.execute("SELECT key_name, requests, prompt_tokens, completion_tokens FROM key_usage")
        self._totals = {name: Usage(requests, prompt, completion) for name, requests, prompt, completion in rows}
        self._pending: list[tuple[str, int, int, float]] = []  # finished requests not yet in the file
        self._commit: asyncio.Future[None] | None = None  # the group commit scheduled for the next loop turn

    def get(self, key_name: str) -> Usage:
        return self._totals.get(key_name, Usage())

    def add(self, key_name: str, prompt_tokens: int, completion_tokens: int) -> Usage:
        """Count one finished request (with whatever tokens it used) for `key_name`; `durable()` says when it is written."""
        old = self.get(key_name)
        new = Usage(old.requests + 1, old.prompt_tokens + prompt_tokens, old.completion_tokens + completion_tokens)
        self._totals[key_name] = new
        self._pending.append((key_name, prompt_tokens, completion_tokens, time.time()))
        if self._commit is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: write now
                self._try_flush()
                return new
            self._commit = loop.create_future()
            loop.call_soon(self._group_commit)
        return new

    async def durable(self) -> None:
        """Wait until every request added so far is committed (or its write failed and waits for the retry)."""
        if self._commit is not None:
            await self._commit

    def _group_commit(self) -> None:
        commit, self._commit = self._commit, None
        self._try_flush()
        if commit is not None and not commit.done():
            commit.set_result(None)

    def _try_flush(self) -> None:
        try:
            self.flush()
        except sqlite3.Error:  # the requests stay queued for the writer's retry, which logs the failure
            pass

    @property
    def pending(self) -> int:
        return len(self._pending)

    def flush(self) -> int:
        """Write the queued requests to the file in one transaction; how many there were."""
        pending, self._pending = self._pending, []
        try:
            if len(pending) == 1:  # one statement is a transaction of its own (autocommit): a third less work
                self._db.execute(_UPSERT, pending[0])
            elif pending:
                with self._db:  # BEGIN … COMMIT; a failure (its commit's too) rolls back
                    self._db.execute("BEGIN")
                    self._db.executemany(_UPSERT, pending)
        except BaseException:  # nothing of it was written: the requests stay queued
            self._pending[:0] = pending
            raise
        return len(pending)

    def close(self) -> None:
        self.flush()
        self._db.close()
