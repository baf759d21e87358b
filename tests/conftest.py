"""Shared test setup. Area fixtures live in each folder's own conftest.py."""

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

# Ryuk's image cannot be pulled where there is no registry; compose tests clean up themselves.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
# A log call whose fields differ from its event's declaration raises in tests (stack.common.logging's
# STRICT_ENV). Set before anything imports stack; the services tests start as subprocesses inherit it.
os.environ.setdefault("PD_LOG_STRICT", "1")


@pytest.fixture
async def silent_address() -> AsyncIterator[str]:
    """HOST:PORT of a listener that accepts connections and never answers: what a hung service or a
    black-holed network looks like to a client (its probes time out, they are not refused)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.fixture
async def sdk() -> AsyncIterator[Callable[..., Any]]:
    """Official SDK clients closed in the test's own event loop: sdk(openai.AsyncOpenAI, base_url=…, api_key=…).
    (An unclosed httpx client is closed by the garbage collector later, on a loop that is gone.)"""
    clients: list[Any] = []

    def make(cls: Callable[..., Any], **kwargs: Any) -> Any:
        client = cls(max_retries=0, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()
