"""One request inside the engine (`Sequence`) and the plain values that flow in and out of it.

The scheduler (scheduler.py) drives sequences; the hand-off (handoff.py) and the server read
`Output`s, `PromptKV` and `Prefilled` without knowing the step loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from stack.engine.grammar import Constraint
from stack.engine.kv_cache import KVCache, PagedView
from stack.engine.prefix_cache import Block
from stack.engine.protocol import SamplingParams
from stack.engine.tokenizer import IncrementalDecoder


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and the most likely alternatives (raw model distribution)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class Output:
    """New text of one sequence since the last output; `finish_reason` set on the last one."""

    text: str
    num_tokens: int  # completion tokens so far
    finish_reason: str | None = None  # stop | length | abort | error
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens sampled since the last output (params.logprobs set)
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_id that ended it (None for EOS, length)


@dataclass(frozen=True)
class PromptKV:
    """A prompt's K/V and the token sampled after it: what `prefill` lends and `submit(kv=…)` continues from."""

    # (n_layers, len(prompt) - len(prefix) * block_size, n_kv_heads, head_dim): the positions after `prefix`; arrays,
    # or from `prefill` the pool's blocks seen through a `PagedView` (indexed like an array, read where they lie)
    k: np.ndarray | PagedView
    v: np.ndarray | PagedView
    first_token: int  # sampled from the last prompt position (generation step 0)
    seed: int  # the sampling seed of that token; the continuation keeps drawing from the same stream
    first_logprob: TokenLogprob | None = None  # that token's logprobs, when the request asked for them
    prefix: tuple[Block, ...] = ()  # pinned cached blocks holding the first positions; k, v hold the rest
    cached_tokens: int = 0  # prompt tokens the computing engine took from its prefix cache (usage)


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int  # the effective sampling seed (the request's, the given KV's, or a random one)
    kv_read: asyncio.Future[None]  # done once `start_kv` is no longer read (copied in, or the sequence ended)
    start_kv: PromptKV | None = None  # prompt KV + first token computed elsewhere, copied in at admission
    keeps_cache: bool = False  # `prefill`: a finished sequence's cache stays reserved until `Prefilled.release`
    cache: KVCache | None = None
    num_computed: int = 0  # prompt tokens whose K/V are in the cache
    block_hashes: list[str] = field(default_factory=list)  # hash chain of the prompt's full blocks (prefix cache)
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (usage.prompt_tokens_details.cached_tokens)
    on_layer: Callable[[int, KVCache], None] | None = None  # `prefill`: layer i of the whole prompt is in the cache
    output: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` already emitted
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # see Output.stop_reason
    cancelled: bool = False
    queued_logged: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    prefill_started: float | None = None
    first_token_at: float = 0.0  # perf_counter times of its first and latest token (metrics)
    last_token_at: float = 0.0
    outputs: asyncio.Queue[Output] = field(default_factory=asyncio.Queue)
    detok: IncrementalDecoder | None = None
    choice: int = 0  # index among the request's n choices (its own seed stream)
    constraint: Constraint | None = None  # the grammar the output follows (params.grammar)
    counts: np.ndarray | None = None  # (vocab,) int32 output token counts, for the penalties
    in_prompt: np.ndarray | None = None  # (vocab,) bool prompt tokens, for repetition_penalty
    logprobs: list[TokenLogprob] = field(default_factory=list)  # not yet emitted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)


@dataclass(frozen=True)
class Prefilled:
    """A prompt run to its first token; its cache stays reserved in the pool until `release()`."""

    output: Output  # the only output: the first token's text; finish_reason stop | length | error | abort
    kv: PromptKV | None  # views into the pool cache; None when the step failed or the engine stopped
    release: Callable[[], None]  # gives the cache back to the pool (idempotent); `kv` is invalid after it
