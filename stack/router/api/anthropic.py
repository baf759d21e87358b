"""Anthropic Messages API (Claude Code): POST /v1/messages (+ /v1/messages/count_tokens), served as one chat completion.

The request becomes a chat request in anthropic_request.py (what is translated, what is accepted and ignored), the
answer an Anthropic message or event stream in anthropic_response.py; this module is the handlers and the context fit.

Clamping (issue 10): Claude Code asks for max_tokens 32000 whatever the model; OpenAI's APIs keep vLLM's 400 for a
request beyond the context, but here max_tokens becomes min(max_tokens, max_model_len - prompt tokens), the prompt
counted by the engine (vLLM's POST /tokenize on the translated chat request, tools included). The count is asked
first when the request might not fit: max_tokens at least a quarter of the context, or twice the request's UTF-8 size
(room for the chat template's own text) + max_tokens beyond it. A smaller request beyond the context gets the
engine's 400. `message_start.usage.input_tokens` is the engine's exact count, from /tokenize asked in parallel with
the prefill leg (the router's estimate only if no engine answers).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from aiohttp import web

from stack.common import json_text
from stack.common.errors import REQUEST_ID
from stack.protocol.fields import Fields
from stack.router.api.anthropic_request import parse_messages_request
from stack.router.api.anthropic_response import EventRelay, anthropic_error_body, message_body
from stack.router.api.common import capabilities, charge, engine_body, json_answer, read_json, relay
from stack.router.api.openai import CHAT_PATH
from stack.router.appkeys import PD
from stack.router.job import estimate_prompt_tokens

__all__ = ["anthropic_error_body", "count_tokens", "messages"]  # what the app wires (anthropic_error_body: its error shape)

_NAMES = {"response_format": "output_config.format", "stop": "stop_sequences"}  # chat field -> the field this API's client sent (refusals name it)


async def _fit_context(request: web.Request, upstream: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
    """Clamp upstream max_tokens to the context left after the prompt (the engine's count): (lowered?, the /tokenize
    answer if one was asked)."""
    window = request.app[PD].monitor.max_model_len
    wanted = upstream.get("max_tokens")
    if not window or not isinstance(wanted, int):
        return False, None
    # The prompt's UTF-8 JSON size, by msgspec's encoder: an agent's 30 kB of messages and tools took json.dumps ~0.2 ms.
    size = len(json_text.compact([upstream["messages"], upstream.get("tools")]))
    if wanted * 4 < window and size * 2 + wanted < window:
        return False, None  # a small answer after a prompt far from the window (the chat template's text included)
    answer = await _tokenize(request, upstream)
    count = (answer or {}).get("count")
    window = (answer or {}).get("max_model_len") or window
    if not isinstance(count, int) or count >= window or count + wanted <= window:
        return False, answer  # unknown, too long for any answer (the engine's 400 says so), or it fits
    upstream["max_tokens"] = window - count
    return True, answer


async def _known(answer: dict[str, Any]) -> dict[str, Any]:
    return answer


async def _tokenize(request: web.Request, upstream: dict[str, Any]) -> dict[str, Any] | None:
    """The engine's /tokenize answer for the chat prompt of `upstream` (vLLM's TokenizeChatRequest), or None."""
    body = {"model": upstream["model"], "messages": upstream["messages"]}
    if upstream.get("tools"):
        body["tools"] = upstream["tools"]
    answer = await request.app[PD].tokenizer_call(request[REQUEST_ID], "/tokenize", body)
    return answer[1] if answer is not None and answer[0] == 200 and isinstance(answer[1], dict) else None


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    body = await read_json(request)
    max_tokens = Fields(body).integer("max_tokens", minimum=1, required=True)
    req = parse_messages_request(body, max_tokens, capabilities(request))
    upstream = engine_body(request, req, "messages", names=_NAMES)
    clamped, counted = await _fit_context(request, upstream)
    if req.sampling.stop:
        upstream["include_stop_str_in_output"] = True  # to tell which stop matched (cut_stop); ignored by engines without it
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    pd = request.app[PD]
    if req.stream:
        # The prompt count for message_start: asked in parallel with the prefill leg, unless the clamp asked already.
        count = asyncio.ensure_future(_tokenize(request, upstream) if counted is None else _known(counted))
        events = EventRelay(message_id, req.model, req.sampling.stop, clamped)
        try:
            stream = await pd.open(request[REQUEST_ID], "messages", CHAT_PATH, req, upstream, request.headers,
                                   text_frame=events.text_frame)  # a token's text delta made from its bytes
            try:  # message_start carries the count: it is needed before the first chunk is relayed
                answer = await count
            except BaseException:
                stream.close()
                raise
        finally:
            count.cancel()
        engine_count = (answer or {}).get("count")
        events.input_tokens = engine_count if isinstance(engine_count, int) else estimate_prompt_tokens(req)
        return await relay(request, stream, events)
    result = await pd.complete(request[REQUEST_ID], "messages", CHAT_PATH, req, upstream, request.headers)
    charge(request, result.get("usage") or {})
    return json_answer(message_body(result, message_id, req.model, req.sampling.stop, clamped))


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the engines' own count (their /tokenize, as the messages request would be
    prompted, tools included), or the router's estimate (~4 characters a token) when no engine can say."""
    req = parse_messages_request(await read_json(request), None, capabilities(request))
    answer = await _tokenize(request, engine_body(request, req, "messages"))
    counted = (answer or {}).get("count")
    return web.json_response({"input_tokens": counted if isinstance(counted, int) else estimate_prompt_tokens(req)})
