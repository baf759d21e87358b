"""The fuzz tier's target: a real router process over real prefill and decode engines (dummy:tiny), on loopback.

Processes, not in-process apps, so a request that crashes or wedges a service shows as what a client would
see. The engines require the internal key, as in compose. The seed of every run is printed; replay one
with PD_FUZZ_SEED=<seed> ./pd test tests/fuzz.

Seeds: a developer's run draws a fresh one each time (exploration: every new 5xx it finds gets fixed and a
regression case). CI (`CI` set) uses CI_SEED, a seed that has exercised every API, so a landing is judged
on the same 2,400 requests every time instead of on a new draw; PD_FUZZ_SEED overrides both.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from stack.common.health_probe import SERVING, probe
from tests.unit.router_pd.conftest import INTERNAL_KEY, REPO, EngineProcess, free_port, router_settings

KEY = "pd-fuzz-key-" + "f" * 24
MODEL = "your-model-id"
HEADER_TIMEOUT_MS = BODY_TIMEOUT_MS = 2000  # short, so the slow-client tests take seconds
CI_SEED = 2841138939  # found the Responses content-part 500 (a list `type`), fixed with a regression case
SEED = int(os.environ.get("PD_FUZZ_SEED") or (CI_SEED if os.environ.get("CI") else random.SystemRandom().randrange(2**32)))


def pytest_report_header(config: pytest.Config) -> str:
    return f"fuzz seed: {SEED} (replay: PD_FUZZ_SEED={SEED})"


@dataclass
class Target:
    url: str
    session: requests.Session
    router_log: Path

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> requests.Response:
        return self.session.post(self.url + path, data=body, headers=headers, timeout=60)

    def good_request(self) -> requests.Response:
        return self.session.post(self.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                                 json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    print(f"\nfuzz seed: {SEED} (replay: PD_FUZZ_SEED={SEED})")
    tmp = tmp_path_factory.mktemp("fuzz")
    engines = [EngineProcess(role, tmp).start() for role in ("prefill", "decode")]
    router = None
    try:
        asyncio.run(_ready(engines))
        port, health_port = free_port(), free_port()
        settings = router_settings(tmp, "router", engines[0], engines[1], MODEL, server=f"port = {port}\nhealth_port = {health_port}\n"
                                   f"header_timeout_ms = {HEADER_TIMEOUT_MS}\nbody_timeout_ms = {BODY_TIMEOUT_MS}")
        log = tmp / "router.log"
        router = subprocess.Popen([sys.executable, "-m", "stack.router", "--config", str(settings)], cwd=REPO,
                                  env={**os.environ, "PD_TEST_KEY": KEY, "PD_INTERNAL_KEY": INTERNAL_KEY},
                                  stdout=log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60  # upper bound: start on a busy 2-core box
        while probe(f"127.0.0.1:{health_port}", 1.0) != SERVING:
            assert router.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}"
        with requests.Session() as session:
            # One connection per request: the router closes a connection idle for header_timeout_ms (2 s here), and a
            # pooled one reused just as it closes is reset (the keep-alive race every HTTP/1.1 client has; CI met it).
            session.headers["Connection"] = "close"
            yield Target(url, session, log)
        assert router.poll() is None, f"the router died during the fuzz run: {log.read_text()[-3000:]}"
    finally:
        if router is not None and router.poll() is None:
            router.terminate()
            router.wait(15)
        for engine in engines:
            engine.stop()


async def _ready(engines: list[EngineProcess]) -> None:
    await asyncio.gather(*(engine.ready() for engine in engines))
