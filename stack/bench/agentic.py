"""The agentic multi-turn workload: N coding-agent sessions that resend a long, growing prefix every turn.

What a coding agent (Claude Code, Codex) sends, in miniature: every session opens with the same system prompt of a
few thousand tokens and the same tool list (one agent product), then a task; each later turn appends the model's
answer and a tool result and asks again, after a think time (the tool running, the user reading). So turn k resends
everything of turns 0…k-1: the prefix a cache-aware stack can reuse and a cache-less one recomputes. Each session
sends its id in Claude Code's `X-Claude-Code-Session-Id` header, as the real agent does (stack/router/affinity.py).

Closed loop per session (a turn starts after the previous answer and the think time), sessions concurrent with
seeded staggered starts. The answers the history holds are seeded text of the turn's output length, not the model's
actual output, so every arm sees byte-identical prompts (a dummy model's bytes need not even be valid UTF-8).
Same seed, same sessions.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from stack.bench.dataset import TokenCounter, byte_count, text_of_length
from stack.bench.loadgen import Progress, stream_request
from stack.bench.metrics import RequestOutcome

SESSION_HEADER = "X-Claude-Code-Session-Id"  # anthropics/claude-code CHANGELOG.md 2.1.86


@dataclass(frozen=True)
class AgenticShape:
    """The workload's knobs (CLI: --agentic-*)."""

    sessions: int = 4
    turns: int = 4
    system_len: int = 3000  # tokens of the shared system prompt (tools come on top)
    tools: int = 6
    turn_len: int = 200  # tokens of each turn's new user text (the task, then tool results)
    output_len: int = 32  # tokens asked per turn (ignore_eos: exactly this many)
    think_mean_s: float = 1.0  # exponential think time between a session's turns
    stagger_s: float = 2.0  # sessions start uniformly within this window

    def problems(self) -> list[str]:
        """One message per bad knob, named as its flag."""
        flag = lambda name: "--agentic-" + name.replace("_", "-")  # noqa: E731
        return ([f"{flag(n)} must be > 0" for n in ("sessions", "turns", "system_len", "turn_len", "output_len") if getattr(self, n) <= 0]
                + [f"{flag(n)} must be >= 0" for n in ("tools", "think_mean_s", "stagger_s") if getattr(self, n) < 0])


# Named shapes of real agents' requests. claude-code: Claude Code's own opening, ~27k characters of system prompt and
# 14 tools (Bash, Read, Edit, Write, Glob, Grep, Task, …) on every request; in bytes (the numpy engine's tokens) that
# is ~27k tokens, so the checkpoint needs a context of 32k (compare --max-model-len 32768).
PROFILES = {"claude-code": {"system_len": 27000, "tools": 14}}


@dataclass(frozen=True)
class Turn:
    user: str  # what this turn appends before asking
    answer: str  # what the history records as the model's answer to it (seeded, output_len tokens)
    think_s: float  # pause after the answer, before the next turn


@dataclass(frozen=True)
class Session:
    session_id: str
    start_s: float
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    system: str
    tools: tuple[dict[str, Any], ...]
    sessions: tuple[Session, ...]
    output_len: int

    def messages(self, session: Session, turn: int) -> list[dict[str, str]]:
        """Turn `turn`'s whole conversation: system, every earlier user text and answer, this turn's user text."""
        messages = [{"role": "system", "content": self.system}]
        for earlier in session.turns[:turn]:
            messages += [{"role": "user", "content": earlier.user}, {"role": "assistant", "content": earlier.answer}]
        return messages + [{"role": "user", "content": session.turns[turn].user}]

    def payload(self, model: str, session: Session, turn: int) -> dict[str, Any]:
        return {"model": model, "messages": self.messages(session, turn), "tools": list(self.tools), "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0, "max_completion_tokens": self.output_len,
                "ignore_eos": True}

    def prompt_len(self, session: Session, turn: int, count: TokenCounter = byte_count) -> int:
        """Tokens of the turn's messages and tools (the chat template adds a few; usage reports the exact count)."""
        return sum(count(m["content"]) for m in self.messages(session, turn)) + count(json.dumps(list(self.tools)))

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def _tool(rng: np.random.Generator, index: int, count: TokenCounter) -> dict[str, Any]:
    description = text_of_length(rng, 120, count)
    return {"type": "function", "function": {
        "name": f"tool_{index}", "description": description,
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "query": {"type": "string"}},
                       "required": ["path"]}}}


