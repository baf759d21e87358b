"""`doctor advise` recommends more prefill under a prefill-bound load and more decode under a decode-bound one: real
prefill and decode engines, a real router process, real concurrent streams, and the CLI as a user runs it. Plus the
pure rule over hand-made windows."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import pytest

from doctor import advise
from doctor.advise import Scrape, Window
from tests.unit.router_front.conftest import ServiceProcess
from tests.unit.router_pd.conftest import INTERNAL_KEY, REPO, EngineProcess, free_port, router_settings

MODEL = "your-model-id"
KEY = "advise-test-key-" + "b" * 24
LONG_PROMPT = "Summarise the following notes. " + "The quick brown fox jumps over the lazy dog. " * 20  # ~300 tokens (dummy:tiny holds 512)


def window(**overrides) -> Window:
    base = dict(seconds=30.0, requests=40, ttft_s=0.5, prefill_s=0.2, handoff_s=0.05, tpot_s=0.02, queue_depth=0.0,
                pools={"decode": 1, "prefill": 1}, in_flight={"decode": 2.0, "prefill": 1.0}, slo_ttft_s=1.0, slo_tpot_s=0.05)
    return Window(**{**base, **overrides})


def test_the_rule_names_the_pool_that_misses_its_slo() -> None:
    """Prefill leg over the TTFT SLO (and well above decode's pressure) → more prefill, sized by the pressure; TPOT over
    its SLO → more decode; both within → balanced; both over and close → both; no requests → no_traffic."""
    prefill_bound = advise.advise(window(prefill_s=2.6))
    assert (prefill_bound.verdict, prefill_bound.suggested) == ("more_prefill", {"prefill": 2})  # at most doubling per step
    assert prefill_bound.prefill_pressure == pytest.approx(2.6) and prefill_bound.decode_pressure == pytest.approx(0.4)
    assert advise.advise(window(tpot_s=0.12, pools={"decode": 2, "prefill": 1})).suggested == {"decode": 4}
    assert advise.advise(window(tpot_s=0.06, pools={"decode": 4, "prefill": 1})).suggested == {"decode": 5}  # ceil(4 × 1.2)
    assert advise.advise(window()).verdict == "balanced"
    assert advise.advise(window(prefill_s=1.5, tpot_s=0.06)).verdict == "both"
    assert advise.advise(window(prefill_s=None, tpot_s=None, handoff_s=None, requests=0)).verdict == "no_traffic"
    assert advise.advise(window(prefill_s=0.9), ttft_slo_s=0.3).verdict == "more_prefill"  # a given SLO wins over the router's
    waiting_for_decode = advise.advise(window(handoff_s=2.0))  # decode's batch is full: new requests wait for a place
    assert (waiting_for_decode.verdict, waiting_for_decode.decode_pressure) == ("more_decode", pytest.approx(2.0))


def test_a_ttft_that_misses_its_slo_is_never_balanced() -> None:
    """PD: each leg fits the TTFT budget alone but TTFT does not (the legs add up, the pools are idle) → pd_overhead,
    no replicas suggested, a warning whose fix names the hand-off and the colocated stack. Colocated (no prefill leg):
    a TTFT over its SLO is the one engine's pressure → more decode."""
    adds_up = advise.advise(window(ttft_s=1.4, prefill_s=0.5, handoff_s=0.8, in_flight={"decode": 0.3, "prefill": 0.2}))
    assert (adds_up.verdict, adds_up.suggested) == ("pd_overhead", {})
    [found] = advise.findings(adds_up, window(ttft_s=1.4, prefill_s=0.5, handoff_s=0.8))
    assert found.severity == "warning" and "800 ms" in found.fix and "./pd colocated" in found.fix
    assert advise.advise(window(ttft_s=0.9, prefill_s=0.5, handoff_s=0.3)).verdict == "balanced"  # TTFT within: balanced
    colocated = advise.advise(window(ttft_s=1.6, prefill_s=None, handoff_s=None, pools={"decode": 1}))
    assert (colocated.verdict, colocated.suggested) == ("more_decode", {"decode": 2})


def test_window_reads_histogram_deltas_and_gauges_from_the_router_exposition() -> None:
    """Means are (sum, count) differences between the first and last scrape; pools and in-flight come from the gauges."""
    def body(prefill_sum: float, count: int, in_flight: int) -> str:
        return ("# TYPE pd_router_prefill_seconds histogram\n"
                f'pd_router_prefill_seconds_bucket{{le="+Inf"}} {count}\npd_router_prefill_seconds_sum {prefill_sum}\n'
                f"pd_router_prefill_seconds_count {count}\n"
                "# TYPE pd_router_ttft_seconds histogram\n"
                f'pd_router_ttft_seconds_bucket{{le="+Inf",mode="disaggregated"}} {count}\n'
                f'pd_router_ttft_seconds_sum{{mode="disaggregated"}} {prefill_sum * 2}\npd_router_ttft_seconds_count{{mode="disaggregated"}} {count}\n'
                "# TYPE pd_router_backend_up gauge\n"
                'pd_router_backend_up{backend="http://p:8000",role="prefill"} 1\npd_router_backend_up{backend="http://d:8000",role="decode"} 1\n'
                'pd_router_backend_up{backend="http://d2:8000",role="decode"} 1\n'
                "# TYPE pd_router_backend_in_flight gauge\n"
                f'pd_router_backend_in_flight{{backend="http://d:8000",role="decode"}} {in_flight}\n'
                "# TYPE pd_router_slo_ttft_seconds gauge\npd_router_slo_ttft_seconds 1.5\n")
    seen = advise.window([Scrape.parse(body(10.0, 5, 2), 100.0), Scrape.parse(body(40.0, 15, 6), 130.0)])
    assert (seen.seconds, seen.requests, seen.prefill_s, seen.ttft_s) == (30.0, 10, 3.0, 6.0)
    assert seen.pools == {"decode": 2, "prefill": 1} and seen.in_flight["decode"] == pytest.approx(2.0)  # (2 + 6) / 2 scrapes / 2 decodes
    assert (seen.slo_ttft_s, seen.tpot_s) == (1.5, None)


class Router(ServiceProcess):
    def __init__(self, tmp_path: Path, prefill, decode) -> None:
        self.port, self.health_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = router_settings(tmp_path, "router", prefill, decode, MODEL, server=f"port = {self.port}\nhealth_port = {self.health_port}")
        settings.write_text(settings.read_text().replace('api_key_env = "PD_TEST_KEY"', 'api_key_env = "ADVISE_KEY"')
                            .replace("[prefill]", "[prefill]\nmax_concurrent = 64").replace("[decode]", "[decode]\nmax_concurrent = 64"))
        super().__init__("router", ["stack.router", "--config", str(settings)], tmp_path / "router.log", f"127.0.0.1:{self.health_port}",
                         env={**os.environ, "ADVISE_KEY": KEY, "PD_INTERNAL_KEY": INTERNAL_KEY})


async def stream(http: aiohttp.ClientSession, url: str, content: str, max_tokens: int) -> None:
    """One stream whose prompt starts with a fresh nonce: the engines' prefix cache can never serve it, so every
    request costs its whole prefill (a load of distinct prompts, which is what makes a pool prefill-bound)."""
    content = f"{uuid.uuid4().hex} {content}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status == 200, await response.text()
        async for _ in response.content:
            pass


async def load(url: str, content: str, max_tokens: int, concurrency: int, stop: asyncio.Event) -> int:
    """Closed-loop load: `concurrency` clients, each sending its next stream as soon as the last ends, until `stop`."""
    done = 0

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal done
        while not stop.is_set():
            await stream(http, url, content, max_tokens)
            done += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return done


async def advise_under(router: Router, content: str, max_tokens: int, concurrency: int, *slo: str) -> dict:
    """Run `python -m doctor advise --json` while the load runs (after a warm-up, so the window sees a steady state)."""
    stop = asyncio.Event()
    running = asyncio.create_task(load(router.url, content, max_tokens, concurrency, stop))
    await asyncio.sleep(3)
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "doctor", "advise", "--router-url", router.url, "--window", "10",
                                                   "--interval", "1", "--json", *slo, cwd=REPO, stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    stop.set()
    assert await asyncio.wait_for(running, 120) > 0
    assert process.returncode == 0, out
    return json.loads(out)


async def start_engines(tmp_path: Path) -> list[EngineProcess]:
    """Real prefill and decode engines (dummy:tiny). Decode holds 2 sequences at once (max_num_seqs): the batch limit a
    GPU's KV memory sets, at a size the loads below can fill on a CPU."""
    engines = [EngineProcess(role, tmp_path) for role in ("prefill", "decode")]
    decode_config = json.loads(engines[1].config_path.read_text())
    engines[1].config_path.write_text(json.dumps({**decode_config, "max_num_seqs": 2}))
    for engine in engines:
        engine.start()
    await asyncio.gather(*(engine.ready() for engine in engines))
    return engines


async def test_advise_says_prefill_bound_then_decode_bound_under_real_loads(tmp_path) -> None:
    """Long prompts with 2-token answers, 32 at once, queue at prefill → advise.more_prefill; short prompts with
    100-token answers, 32 at once, fill decode's batch and wait for a place → advise.more_decode. The TTFT SLO is twice
    this machine's own unloaded prefill leg of the long prompt, measured first, so the verdicts hold on a slow or busy
    box; the TPOT SLO is the router's default (200 ms), far above this tiny model's steps and the machine's jitter."""
    prefill, decode = await start_engines(tmp_path)
    # One core each, as separate machines would have (compose: PREFILL_CPUS / DECODE_CPUS): on a shared core a
    # saturated prefill slows decode's steps too, and the load would not be bound on one side only.
    cores = sorted(os.sched_getaffinity(0))
    pin(prefill.proc.pid, cores[0])
    pin(decode.proc.pid, cores[-1])
    router = None
    try:
        router = Router(tmp_path, prefill, decode)
        async with aiohttp.ClientSession() as http:
            await stream(http, router.url, LONG_PROMPT, 16)  # warm-up: the first request pays one-time costs
            before = await scrape(router)
            for _ in range(2):
                await stream(http, router.url, LONG_PROMPT, 16)
            alone = advise.window([before, await scrape(router)])
        slo = ["--ttft-slo-ms", f"{alone.prefill_s * 2000:.0f}"]
        # 2-token answers, so decode's 2 places turn over at once, and 32 clients, more prompts than a step's token
        # budget takes: the load queues at prefill however fast this machine prefills. (With 16-token answers and 10
        # clients, a fast prefill batched them all, and they waited for decode's places instead.)
        prefill_bound = await advise_under(router, LONG_PROMPT, 2, 32, *slo)
        # 100 tokens, not more: the last of 32 waits 15 batches of answers at decode, inside the router's 30 s to a stream's
        # start even on a loaded box (dummy:tiny's decode step reads its 16k-row output matrix)
        decode_bound = await advise_under(router, "hi", 100, 32, *slo)
    finally:
        if router is not None:
            router.stop()
        for engine in (prefill, decode):
            engine.stop()
    assert [f["id"] for f in prefill_bound["findings"]] == ["advise.more_prefill"], prefill_bound["findings"][0]["cause"]
    assert prefill_bound["findings"][0]["fix"].startswith("./pd scale prefill=2 decode=1")
    assert [f["id"] for f in decode_bound["findings"]] == ["advise.more_decode"], decode_bound["findings"][0]["cause"]
    assert decode_bound["findings"][0]["fix"].startswith("./pd scale prefill=1 decode=2")
    assert "in flight per replica: decode" in decode_bound["findings"][0]["cause"]  # the numbers behind it are shown


def pin(pid: int, core: int) -> None:
    """Every thread of process `pid` (numpy's BLAS threads, gRPC's) onto `core`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), {core})


async def scrape(router: Router) -> Scrape:
    async with aiohttp.ClientSession() as http, http.get(f"{router.url}/metrics") as response:
        return Scrape.parse(await response.text(), time.monotonic())
