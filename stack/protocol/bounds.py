"""The one table of limits on sampling fields, shared by the router and the engine.

Each limit is vLLM's where it has one (vllm/sampling_params.py `SamplingParams._verify_args`, and
`seed: Field(ge=_LONG_INFO.min, le=_LONG_INFO.max)` in vllm/entrypoints/openai/protocol.py), else
OpenAI's documented limit; where both exist the tighter one, so a body the router accepts is one
every backend accepts. Limits that depend on the model (context length, vocabulary) are the
engine's to check. Tests generate their boundary cases from `BOUNDS`, so a new row is covered
without a new test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stack.protocol.types import Kind

Value = Literal["int", "number", "bool", "strings", "token_ids", "token_bias"]
BOTH: frozenset[Kind] = frozenset({"chat", "completion"})
CHAT: frozenset[Kind] = frozenset({"chat"})
COMPLETION: frozenset[Kind] = frozenset({"completion"})
INT64 = 2**63


@dataclass(frozen=True)
class Bound:
    """One wire field: its JSON type and limits (None = unbounded on that side)."""

    name: str
    value: Value
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is out of range
    high_open: bool = False
    kinds: frozenset[Kind] = BOTH
    max_items: int | None = None  # strings / token_ids: the longest list

    def check(self, x: float) -> str | None:
        """What is wrong with the number `x`, or None if it is in range."""
        too_low = self.low is not None and (x <= self.low if self.low_open else x < self.low)
        too_high = self.high is not None and (x >= self.high if self.high_open else x > self.high)
        if not (too_low or too_high):
            return None
        if self.low is not None and self.high is not None:
            if not self.low_open and not self.high_open:
                return f"must be between {self.low:g} and {self.high:g}, got {x}."
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"must be in {left}{self.low:g}, {self.high:g}{right}, got {x}."
        if self.low is not None:
            return f"must be {'>' if self.low_open else '>='} {self.low:g}, got {x}."
        return f"must be {'<' if self.high_open else '<='} {self.high:g}, got {x}."


BOUNDS: tuple[Bound, ...] = (
    Bound("max_tokens", "int", low=1),  # vLLM: "max_tokens must be at least 1"
    Bound("max_completion_tokens", "int", low=1, kinds=CHAT),  # OpenAI's newer name for max_tokens
    Bound("temperature", "number", low=0, high=2),  # vLLM: "temperature must be in [0, 2]"
    Bound("top_p", "number", low=0, high=1, low_open=True),  # vLLM: "top_p must be in (0, 1]"
    Bound("top_k", "int", low=-1),  # vLLM: "top_k must be 0 (disable), or at least 1" (-1 quietly accepted)
    Bound("min_p", "number", low=0, high=1),  # vLLM: "min_p must be in [0, 1]"
    Bound("seed", "int", low=-INT64, high=INT64 - 1),  # vLLM: torch.long's range
    Bound("stop", "strings", max_items=4),  # OpenAI: up to 4; vLLM: "stop cannot contain an empty string"
    Bound("stop_token_ids", "token_ids"),  # vLLM: integers; in-vocabulary is the engine's check
    Bound("n", "int", low=1, high=128),  # vLLM: at least 1; OpenAI: at most 128
    Bound("presence_penalty", "number", low=-2, high=2),  # vLLM: "presence_penalty must be in [-2, 2]"
    Bound("frequency_penalty", "number", low=-2, high=2),  # vLLM: "frequency_penalty must be in [-2, 2]"
    Bound("repetition_penalty", "number", low=0, low_open=True),  # vLLM: "must be greater than zero" (and finite)
    Bound("min_tokens", "int", low=0),  # vLLM: ">= 0" and "<= max_tokens" (checked by the parser)
    Bound("ignore_eos", "bool"),  # vLLM's extension
    Bound("logprobs", "bool", kinds=CHAT),  # chat: whether to return logprobs
    Bound("top_logprobs", "int", low=0, high=20, kinds=CHAT),  # OpenAI: 0..20 (= vLLM's default max_logprobs)
    Bound("logprobs", "int", low=0, high=5, kinds=COMPLETION),  # completions: how many; OpenAI: at most 5
    Bound("logit_bias", "token_bias", low=-100, high=100),  # OpenAI: token id -> bias in [-100, 100]
)


def bounds_for(kind: Kind) -> tuple[Bound, ...]:
    """The rows that apply to `kind`, in table order (the order the parser checks them)."""
    return tuple(b for b in BOUNDS if kind in b.kinds)
