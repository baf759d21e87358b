"""vLLM's tokenizer endpoints through the router, and one model's card: POST /tokenize, POST /detokenize, GET /v1/models/{id}.

/tokenize and /detokenize take and answer vLLM's shapes (vllm/entrypoints/openai/protocol.py: `TokenizeCompletionRequest`
{prompt, add_special_tokens, return_token_strs} or `TokenizeChatRequest` {messages, add_generation_prompt, tools, …} →
`TokenizeResponse` {count, max_model_len, tokens, token_strs}; `DetokenizeRequest` {tokens} → `DetokenizeResponse`
{prompt}); `vllm bench serve` asks /tokenize first. They are authenticated like /v1 (the unified key) unless [server]
public_tokenizer is set (vLLM's own server leaves them open; the bench's alignment step sends no key), take no slot and
are forwarded to a usable decode engine with the backend model's name; the engine's answer (an error included)
comes back as it is.
"""

from __future__ import annotations

import time

from aiohttp import web

from stack.common.errors import REQUEST_ID, NotFound, Overloaded
from stack.router.api.common import read_json, resolve_model
from stack.router.appkeys import CALLER, CONFIG, KEYRING, PD


async def _forward(request: web.Request, path: str) -> web.Response:
    if not request.app[CONFIG].server.public_tokenizer:
        request[CALLER] = request.app[KEYRING].authenticate(request.headers)  # outside /v1: the front middleware does not
    body = await read_json(request)
    model = body.get("model")
    body["model"] = resolve_model(request, model) if isinstance(model, str) else request.app[PD].backend_model
    answer = await request.app[PD].tokenizer_call(request[REQUEST_ID], path, body)
    if answer is None:
        raise Overloaded(f"No decode engine answered {path}; retry shortly.", code="no_backend_available")
    return web.json_response(answer[1], status=answer[0])


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize (vLLM's)."""
    return await _forward(request, "/tokenize")


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize (vLLM's)."""
    return await _forward(request, "/detokenize")


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: the served model's card (the one GET /v1/models lists), or 404 model_not_found."""
    model_id = request.match_info["model"]
    public = request.app[CONFIG].taotoken.model_id
    if model_id != public:
        raise NotFound(f"The model '{model_id}' does not exist on this router; it serves '{public}' (see GET /v1/models).",
                       param="model", code="model_not_found")
    created = int(time.time())
    return web.json_response({"id": public, "object": "model", "created": created, "owned_by": "pd-deploy",
                              "root": request.app[PD].backend_model, "type": "model", "display_name": public,
                              "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))})
