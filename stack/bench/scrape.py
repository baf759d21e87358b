"""What the router's /metrics says about one run: prefix-cache hits, routing decisions, and `doctor advise`'s verdict.

Scraped just before and just after the run; the difference is the run's. The verdict is the doctor's own
(doctor/advise.py: prefill and decode pressure against the SLOs, more prefill / more decode / balanced), computed on
the same two scrapes a `doctor advise --window` over the run would take, so the report can set it next to the arm
that actually measured best at that load.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from doctor import advise

# The router's counters of where prompts went and what the engines' prefix caches served (stack/router/metrics.py).
ROUTER_COUNTERS = ("pd_router_prompt_tokens_total", "pd_router_cached_prompt_tokens_total", "pd_router_affinity_decisions_total")


async def router_metrics(base_url: str) -> tuple[float, str]:
    """(when, the /metrics body); an empty body if the router does not answer."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(f"{base_url}/metrics") as response:
                text = await response.text() if response.status == 200 else ""
    except (aiohttp.ClientError, asyncio.TimeoutError):
        text = ""
    return time.monotonic(), text


def parse_counters(text: str) -> dict[str, float]:
    series = {}
    for line in text.splitlines():
        if line.startswith(ROUTER_COUNTERS):
            name, _, value = line.rpartition(" ")
            series[name] = float(value)
    return series


def cache_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What one run added: prompt and cached tokens (hit rate) and the routing decisions, summed over backends."""
    added = {k: v - before.get(k, 0.0) for k, v in after.items()}
    prompt = sum(v for k, v in added.items() if k.startswith(ROUTER_COUNTERS[0]))
    cached = sum(v for k, v in added.items() if k.startswith(ROUTER_COUNTERS[1]))
    decisions: dict[str, float] = {}
    for key, value in added.items():
        if key.startswith(ROUTER_COUNTERS[2]) and value:
            decision = key.split('decision="', 1)[1].split('"', 1)[0]
            decisions[decision] = decisions.get(decision, 0.0) + value
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None,
            "affinity_decisions": decisions}


def advise_verdict(before: tuple[float, str], after: tuple[float, str], slos_ms: dict[str, float]) -> dict[str, Any] | None:
    """doctor advise over the run's window, against the run's TTFT / TPOT SLOs (the router's own where not given);
    None when either scrape is missing."""
    if not before[1] or not after[1]:
        return None
    window = advise.window([advise.Scrape.parse(before[1], before[0]), advise.Scrape.parse(after[1], after[0])])
    ttft, tpot = (slos_ms[k] / 1000 if k in slos_ms else None for k in ("ttft", "tpot"))
    advice = advise.advise(window, ttft, tpot)
    return {"verdict": advice.verdict, "prefill_pressure": advice.prefill_pressure,
            "decode_pressure": advice.decode_pressure, "suggested": advice.suggested}
