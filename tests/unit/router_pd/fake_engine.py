"""An in-process engine speaking the PD wire format, with faults on cue.

Real engine processes carry the PD path in these tests; this fake exists only for what a real
engine cannot be made to do at a precise moment (die after the 2nd chunk, stall, answer 500,
end a stream without [DONE]) and to reproduce vLLM NixlConnector's prefill answer, which cannot
run here (no GPU). Its `seen` list records every body it received.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from stack.common.health import HealthServer, start_health_server
from stack.common.sse import frame, send_done

FAKE_KV_PORT = 7001  # what a fake decode reports on GET /health as its KV listener (nothing listens: no KV moves)

# vLLM's real prefill answers, captured from vLLM 0.32.0 (CPU) by the vllm tier's setup (each file's "source" says how;
# tests/vllm/test_pd_nixl.py checks the live keys still match): 14 kv_transfer_params keys, no transfer_id. The router
# must not need one, and must not drop keys it does not know.
FIXTURES = Path(__file__).parent / "fixtures"


def vllm_capture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


VLLM_NIXL_PREFILL_PARAMS = vllm_capture("vllm_nixl_prefill")["answer"]["kv_transfer_params"]

# vLLM 0.32.0's answer to tools with tool_choice "auto" when started without tool calling, as it sent it
# (tests/unit/doctor/bundles/vllm_no_tool_parser/router.log).
VLLM_NO_TOOL_PARSER_BODY = {"error": {"message": '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                                      "type": "BadRequestError", "param": None, "code": 400}}


PROMPT_TOKENS = 3  # what the fake says every prompt is


@dataclass
class Faults:
    """What the fake does wrong, per leg (counts down: `http_500=1` fails only the first request)."""

    http_500: int = 0  # answer HTTP 500 with an OpenAI error body
    http_400: int = 0  # reject the request as invalid (HTTP 400, OpenAI error body)
    drop_before_answer: int = 0  # close the connection without answering
    die_after_chunks: int | None = None  # close the connection after this many token chunks
    stall_after_chunks: int | None = None  # stop sending (connection open) after this many chunks
    no_done: bool = False  # end the stream cleanly but without finish_reason or [DONE]
    error_after_chunks: int | None = None  # send a vLLM-style in-band error frame after this many chunks, then [DONE]
    burst: bool = False  # write the whole stream at once (a fast engine, or a router running behind, reads it so)
    delay_s: float = 0.0  # wait before answering (keeps slots busy)
    kv_push_failed: int = 0  # a prefill leg answers our engine's 502 kv_connect_failed (its push to decode failed)
    decode_kv_capacity: int = 0  # a prefill leg answers our engine's 503 decode_kv_capacity (the decode has no room)
    prefill_delay_s: float = 0.0  # a prefill leg computes this long before answering (a long prompt)
    no_tool_parser: bool = False  # a vLLM without --enable-auto-tool-choice: tools with tool_choice "auto" get its 400


@dataclass
class FakeEngine:
    role: str  # prefill | decode | both
    tokens: int = 4
    nixl: bool = False  # prefill answers like vLLM NixlConnector instead of our engine
    kv_producer: bool = True  # False: a prefill leg is answered without kv_transfer_params (an engine not set up for PD)
    prefill_answer: dict[str, Any] | None = None  # a whole prefill answer to send as it is (a captured vLLM one)
    decode_answer: dict[str, Any] | None = None  # a whole non-streamed decode answer to send as it is
    faults: Faults = field(default_factory=Faults)
    seen: list[dict[str, Any]] = field(default_factory=list)
    peers: list[Any] = field(default_factory=list)  # each request's client address: which connection it came on
    prefill_answers: list[dict[str, Any]] = field(default_factory=list)  # every answer to a prefill leg, as sent
    disconnects: int = 0  # requests whose client (the router) went away before the answer was sent
    max_model_len: int | None = None  # the window /v1/models reports (vLLM's field) and `max_tokens` is checked against
    serving: bool = True  # what both health endpoints say: gRPC health and vLLM-style GET /health
    kv_port: int | None = FAKE_KV_PORT  # reported on GET /health by decodes, as our engine does (None: not reported)
    health_asks: list[float] = field(default_factory=list)  # when GET /health was asked (loop time)
    url: str = ""
    health_addr: str = ""
    _runner: web.AppRunner | None = None
    _health: HealthServer | None = None

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._http_health)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._health = await start_health_server(0, "127.0.0.1")
        await self._health.set_serving()
        self.health_addr = f"127.0.0.1:{self._health.port}"
        return self

    async def stop(self) -> None:
        if self._health is not None:
            await self._health.stop(0)
        if self._runner is not None:
            await self._runner.cleanup()

    async def set_health(self, serving: bool) -> None:
        assert self._health is not None, "start() first"
        self.serving = serving
        await (self._health.set_serving() if serving else self._health.set_not_serving())

    async def _http_health(self, _request: web.Request) -> web.Response:
        self.health_asks.append(asyncio.get_running_loop().time())
        body: dict[str, Any] = {"status": "ok" if self.serving else "starting", "role": self.role}
        if self.role != "prefill" and self.kv_port is not None:
            body["kv_port"] = self.kv_port
        return web.json_response(body, status=200 if self.serving else 503)

    async def _models(self, _request: web.Request) -> web.Response:
        model = {"id": "fake-model", "object": "model", **({"max_model_len": self.max_model_len} if self.max_model_len else {})}
        return web.json_response({"object": "list", "data": [model]})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._answer_request(request)
        except asyncio.CancelledError:  # aiohttp cancels the handler when the caller closes the connection
            self.disconnects += 1
            raise

    async def _answer_request(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append({"headers": dict(request.headers), **body})
        self.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        faults = self.faults
        if faults.delay_s:
            await asyncio.sleep(faults.delay_s)
        if faults.drop_before_answer:
            faults.drop_before_answer -= 1
            assert request.transport is not None, "request without transport"
            request.transport.close()
            await asyncio.sleep(1)
        if self.max_model_len and PROMPT_TOKENS + (body.get("max_tokens") or 0) > self.max_model_len:
            return web.json_response({"error": {
                "message": f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                           f"{PROMPT_TOKENS + body['max_tokens']} tokens ({PROMPT_TOKENS} in the prompt, {body['max_tokens']} for the completion).",
                "type": "invalid_request_error", "param": "max_tokens", "code": "context_length_exceeded"}}, status=400)
        if faults.http_400:
            faults.http_400 -= 1
            return web.json_response({"error": {"message": "'n' > 1 is not supported", "type": "invalid_request_error"}}, status=400)
        if faults.http_500:
            faults.http_500 -= 1
            return web.json_response({"error": {"message": "CUDA out of memory (fake)", "type": "server_error"}}, status=500)
        if faults.no_tool_parser and body.get("tools") and body.get("tool_choice", "auto") == "auto":
            return web.json_response(VLLM_NO_TOOL_PARSER_BODY, status=400)
        params = body.get("kv_transfer_params") or {}
        if faults.kv_push_failed and params.get("do_remote_decode"):
            faults.kv_push_failed -= 1
            message = f"cannot push KV to decode_kv_addr {params.get('decode_kv_addr')}: gaierror: Name or service not known"
            return web.json_response({"error": {"message": message, "type": "upstream_error", "code": "kv_connect_failed"}}, status=502)
        if faults.decode_kv_capacity and params.get("do_remote_decode"):
            faults.decode_kv_capacity -= 1
            message = (f"decode {params.get('decode_kv_addr')} cannot hold this prompt's KV: needs 3 tokens (48 KiB), "
                       "0 tokens free")
            return web.json_response({"error": {"message": message, "type": "overloaded_error", "code": "decode_kv_capacity"}},
                                     status=503)
        if params.get("do_remote_decode"):
            await asyncio.sleep(faults.prefill_delay_s)
            return self._prefill_answer(body, params)
        if not body.get("stream"):
            return web.json_response(self.decode_answer or self._answer(body, "x" * self.tokens, self.tokens))
        return await self._stream(request, body)

    def _prefill_answer(self, body: dict[str, Any], params: dict[str, Any]) -> web.Response:
        answer = self._answer(body, "x", 1)  # kv_transfer_params null unless a KV producer
        if self.prefill_answer is not None:
            answer = json.loads(json.dumps(self.prefill_answer))
        elif self.kv_producer and self.nixl:
            answer["kv_transfer_params"] = dict(VLLM_NIXL_PREFILL_PARAMS)
        elif self.kv_producer:
            answer["kv_transfer_params"] = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": params["transfer_id"],
                                            "num_tokens": PROMPT_TOKENS, "remote_host": "127.0.0.1", "remote_port": 1}
        self.prefill_answers.append(answer)
        return web.json_response(answer)

    def _answer(self, body: dict[str, Any], text: str, tokens: int) -> dict[str, Any]:
        chat = "messages" in body
        choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
        return {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion", "created": 1, "model": "fake-model",
                "choices": [{**choice, "finish_reason": "length"}],
                "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": tokens, "total_tokens": PROMPT_TOKENS + tokens}, "kv_transfer_params": None}

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        faults = self.faults
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": "fake-model"}
        pending: list[bytes] = []  # burst: frames held back and written together

        async def send(data: bytes) -> None:
            if faults.burst:
                pending.append(data)
            else:
                await response.write(data)
                await asyncio.sleep(0.01)

        try:
            for i in range(self.tokens):
                if faults.die_after_chunks is not None and i == faults.die_after_chunks:
                    assert request.transport is not None, "request without transport"
                    request.transport.close()
                    return response
                if faults.stall_after_chunks is not None and i == faults.stall_after_chunks:
                    await asyncio.sleep(3600)
                if faults.error_after_chunks is not None and i == faults.error_after_chunks:
                    await send(frame({"error": {"message": "decode step failed (fake)", "type": "server_error", "code": 500}}))
                    break
                last = i == self.tokens - 1 and not faults.no_done
                choice = {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": "length" if last else None}
                await send(frame({**base, "choices": [choice]}))
            if faults.no_done:
                await response.write(b"".join(pending))
                await response.write_eof()
                return response
            if (body.get("stream_options") or {}).get("include_usage"):
                await send(frame({**base, "choices": [], "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": self.tokens,
                                                                   "total_tokens": PROMPT_TOKENS + self.tokens}}))
            await response.write(b"".join(pending))
            await send_done(response)
        except ConnectionError:  # a write to a closed connection (a cancelled handler counts in _handle)
            self.disconnects += 1
            raise
        return response


def chunk_text(chunks: list[dict[str, Any]]) -> str:
    return "".join((c["choices"][0].get("delta") or {}).get("content") or c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
