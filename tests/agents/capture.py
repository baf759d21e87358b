"""A loopback stand-in for the Messages API that keeps every request it gets: what Claude Code sends, seen whole.

    with Capture() as capture:          # http://127.0.0.1:<port>, in a thread
        run_claude(binary, "hi", capture.url, "sk-any", workdir)
    capture.requests[0]                 # (method, path, query, headers, raw body)

Each POST /v1/messages gets a short streamed answer in Anthropic's event order (or the same as one JSON message), so
the CLI finishes its turn; anything else is a 404.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.unit.router_front.conftest import free_port


@dataclass
class Captured:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    raw: bytes


def _event(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()


@dataclass
class Capture:
    port: int = field(default_factory=free_port)
    requests: list[Captured] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.requests.append(Captured(request.method, request.path, dict(request.query), dict(request.headers), raw))
        if request.method != "POST" or request.path != "/v1/messages":
            return web.json_response({"type": "error", "error": {"type": "not_found_error", "message": "captured"}}, status=404)
        body = json.loads(raw)
        message = {"id": "msg_capture", "type": "message", "role": "assistant", "model": body.get("model"), "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
        if not body.get("stream"):
            return web.json_response({**message, "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in ({"type": "message_start", "message": message},
                      {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                      {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ok"}},
                      {"type": "content_block_stop", "index": 0},
                      {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": 1}},
                      {"type": "message_stop"}):
            await response.write(_event(event))
        await response.write_eof()
        return response

    def __enter__(self) -> Capture:
        started = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def serve() -> None:
            app = web.Application(client_max_size=64 << 20)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            started.set()

        self._thread = threading.Thread(target=lambda: (self._loop.run_until_complete(serve()), self._loop.run_forever()), daemon=True)
        self._thread.start()
        assert started.wait(10), "the capture server did not start"
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
