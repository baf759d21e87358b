"""One client request as the PD flow carries it: the parsed request, the body its legs send, and what the router
reads off it once (prompt size, token budget, deadlines).

The API front ends parse a body into the typed request (stack.protocol) and serialise the engine body from it
(api/common.engine_body); both come here. Everything the router needs to know about the request is read from the
typed one, once, when the job is made: the prompt's size (one walk of the messages), max_tokens as parse resolved
it, stream. The body is what the legs send, with only the hand-off's changes (prefill_body, decode_body), as compact
UTF-8 JSON from msgspec's encoder (json_text.encode): an agent's ~33 kB body in ~15 µs, where the stdlib's text
encoder took ~75 (docs/router-performance.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from stack.common import json_text
from stack.protocol.types import Request
from stack.router.deadlines import Budgets

NO_HEADERS: Mapping[str, str] = MappingProxyType({})  # a caller with no client request (benchmarks, tests): no session


def prompt_chars(req: Request, tools_json: bytes | None = None) -> int:
    """The prompt's size in characters: message texts, tool calls and tool definitions (chat), or the prompt.
    `tools_json`: the tools encoded as the legs' bodies carry them; its length stands for the definitions' (their
    JSON framing included, ~60 bytes a tool) instead of a walk of every schema."""
    if req.kind == "completion":
        return len(req.prompt)  # a token-id prompt: its length is its token count
    if tools_json is not None:
        chars = len(tools_json)
    else:
        chars = sum(len(t.name) + len(t.description or "") + (len(json_text.encode(t.parameters)) if t.parameters else 0) for t in req.tools)
    for message in req.messages:
        chars += len(message.content or "") + sum(len(c.name) + len(c.arguments) for c in message.tool_calls)
    return chars


def estimate_prompt_tokens(req: Request, chars: int | None = None) -> int:
    """A cheap prompt-length estimate for load accounting and usage when no engine counts (~4 characters a token,
    plus a chat template's few tokens per message)."""
    chars = prompt_chars(req) if chars is None else chars
    return 1 + chars // 4 + 4 * len(req.messages)


@dataclass
class Job:
    """A client request in the PD flow."""

    request_id: str
    api: str  # the client's API: chat | completions | messages | responses (router.scheduled names it)
    path: str  # the engines' endpoint: /v1/chat/completions or /v1/completions
    req: Request
    body: dict[str, Any]  # the engine body (kv_transfer_params removed: they belong to the router)
    headers: Mapping[str, str]  # the client's (session affinity)
    stream: bool  # stream() or complete() runs it
    prompt_tokens: int  # the load estimate (estimate_prompt_tokens)
    max_tokens: int
    decode_tokens: int  # what the decode slot counts: prompt_tokens + max_tokens
    budgets: Budgets  # this request's leg timeouts and deadline, sized by its prompt (deadlines.py)
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def make(cls, request_id: str, api: str, path: str, req: Request, body: dict[str, Any], headers: Mapping[str, str],
             stream: bool, default_max_tokens: int, budgets_for: Callable[[int], Budgets]) -> Job:
        """`budgets_for(prompt_chars) -> Budgets` (PDClient's, which knows the window and the settings)."""
        chars = prompt_chars(req, json_text.encode(body["tools"]) if "tools" in body else None)
        clean = {k: v for k, v in body.items() if k != "kv_transfer_params"}  # a client must not steer the KV plumbing
        prompt_tokens, max_tokens = estimate_prompt_tokens(req, chars), req.sampling.max_tokens or default_max_tokens
        return cls(request_id, api, path, req, clean, headers, stream, prompt_tokens, max_tokens, prompt_tokens + max_tokens, budgets_for(chars))

    def prefill_body(self, kv_transfer_params: dict[str, Any] | None) -> bytes:
        """One token, not streamed, no stream_options (vLLM's toy proxy). `min_tokens` becomes 1 when the client set
        it: our decode continues from prefill's token, which must not be EOS then (vLLM needs min ≤ max = 1)."""
        body = {k: v for k, v in self.body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
        body.update(stream=False, max_tokens=1)
        if self.req.sampling.min_tokens:
            body["min_tokens"] = 1
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return json_text.encode(body)

    def decode_body(self, kv_transfer_params: dict[str, Any] | None) -> bytes:
        """The client's request; streams always ask for usage (the router counts tokens from it)."""
        body = dict(self.body)
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        else:
            body["stream"] = False
            body.pop("stream_options", None)
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return json_text.encode(body)