def prefix_rng(seed: int) -> np.random.Generator:
    """The generator of the product's system prompt and tools: a stream of its own (a session seed equal to it draws
    other words), so that compare can keep one agent product's prefix over every point of its ladder while each
    point draws new sessions. A deployed agent's system prompt is the same on every request of every session, so a
    serving stack's prefix cache holds it: a benchmark that gave each load point a new one would time a cold
    27k-token prefill per point, which no running deployment sees."""
    return np.random.default_rng([seed, 0x5E55])


def build_workload(shape: AgenticShape, rng: np.random.Generator, count: TokenCounter = byte_count,
                   prefix: np.random.Generator | None = None) -> Workload:
    """Seeded sessions of `shape` from `rng`; one system prompt and tool list shared by all (one agent product), from
    `prefix` (default: `rng`)."""
    prefix = rng if prefix is None else prefix
    system = text_of_length(prefix, shape.system_len, count)
    tools = tuple(_tool(prefix, i, count) for i in range(shape.tools))
    starts = np.sort(rng.uniform(0, shape.stagger_s, shape.sessions)) if shape.stagger_s else np.zeros(shape.sessions)
    sessions = []
    for i, start in enumerate(starts):
        turns = tuple(Turn(text_of_length(rng, shape.turn_len, count), text_of_length(rng, shape.output_len, count),
                           float(rng.exponential(shape.think_mean_s)) if shape.think_mean_s else 0.0)
                      for _ in range(shape.turns))
        sessions.append(Session(f"agent-{i:03d}-{int(rng.integers(1 << 30)):08x}", float(start), turns))
    return Workload(system, tools, tuple(sessions), shape.output_len)


async def run_sessions(
    session: aiohttp.ClientSession,
    url: str,
    workload: Workload,
    model: str,
    headers: dict[str, str],
    progress: Progress | None = None,
    count: TokenCounter = byte_count,
    sleep: Callable[[float], Any] = asyncio.sleep,
    max_sessions: int | None = None,
) -> tuple[list[RequestOutcome], float]:
    """Run every session's turns in order, sessions concurrently (at most `max_sessions` at once, the rest waiting
    in start order); outcomes in (session, turn) order and the run's duration. A failed turn ends its session (a
    real agent would stop or retry; either way its later turns would not be the ones measured)."""
    clock_zero = time.perf_counter()
    room = asyncio.Semaphore(max_sessions or len(workload.sessions) or 1)

    async def one(agent: Session) -> list[RequestOutcome]:
        await sleep(max(0.0, clock_zero + agent.start_s - time.perf_counter()))
        async with room:
            return await turns(agent)

    async def turns(agent: Session) -> list[RequestOutcome]:
        outcomes = []
        for turn in range(len(agent.turns)):
            outcome = await stream_request(session, url, workload.payload(model, agent, turn),
                                           {**headers, SESSION_HEADER: agent.session_id},
                                           workload.prompt_len(agent, turn, count), clock_zero)
            outcomes.append(outcome)
            if progress is not None:
                progress.update(outcome)
            if not outcome.success:
                break
            await sleep(agent.turns[turn].think_s)
        return outcomes

    per_session = await asyncio.gather(*(one(agent) for agent in workload.sessions))
    return [o for outcomes in per_session for o in outcomes], time.perf_counter() - clock_zero
