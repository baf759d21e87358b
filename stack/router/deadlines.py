"""How long each leg of a request may take, sized by its prompt (docs/deadlines.md).

A prefill's time grows with its prompt: linearly (every token goes through every weight) plus attention's quadratic
term (every token attends to every earlier one). A fixed budget sized for short prompts cuts long ones; one sized for
the window lets a stuck short one hang for minutes. So the work a prompt of T tokens may take is

    work_s(T) = T / prefill_tokens_per_s × (1 + T / prefill_attention_tokens)

Per token, a forward pass costs ~2·P FLOPs in the weights (P parameters) and ~4·L·d·t in attention at position t
(L layers, model width d; QKᵀ and AV, 2·d each per earlier token): summed over a prompt, 2·P·T + 2·L·d·T². The two
are equal at T0 = P / (L·d), the prefill_attention_tokens setting (dummy:small: P ≈ 25M, L = 8, d = 512 → ~6k; a
7B model, L = 32, d = 4096: ~53k); 0 leaves the quadratic term out. prefill_tokens_per_s is a floor of throughput on short prompts (a slow, loaded host), not an
expectation. T is an upper bound on the prompt's tokens: its characters (no byte or BPE tokenizer makes more tokens
than characters of ordinary text), capped at the model's window when the engines report it.

    prefill leg          prefill_timeout_ms + work_s(T)
    decode's first chunk kv_transfer_timeout_ms + first_token_timeout_ms (+ work_s(T) when decode computes the prompt)
    non-streamed decode  decode_timeout_ms (+ work_s(T) when decode computes the prompt)
    the request          deadline_ms + work_s(T): everything before the first byte (streams) or the whole answer

`within(seconds)` holds a block of the running task to its budget.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import TracebackType

from stack.router.scheduler import SchedulerConfig


def work_s(config: SchedulerConfig, tokens: int) -> float:
    """The longest a prefill of `tokens` may compute beyond a short prompt's budget (see the module doc)."""
    quadratic = tokens / config.prefill_attention_tokens if config.prefill_attention_tokens else 0.0
    return tokens / config.prefill_tokens_per_s * (1 + quadratic)


@dataclass(frozen=True)
class Budgets:
    """One request's bounds, in seconds."""

    tokens: int  # the prompt size they were sized for (characters, capped at the window)
    work_s: float  # work_s(tokens): what the prompt adds to a short prompt's budgets
    prefill_s: float  # the whole prefill leg (its KV push included)
    first_chunk_s: float  # a streamed decode leg's headers and first chunk (decode computes the prompt: + work)
    first_chunk_alone_s: float
    decode_json_s: float  # a non-streamed decode leg, whole
    decode_json_alone_s: float
    deadline_s: float  # everything before the first byte (streams) or the whole answer (non-streamed)

    def first_chunk(self, computes_prompt: bool) -> float:
        return self.first_chunk_alone_s if computes_prompt else self.first_chunk_s

    def decode_json(self, computes_prompt: bool) -> float:
        return self.decode_json_alone_s if computes_prompt else self.decode_json_s


def budgets(config: SchedulerConfig, prompt_chars: int, window: int | None) -> Budgets:
    """The bounds for a prompt of `prompt_chars` characters on engines with a `window`-token context (None: unknown)."""
    tokens = min(prompt_chars, window) if window else prompt_chars
    work = work_s(config, tokens)
    first_chunk = (config.kv_transfer_timeout_ms + config.first_token_timeout_ms) / 1000
    return Budgets(tokens, work, config.prefill_timeout_ms / 1000 + work, first_chunk, first_chunk + work,
                   config.decode_timeout_ms / 1000, config.decode_timeout_ms / 1000 + work, config.deadline_ms / 1000 + work)


def worst_case_s(config: SchedulerConfig, window: int | None) -> dict[str, float | int | None]:
    """How long a request can take at most, from the settings and the engines' window (GET /health, router.bounds).

    Before the first byte every wait is bounded twice: by its own leg timeout, and by the request's deadline over all
    of them. The legs' own sum (attempts × (queue + prefill tries × (queue + prefill) + KV + first token)) is usually
    larger than the deadline, so the deadline is what a client sees; both are reported. `window` None (not reported
    yet): the bounds of a prompt as long as deadline_ms covers alone.
    """
    at = budgets(config, window or 0, window)
    tries = config.max_retries + 1
    q = config.queue_timeout_ms / 1000
    first_byte_legs = q + tries * (tries * (q + at.prefill_s) + at.first_chunk_alone_s)
    json_legs = q + tries * (tries * (q + at.prefill_s) + at.decode_json_alone_s)
    first_byte = min(first_byte_legs, at.deadline_s)
    return {
        "window_tokens": window,  # the prompt size these are for (the engines' max_model_len)
        "prefill_s": round(at.prefill_s, 1),  # one prefill leg of a prompt that fills the window
        "first_byte_s": round(first_byte, 1),  # a stream's first chunk or an explicit error
        "non_streamed_s": round(min(json_legs, at.deadline_s), 1),  # a whole non-streamed answer or an explicit error
        "stream_s": round(first_byte + config.request_timeout_ms / 1000, 1),  # a whole stream (each silence ≤ idle_timeout_ms)
        "stream_silence_s": config.idle_timeout_ms / 1000,  # the longest gap between two chunks before an in-band error
        "queue_wait_s": q,
    }


class within:  # noqa: N801 - used as a statement: `with within(deadline_s):`
    """`with within(seconds): …` is `async with asyncio.timeout(seconds): …` for the running task: the block is
    cancelled when the time is up, and that cancellation leaves it as TimeoutError (a cancellation from elsewhere stays
    one). asyncio's Timeout costs ~28k instructions a use (callgrind; its state machine, a running-loop lookup per
    call) and a stream uses two (the request's deadline, decode's first chunk): this is one timer and ~10k."""

    __slots__ = ("_delay", "_task", "_cancelling", "_timer", "_expired")

    def __init__(self, seconds: float) -> None:
        self._delay = seconds

    def __enter__(self) -> within:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("within() holds a task to its time: use it inside one")
        self._task, self._cancelling, self._expired = task, task.cancelling(), False
        self._timer = task.get_loop().call_later(self._delay, self._expire)  # (uvloop's call_at calls this)
        return self

    def _expire(self) -> None:
        self._expired = True
        self._task.cancel()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._timer.cancel()
        # As asyncio.Timeout: this timer's cancel is taken back; it was the block's end unless another one came too.
        if self._expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc
