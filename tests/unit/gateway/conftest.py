"""Gateway fixtures: the router app on a loopback port over scripted backends (backend.py), with the official SDKs.

`gateway(capabilities=..., settings="...")` starts a colocated router over one scripted backend: `capabilities`
is what the backend reports on GET /health (None: nothing, as vLLM), `settings` the `[decode]`/`[prefill]`
`capabilities` line (e.g. 'capabilities = "vllm"'). `gateway.pd(...)` starts a disaggregated one over two.
"""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from stack.common.logging import setup_logging
from stack.router import config as router_config
from stack.router.app import create_app
from tests.unit.gateway.backend import Backend

KEY = "pd-gateway-test-key-9f8e7d"
KEY_ENV = "TAOTOKEN_API_KEY"
MODEL = "your-model-id"
ALL_FLAGS = ["tools", "forced_tool_choice", "multiple_choices", "logprobs", "structured_outputs", "logit_bias", "penalties",
             "top_k", "min_p", "min_tokens", "stop_token_ids"]


def settings_text(tmp_path: Path, prefill: str, decode: str, prefill_caps: str = "", decode_caps: str = "") -> str:
    return f"""
[server]
host = "127.0.0.1"
port = 0
[taotoken]
api_key_env = "{KEY_ENV}"
model_id = "{MODEL}"
model_aliases = ["claude-*"]
[prefill]
endpoint = "{prefill}"
{prefill_caps}
[decode]
endpoint = "{decode}"
{decode_caps}
[scheduler]
health_interval_ms = 0
[usage]
db_path = "{tmp_path / 'usage.sqlite3'}"
"""


@dataclass
class Gateway:
    router: TestClient
    backend: Backend
    oai: openai.AsyncOpenAI
    claude: anthropic.AsyncAnthropic
    prefill: Backend | None = None

    @property
    def body(self) -> dict[str, Any]:
        """The last generation body the (decode) backend received."""
        return self.backend.seen[-1]


@pytest.fixture
def logs() -> io.StringIO:
    sink = io.StringIO()
    setup_logging("router", level="DEBUG", sink=sink)
    return sink


def log_events(sink: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in sink.getvalue().splitlines() if line.strip()]


@pytest.fixture
async def gateway(tmp_path: Path, sdk: Any) -> AsyncIterator[Any]:
    started: list[Any] = []

    async def start(capabilities: list[str] | None = None, settings: str = "", prefill_capabilities: list[str] | None = None,
                    prefill_settings: str = "", pd: bool = False) -> Gateway:
        backend = await Backend(capabilities).start()
        started.append(backend)
        prefill = None
        if pd:
            prefill = await Backend(prefill_capabilities).start()
            started.append(prefill)
        path = tmp_path / f"settings{len(started)}.toml"
        path.write_text(settings_text(tmp_path, (prefill or backend).url, backend.url, prefill_settings if pd else settings, settings))
        app = create_app(router_config.load(path, env={}), env={KEY_ENV: KEY})
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        started.append(client)
        return Gateway(client, backend,
                       sdk(openai.AsyncOpenAI, base_url=str(client.make_url("/v1")), api_key=KEY),
                       sdk(anthropic.AsyncAnthropic, base_url=str(client.make_url("")), auth_token=KEY), prefill)

    yield start
    for item in reversed(started):
        await (item.close() if isinstance(item, TestClient) else item.stop())
