"""What the relay (pd.py `PDClient.stream`) reads and writes: the answered decode leg, its stream's frames checked
(an engine's in-band error frame is the leg's failure) and counted, usage with cached_tokens as the prefill saw
them (handoff.py), and a JSON answer as the chunks a stream would have carried.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from stack.common import events
from stack.common.logging import log_event
from stack.router.backends import Backend
from stack.router.metrics import Metrics
from stack.router.upstream import EngineError, LegFailed, status_failure


@dataclass
class Leg:
    """An answered decode leg: the backend, and the JSON body or the open stream."""

    decode: Backend
    answer: dict[str, Any] | None = None
    response: aiohttp.ClientResponse | None = None
    batches: AsyncIterator[list[tuple[str | None, str]]] | None = None  # the rest of the stream, per network read
    first: dict[str, Any] | None = None  # the first chunk, checked before anything reached the client
    rest: list[str] = field(default_factory=list)  # the other frames that arrived with the first
    prefill_cached: int | None = None  # prompt tokens the prefill found in its prefix cache (what usage reports)


def parse_chunk(decode: Backend, data: str) -> dict[str, Any]:
    """One SSE data frame of decode's stream; an in-band error frame (vLLM's) is the leg's failure."""
    chunk = json.loads(data)
    if not isinstance(chunk, dict):
        raise ValueError("chunk is not a JSON object")
    if "error" in chunk:
        error = chunk["error"]
        code = error.get("code") if isinstance(error, dict) else None  # vLLM: the HTTP status, an int
        status = code if isinstance(code, int) and not isinstance(code, bool) and code >= 400 else 502
        log_event(events.ROUTER_UPSTREAM_ERROR, f"decode {decode.url} sent an in-band error", "WARNING",
                  backend=decode.url, role=decode.role, status=status, body=data[:2000])
        raise status_failure(decode, status, EngineError.parse(data))
    return chunk


def report_cached(usage: Any, cached: int | None) -> None:
    """Usage as the client sees it: cached_tokens from the prefill's view (decode's own count, where it keeps one, is
    every token it loaded from the prefill)."""
    if cached is not None and isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}), "cached_tokens": cached}


def answer_chunks(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """A non-streamed chat or text completion as the stream chunks an engine would have sent for it: one chunk per
    choice with the whole delta and its finish_reason, then the usage chunk (choices [])."""
    chat = answer.get("object") == "chat.completion"
    head = {"id": answer.get("id", ""), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer.get("created", 0), "model": answer.get("model", "")}
    chunks = []
    for choice in answer.get("choices") or []:
        out = {"index": choice.get("index", 0), "logprobs": choice.get("logprobs"), "finish_reason": choice.get("finish_reason")}
        if chat:
            message = choice.get("message") or {}
            delta = {"role": "assistant", "content": message.get("content") or ""}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            out["delta"] = delta
        else:
            out["text"] = choice.get("text") or ""
        chunks.append({**head, "choices": [out]})
    if answer.get("usage"):
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return chunks


class Tally:
    """What a relayed stream has shown so far: token chunks (ITL observed between them), finish, usage."""

    def __init__(self, metrics: Metrics, started: float) -> None:
        self.metrics = metrics
        self.last = started
        self.first = started  # when the first token chunk arrived
        self.tokens = 0
        self.finished = False
        self.usage: dict[str, Any] | None = None

    def count(self, chunks: list[dict[str, Any]]) -> None:
        now = time.perf_counter()  # chunks of one batch arrived together: the gaps inside it are 0
        for chunk in chunks:
            choices = chunk.get("choices")
            if choices:
                if self.tokens:
                    self.metrics.itl.observe(now - self.last)
                else:
                    self.first = now
                self.tokens += 1
                self.last = now
                self.finished = self.finished or bool(choices[0].get("finish_reason"))
            if chunk.get("usage"):
                self.usage = chunk["usage"]
