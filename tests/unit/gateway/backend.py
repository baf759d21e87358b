"""A scripted OpenAI-wire backend for the gateway tests: it answers what the test tells it to, as vLLM would.

Each request pops the next `Answer` (text, tool calls, finish_reason, vLLM's `stop_reason`), or answers a plain text.
Streams are vLLM's exact chunk format (vllm/entrypoints/openai/serving_chat.py `chat_completion_stream_generator`:
a first chunk with `delta.role: "assistant"` and `content: ""`; tool calls as `DeltaToolCall`, from
vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py `extract_tool_calls_streaming`: the first delta of a call
carries `index`, `id`, `type: "function"` and `function.name` only, the following ones `index` and
`function.arguments` fragments; the last chunk carries `finish_reason` (and `stop_reason`), then the usage chunk
with `choices: []` when asked, then `[DONE]`). GET /health reports `capabilities` (None: no such field, as vLLM);
/tokenize and /detokenize answer vLLM's shapes. `seen` records every generation body received.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from stack.common import sse

BACKEND_MODEL = "fake/gateway-model"
MAX_MODEL_LEN = 4096


@dataclass
class Answer:
    text: str = "Hello there."
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, JSON arguments)
    finish_reason: str | None = None  # default: tool_calls when there are calls, else stop
    stop_reason: str | int | None = None  # vLLM's: the stop string that matched
    completion_tokens: int = 5
    report_stop_reason: bool = True  # False: an engine that says not which stop matched (only includes it when asked)


@dataclass
class Backend:
    capabilities: list[str] | None = None
    prompt_tokens: int = 36  # what /tokenize and usage say
    script: list[Answer] = field(default_factory=list)
    seen: list[dict[str, Any]] = field(default_factory=list)
    tokenized: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""
    _server: TestServer | None = None

    async def start(self) -> Backend:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._chat)
        self._server = TestServer(app, host="127.0.0.1")
        await self._server.start_server()
        self.url = f"http://127.0.0.1:{self._server.port}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.close()

    async def _health(self, _request: web.Request) -> web.Response:
        body: dict[str, Any] = {"status": "ok", "role": "both", "kv_port": 7001}
        if self.capabilities is not None:
            body["capabilities"] = self.capabilities
        return web.json_response(body)

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": BACKEND_MODEL, "object": "model", "max_model_len": MAX_MODEL_LEN}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized.append(body)
        return web.json_response({"count": self.prompt_tokens, "max_model_len": MAX_MODEL_LEN,
                                  "tokens": list(range(self.prompt_tokens)), "token_strs": None})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": " ".join(f"t{t}" for t in body.get("tokens", []))})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        answer = self.script.pop(0) if self.script else Answer()
        if isinstance(answer.stop_reason, str) and body.get("include_stop_str_in_output"):  # vLLM: the stop stays in the text
            answer = Answer(**{**answer.__dict__, "text": answer.text + answer.stop_reason})
        if not answer.report_stop_reason:
            answer = Answer(**{**answer.__dict__, "stop_reason": None})
        finish = answer.finish_reason or ("tool_calls" if answer.tool_calls else "stop")
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": answer.completion_tokens,
                 "total_tokens": self.prompt_tokens + answer.completion_tokens, "prompt_tokens_details": {"cached_tokens": 4}}
        base = {"id": "chatcmpl-fake", "created": int(time.time()), "model": BACKEND_MODEL}
        calls = [{"id": f"chatcmpl-tool-{i}abc", "type": "function", "function": {"name": name, "arguments": args}}
                 for i, (name, args) in enumerate(answer.tool_calls)]
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": answer.text or None}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": answer.stop_reason}
            return web.json_response({**base, "object": "chat.completion", "choices": [choice], "usage": usage})
        response = await sse.open_stream(request)

        async def send(delta: dict[str, Any], finish_reason: str | None = None) -> None:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            if finish_reason:
                choice["stop_reason"] = answer.stop_reason
            await sse.send_event(response, {**base, "object": "chat.completion.chunk", "choices": [choice]})

        await send({"role": "assistant", "content": ""})
        words = answer.text.split(" ") if answer.text else []
        for i, word in enumerate(words):
            await send({"content": word if i == 0 else f" {word}"})
        for i, (name, args) in enumerate(answer.tool_calls):
            await send({"tool_calls": [{"id": f"chatcmpl-tool-{i}abc", "type": "function", "index": i, "function": {"name": name}}]})
            half = len(args) // 2
            for piece in (args[:half], args[half:]):
                if piece:
                    await send({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
        await send({}, finish)
        if (body.get("stream_options") or {}).get("include_usage"):
            await sse.send_event(response, {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        await sse.send_done(response)
        return response


def dumps(value: Any) -> str:
    return json.dumps(value)
