"""Benchmark prompts: ShareGPT files, vLLM's `random` set, and a synthetic ShareGPT-like set.

Lengths are in tokens of a `TokenCounter`: the Hugging Face tokenizer given with `--tokenizer`, else the dummy
models' BPE (`dummy_count`, what the default stack counts); `byte_count` (UTF-8 bytes, exact lengths) serves tests.
Every sampler takes a seeded `numpy.random.Generator`, so the same seed gives the same prompts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TokenCounter = Callable[[str], int]

# ShareGPT filtering as vLLM's `is_valid_sequence`: drop tiny turns and over-long pairs.
MIN_SEQ_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
CHAT_TEMPLATE_ROOM = 64  # tokens the chat template adds around a synthetic prompt (the engines count them)

# Words for synthetic prompts: ordinary English so the text looks like chat, not noise.
_WORDS = (
    "the model serves requests from many users and each prompt is split into tokens before the "
    "prefill phase computes keys and values for every position while decode produces one token "
    "per step from the cache so a long prompt can stall other streams unless the phases run on "
    "separate instances explain why latency matters for interactive chat and how a scheduler "
    "balances throughput against the time to first token please write a short summary of the "
    "following notes about memory bandwidth compute batching queues and service level objectives"
).split()


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, by the run's TokenCounter
    expected_output_len: int  # max tokens asked of the server


class DatasetError(ValueError):
    """A dataset file that cannot be read or holds too few usable conversations."""


def byte_count(text: str) -> int:
    """Tokens of the engine's byte-level tokenizer: one per UTF-8 byte (specials excluded)."""
    return len(text.encode("utf-8"))


def dummy_count(text: str) -> int:
    """Tokens of the dummy models' byte-level BPE (specials excluded): what the stacks' default engine counts."""
    from stack.engine.tokenizer import dummy_tokenizer  # only needed when no --tokenizer is given

    return len(dummy_tokenizer().encode(text, add_special_tokens=False))


def hf_counter(tokenizer_path: str) -> TokenCounter:
    """Counter from a Hugging Face `tokenizer.json` (no special tokens, as vLLM counts)."""
    from tokenizers import Tokenizer  # only needed with --tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def load_sharegpt(
    path: str | Path,
    num_requests: int,
    rng: np.random.Generator,
    count: TokenCounter = byte_count,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """ShareGPT_V3 JSON (list of {id, conversations: [{from, value}, ...]}) -> requests.

    The first turn is the prompt and the second turn's length the output budget (or
    `output_len`), after a seeded shuffle and vLLM's length filter.
    """
    try:
        records = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read ShareGPT JSON: {exc}") from exc
    if not isinstance(records, list):
        raise DatasetError(f"{path}: expected a JSON list of conversations")
    conversations = [
        r["conversations"]
        for r in records
        if isinstance(r, dict) and isinstance(r.get("conversations"), list) and len(r["conversations"]) >= 2
    ]
    samples: list[SampleRequest] = []
    for index in rng.permutation(len(conversations)):
        first, second = conversations[index][0], conversations[index][1]
        prompt = str(first.get("value", ""))
        prompt_len = count(prompt)
        completion_len = output_len or count(str(second.get("value", "")))
        if _valid(prompt_len, completion_len, output_len is not None):
            samples.append(SampleRequest(prompt, prompt_len, completion_len))
        if len(samples) == num_requests:
            return samples
    raise DatasetError(f"{path}: only {len(samples)} usable conversations, {num_requests} requested")


def _valid(prompt_len: int, output_len: int, output_fixed: bool) -> bool:
    if prompt_len < MIN_SEQ_LEN or (not output_fixed and output_len < MIN_SEQ_LEN):
        return False
    return prompt_len <= MAX_PROMPT_LEN and prompt_len + output_len <= MAX_TOTAL_LEN


def random_requests(
    num_requests: int,
    rng: np.random.Generator,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    count: TokenCounter = byte_count,
) -> list[SampleRequest]:
    """vLLM's `random` set: lengths uniform in [len·(1−r), len·(1+r)], content random words."""
    inputs = _uniform_lengths(rng, num_requests, input_len, range_ratio)
    outputs = _uniform_lengths(rng, num_requests, output_len, range_ratio)
    return [
        SampleRequest(text, count(text), int(out))
        for text, out in ((text_of_length(rng, int(n), count), o) for n, o in zip(inputs, outputs))
    ]


def _uniform_lengths(rng: np.random.Generator, n: int, length: int, ratio: float) -> np.ndarray:
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def synthetic_sharegpt(
    num_requests: int,
    rng: np.random.Generator,
    input_mean: int = 800,
    output_mean: int = 128,
    sigma: float = 0.5,
    max_input: int = 2048,
    max_output: int = 512,
    count: TokenCounter = byte_count,
    max_total: int = MAX_TOTAL_LEN - CHAT_TEMPLATE_ROOM,
) -> list[SampleRequest]:
    """ShareGPT-like set: log-normal input/output lengths (right-skewed like real chat) with the
    given means and log-space spread `sigma` (0 = every request exactly the mean), clipped to
    [MIN_SEQ_LEN, max]. A pair longer than `max_total` in all (the context the engines serve, less
    room for the chat template) is drawn again, as vLLM's ShareGPT filter drops it: a request that
    cannot fit measures nothing."""
    inputs = _lognormal_lengths(rng, num_requests, input_mean, sigma, max_input)
    outputs = _lognormal_lengths(rng, num_requests, output_mean, sigma, max_output)
    if input_mean + output_mean > max_total:
        raise DatasetError(f"mean lengths {input_mean} + {output_mean} exceed the {max_total}-token total a request may have")
    while (over := np.flatnonzero(inputs + outputs > max_total)).size:
        inputs[over] = _lognormal_lengths(rng, over.size, input_mean, sigma, max_input)
        outputs[over] = _lognormal_lengths(rng, over.size, output_mean, sigma, max_output)
    samples = []
    for n, out in zip(inputs, outputs):
        text = text_of_length(rng, int(n), count)
        samples.append(SampleRequest(text, count(text), int(out)))
    return samples


def _lognormal_lengths(rng: np.random.Generator, n: int, mean: int, sigma: float, upper: int) -> np.ndarray:
    # E[lognormal(mu, sigma)] = exp(mu + sigma²/2): choose mu so the mean is `mean`.
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), MIN_SEQ_LEN, upper).astype(int)


def text_of_length(rng: np.random.Generator, tokens: int, count: TokenCounter) -> str:
    """Random words whose token count is `tokens` (exact for bytes; the nearest prefix otherwise)."""
    words: list[str] = []
    text = ""
    while (current := count(text)) < tokens:
        # About 6 bytes per word: add words in batches instead of re-counting after each one.
        words.extend(str(w) for w in rng.choice(_WORDS, size=(tokens - current) // 6 + 1))
        text = " ".join(words)
    if count is byte_count:
        return text.encode("utf-8")[:tokens].decode("utf-8", errors="ignore")
    while len(words) > 1 and count(text) > tokens:
        words.pop()
        text = " ".join(words)
    return text
