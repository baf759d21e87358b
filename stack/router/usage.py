"""Per-key usage (requests, prompt and completion tokens) in an SQLite file that outlives the router.

Totals are loaded into memory at start so quota checks cost nothing; every finished request
updates memory at once and is queued for the file. Each `add()` writes through at once: one
upsert committed in WAL mode with `synchronous=NORMAL` (no fsync: a commit survives the process
being killed, not the host losing power). The router adds a request when it ends, before it frees
the request's slot and logs `router.request_done`, so a `kill -9` loses no request whose
`request_done` was logged (tests/chaos: router kill -9; cost measured in the README). A failed write
(a full disk) keeps the request queued; `flush()`, called every `usage.flush_interval_ms` and at
shutdown, retries the queue in one transaction.
"""

from __future__ import annotations

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
    """Reads all totals at open, then adds each finished request to memory and to the file."""

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

    def get(self, key_name: str) -> Usage:
        return self._totals.get(key_name, Usage())

    def add(self, key_name: str, prompt_tokens: int, completion_tokens: int) -> Usage:
        """Count one finished request (with whatever tokens it used) for `key_name`."""
        old = self.get(key_name)
        new = Usage(old.requests + 1, old.prompt_tokens + prompt_tokens, old.completion_tokens + completion_tokens)
        self._totals[key_name] = new
        self._pending.append((key_name, prompt_tokens, completion_tokens, time.time()))
        try:
            self.flush()  # write-through; on failure the request stays queued for the writer's retry
        except sqlite3.Error:
            pass
        return new

    @property
    def pending(self) -> int:
        return len(self._pending)

    def flush(self) -> int:
        """Write the queued requests to the file in one transaction; how many there were."""
        pending, self._pending = self._pending, []
        if pending:
            with self._db:  # BEGIN … COMMIT; a failure rolls back and the requests stay queued
                try:
                    self._db.execute("BEGIN")
                    self._db.executemany(_UPSERT, pending)
                except BaseException:
                    self._pending[:0] = pending
                    raise
        return len(pending)

    def close(self) -> None:
        self.flush()
        self._db.close()


if __name__ == "__main__":  # python -m stack.router.usage [DIR]: the write-through cost per request (README)
    import sys
    import tempfile

    folder = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    store, n = UsageStore(Path(folder) / "usage-bench.sqlite3"), 5000
    started = time.perf_counter()
    for i in range(n):
        store.add(f"key{i % 5}", 100, 20)
    print(f"{(time.perf_counter() - started) / n * 1e6:.1f} µs per finished request ({n} write-through commits in {folder})")
    store.close()
