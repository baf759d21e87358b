"""What counting the prompt (engine /tokenize, in parallel with the prefill leg) adds to /v1/messages' first token.

Starts a real engine (dummy:tiny by default, role both) and the real router process on loopback, then alternates N streamed
requests with the same prompt on /v1/chat/completions (no count) and /v1/messages (message_start waits for the
count), timing the first text delta of each; also times /tokenize alone. Not a timed test: run by hand.

    python -m benchmarks.messages_ttft [--requests 30] [--words 60] [--checkpoint dummy:tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from tests.unit.gateway.test_agents import KEY, MODEL, EngineProcess, RouterProcess


async def _first_delta(session: aiohttp.ClientSession, url: str, body: dict, marker: bytes) -> float:
    started = time.perf_counter()
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if marker in line:
                elapsed = time.perf_counter() - started
                await response.read()
                return elapsed
    raise AssertionError("no text delta")


async def run(router: RouterProcess, requests: int, words: int) -> None:
    prompt = " ".join(["word"] * words)
    chat = {"model": MODEL, "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": prompt}]}
    messages = {**chat}
    times: dict[str, list[float]] = {"chat": [], "messages": [], "tokenize": []}
    async with aiohttp.ClientSession() as session:
        for i in range(requests + 3):  # 3 warm-up rounds
            c = await _first_delta(session, f"{router.url}/v1/chat/completions", chat, b'"content"')
            m = await _first_delta(session, f"{router.url}/v1/messages", messages, b"text_delta")
            t0 = time.perf_counter()
            async with session.post(f"{router.url}/tokenize", json={"model": MODEL, "messages": chat["messages"]},
                                    headers={"Authorization": f"Bearer {KEY}"}) as response:
                await response.read()
            t = time.perf_counter() - t0
            if i >= 3:
                times["chat"].append(c), times["messages"].append(m), times["tokenize"].append(t)
    for name, values in times.items():
        print(f"{name:9s} p50 {statistics.median(values) * 1000:7.2f} ms   mean {statistics.mean(values) * 1000:7.2f} ms")
    print(f"messages - chat (p50): {(statistics.median(times['messages']) - statistics.median(times['chat'])) * 1000:+.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--words", type=int, default=60)
    parser.add_argument("--checkpoint", default="dummy:tiny")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = EngineProcess(Path(tmp), args.checkpoint)
        (Path(tmp) / "router").mkdir()
        router = RouterProcess(Path(tmp) / "router", engine)
        try:
            asyncio.run(run(router, args.requests, args.words))
        finally:
            router.stop()
            engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
