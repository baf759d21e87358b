"""The whole router (create_app: auth, limits, usage, APIs) over real prefill + decode engines, with the official SDKs:
the client sees one ordinary endpoint, and the output equals the colocated control."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import openai

from stack.router import config as router_config
from stack.router.app import create_app
from tests.unit.router_pd.conftest import INTERNAL_KEY, router_settings

KEY = "pd-test-key-0123456789abcdefghij"
MODEL = "public-model"
PROMPT = [{"role": "user", "content": "Tell me about disaggregated serving."}]


async def start_router(aiohttp_client: Any, path: Path) -> Any:
    app = create_app(router_config.load(path, env={}), env={"PD_TEST_KEY": KEY, "PD_INTERNAL_KEY": INTERNAL_KEY})
    return await aiohttp_client(app)


async def test_sdks_over_pd_match_colocated(engines, aiohttp_client, tmp_path, logs, sdk):
    """openai (streamed and not) and anthropic (streamed) through the PD router give the colocated router's answers."""
    prefill, decode, both = await engines("prefill", "decode", "both")
    pd_router = await start_router(aiohttp_client, router_settings(tmp_path, "pd", prefill, decode, MODEL))
    co_router = await start_router(aiohttp_client, router_settings(tmp_path, "co", both, both, MODEL))
    answers: dict[str, tuple[str, str, str]] = {}
    for name, router in (("pd", pd_router), ("co", co_router)):
        oai = sdk(openai.AsyncOpenAI, base_url=str(router.make_url("/v1")), api_key=KEY)
        full = await oai.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=10, temperature=0)
        stream = await oai.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=10, temperature=0, stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
        claude = sdk(anthropic.AsyncAnthropic, base_url=str(router.make_url("")), api_key=KEY)
        # This SDK version has no `temperature` argument; the Messages API does.
        events = await claude.messages.create(model=MODEL, messages=PROMPT, max_tokens=10, stream=True, extra_body={"temperature": 0})
        claude_text = "".join([e.delta.text async for e in events if e.type == "content_block_delta"])
        answers[name] = (full.choices[0].message.content or "", streamed, claude_text)
        assert full.model == MODEL and full.usage.completion_tokens == 10
    assert answers["pd"] == answers["co"] and answers["pd"][0] == answers["pd"][1] and answers["pd"][0]
    health = await (await pd_router.get("/health")).json()
    assert health["mode"] == "disaggregated" and {b["role"] for b in health["backends"]} == {"prefill", "decode"}
    metrics = await (await pd_router.get("/metrics")).text()
    assert "pd_router_prefill_seconds_count 3" in metrics
