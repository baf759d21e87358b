"""Session and prefix affinity (policy "cache_aware"): which backend of a pool a request prefers, and when load wins.

Coding agents resend a long, mostly identical prefix every turn (system prompt, tools, the growing history). An
engine with prefix caching computes only what it has not seen, so a session's turns should keep landing where its
blocks already are: the same prefill (which computes the prompt) AND the same decode (which keeps the session's
blocks and then needs only the new ones). Both pools rank their backends for the request's key independently, with
the same key, so a session sticks to one pair.

The key, in order (the first one present wins):
  1. a session id header the agent sends on every request (`SESSION_HEADERS`, each cited);
  2. else a hash of the first `affinity_prefix_chars` characters of the conversation's opening (tools, system, the
     first user message; completions: the prompt), which every turn of a conversation repeats, so its turns share a
     key. Conversations that open with the same long system prompt share one too: their common blocks are cached
     in one place, and the guard spreads them when that backend runs too far ahead.

Mapping: rendezvous (highest-random-weight) hashing of key × backend URL. Adding or removing a backend moves only
the keys whose top choice changes (about 1/n of them), unlike `hash % n`, which moves nearly all; a backend that
is down (or excluded by a retry) hands its keys to each key's next choice, which is as stable. A preferred backend
with no free slot sends the request load-aware rather than making it wait.

Imbalance guard (vllm-router's `cache_aware` rule, vllm-project/router src/policies/cache_aware.rs: a system is
imbalanced if `max - min > balance_abs_threshold` and `max > min * balance_rel_threshold`, defaults 64 and 1.5,
over requests in flight): when the preferred backend is that far ahead of the least loaded one, the request goes
load-aware instead, and the session returns to its backend once the gap closes. Decisions per backend and role
are counted in /metrics (`pd_router_affinity_decisions_total`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from stack.common import json_text

# Session id headers, looked up case-insensitively (aiohttp's CIMultiDict), most specific first.
SESSION_HEADERS = (
    # Claude Code ≥ 2.1.86: "Added `X-Claude-Code-Session-Id` header to API requests so proxies can aggregate
    # requests by session without parsing the body" (anthropics/claude-code CHANGELOG.md, 2.1.86).
    "x-claude-code-session-id",
    # OpenAI Codex CLI: `build_conversation_headers` inserts `session_id` = the conversation id on every model
    # request (openai/codex codex-rs/codex-api/src/requests/headers.rs).
    "session_id",
    # Generic: the first key of vllm-router's `consistent_hash` policy (vllm-project/router docs/load_balancing).
    "x-session-id",
)
MAX_SESSION_ID = 256  # longer or control characters: not an id, ignored (falls back to the prefix hash)

# Why a backend was chosen: by the session header or the prompt prefix; load-aware because the preferred one was too
# far ahead ("imbalanced") or had no free slot ("unavailable"), or because the request had no key ("no_key").
Decision = Literal["session", "prefix", "imbalanced", "unavailable", "no_key"]


class Candidate(Protocol):
    """What the policy reads of a backend (stack.router.backends.Backend)."""

    url: str
    in_flight: int
    outstanding_tokens: int


@dataclass(frozen=True)
class Affinity:
    """A request's affinity key: where it came from, and a digest (the raw id or prompt never stays in memory)."""

    kind: Literal["session", "prefix"]
    digest: bytes


@dataclass(frozen=True)
class Guard:
    """The [scheduler] imbalance thresholds (validated there)."""

    abs_threshold: int = 64
    rel_threshold: float = 1.5

    def imbalanced(self, load: int, least: int) -> bool:
        return load - least > self.abs_threshold and load > least * self.rel_threshold


def _digest(kind: str, text: str) -> bytes:
    return hashlib.blake2b(f"{kind}\0{text}".encode(), digest_size=16).digest()


def session_id(headers: Mapping[str, str]) -> str | None:
    """The first well-formed session id header's value, or None."""
    for name in SESSION_HEADERS:
        value = (headers.get(name) or "").strip()
        if value and len(value) <= MAX_SESSION_ID and value.isprintable():
            return value
    return None


def prompt_prefix(body: Mapping[str, Any], chars: int) -> str:
    """The first `chars` characters of the conversation's opening in the order the engine reads it: tools, then the
    messages up to the first user message (chat), or the prompt (completions). A conversation only appends, so its
    opening, unlike its whole prompt, is the same every turn. JSON with sorted keys: equal requests give equal text
    whatever the client's key order. Empty if the request has no prompt."""
    if isinstance(body.get("prompt"), str):
        return body["prompt"][:chars]
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return ""
    rendered, length = [], 0
    for piece in _opening_pieces(body.get("tools") or [], messages):
        rendered.append(piece)
        length += len(piece)
        if length >= chars:  # an agent's tools alone run to tens of KB: render no more than is hashed
            break
    return "".join(rendered)[:chars]


def _opening_pieces(tools: Any, messages: list[Any]) -> Iterator[str]:
    """The JSON of the tools, then of each message up to the first user one, a piece at a time. Joined, the pieces
    equal dumping the tools list whole (a list's JSON is "[" + items joined by "," + "]"), then each message."""
    def dump(part: Any) -> str:
        return json_text.encode_sorted(part).decode()
    if isinstance(tools, list):
        yield "["
        for i, tool in enumerate(tools):
            yield ("," if i else "") + dump(tool)
        yield "]"
    else:
        yield dump(tools)
    for message in messages:
        yield dump(message)
        if isinstance(message, dict) and message.get("role") == "user":
            return


def request_affinity(headers: Mapping[str, str], body: Mapping[str, Any], prefix_chars: int) -> Affinity | None:
    """A request's key: its session header, else its prompt prefix; None if it has neither."""
    session = session_id(headers)
    if session is not None:
        return Affinity("session", _digest("session", session))
    prefix = prompt_prefix(body, prefix_chars)
    return Affinity("prefix", _digest("prefix", prefix)) if prefix else None


def rank(key: Affinity, backends: Sequence[Candidate]) -> list[Candidate]:
    """`backends` from the key's first choice to its last (rendezvous hashing on key × URL)."""
    def weight(backend: Candidate) -> bytes:
        return hashlib.blake2b(key.digest + backend.url.encode(), digest_size=8).digest()
    return sorted(backends, key=weight, reverse=True)


def least_loaded(ready: Sequence[Candidate]) -> Candidate:
    """The load-aware choice: fewest outstanding tokens, then fewest requests (first wins ties)."""
    return min(ready, key=lambda b: (b.outstanding_tokens, b.in_flight))


def choose(key: Affinity, usable: Sequence[Candidate], ready: Sequence[Candidate], guard: Guard) -> tuple[Candidate, Decision]:
    """The backend for `key` among `ready` (usable with a free slot, non-empty; `usable` ⊇ `ready`).

    The key's first choice among the usable backends gets it if it has a slot and is not too far ahead of the least
    loaded one; otherwise the request goes load-aware: "unavailable" (the preferred one is full) or "imbalanced"."""
    preferred = rank(key, usable)[0]
    if preferred not in ready:
        return least_loaded(ready), "unavailable"
    if guard.imbalanced(preferred.in_flight, min(b.in_flight for b in usable)):
        return least_loaded(ready), "imbalanced"
    return preferred, key.kind
