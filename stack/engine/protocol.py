"""OpenAI request bodies in, typed objects out; typed results in, OpenAI response and chunk bodies out.

`parse_request` reads a `/v1/chat/completions` or `/v1/completions` body with the shared contract
(stack.protocol: the same parser, bounds and capability check as the router, so both give the same
verdict), then does the engine's own part: the model id, tokenizing, the context length, and
resolving defaults into the concrete `SamplingParams` the scheduler runs. Fields outside the
contract are ignored, as vLLM does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from stack.common.errors import InvalidRequest, NotFound
from stack.engine.errors import ChatTemplateError
from stack.engine.tokenizer import Tokenizer
from stack.protocol.capabilities import CPU_ENGINE, fit
from stack.protocol.fields import Fields
from stack.protocol.messages import parse_messages
from stack.protocol.parse import parse, parse_prompt
from stack.protocol.serialise import message_body
from stack.protocol.types import Kind, Message, Request, Sampling


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop."""

    max_tokens: int  # new tokens at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # None: a random seed per request
    stop: tuple[str, ...] = ()  # strings that end the completion (not included in the text)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past end-of-sequence (benchmarks)


@dataclass(frozen=True)
class KVTransferParams:
    """`kv_transfer_params` of a PD leg (design §2); unknown keys pass through untouched."""

    do_remote_decode: bool  # prefill leg: compute the KV and push it to decode_kv_addr
    do_remote_prefill: bool  # decode leg: the KV was pushed here under transfer_id
    transfer_id: str
    decode_kv_addr: str | None = None  # "host:port" of the decode's KV listener (prefill leg)


@dataclass(frozen=True)
class CompletionRequest:
    """A validated generation request."""

    kind: Kind
    model: str
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    kv_transfer: KVTransferParams | None


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(data).__name__}", code="invalid_type")
    return data


def parse_request(kind: Kind, data: dict[str, Any], *, model_id: str, tokenizer: Tokenizer, max_model_len: int) -> CompletionRequest:
    """Validate `data` and tokenize its prompt; every client mistake is an `InvalidRequest` (400)."""
    req = parse(kind, data)
    if req.model != model_id:
        raise NotFound(f"The model `{req.model}` does not exist. This engine serves `{model_id}`.", code="model_not_found", param="model")
    req = fit(req, CPU_ENGINE)
    if kind == "chat":
        prompt_tokens = _chat_tokens(tokenizer, req.messages)
    else:
        prompt_tokens = _prompt_tokens(req.prompt, tokenizer)
    if not prompt_tokens:
        raise InvalidRequest("the prompt is empty", param="prompt" if kind == "completion" else "messages")
    sampling = _sampling(req, len(prompt_tokens), max_model_len)
    kv_transfer = _kv_transfer(req)
    if kv_transfer is not None and kv_transfer.do_remote_decode and req.stream:
        raise InvalidRequest("the prefill leg (do_remote_decode) must be stream=false", param="stream")
    return CompletionRequest(kind, req.model, tuple(prompt_tokens), sampling, req.stream, req.include_usage, kv_transfer)


def parse_tokenize(data: dict[str, Any], *, model_id: str, tokenizer: Tokenizer) -> list[int]:
    """POST /tokenize as vLLM takes it: `prompt`, or `messages` (+ `add_generation_prompt`, default true)."""
    f = Fields(data)
    model = f.string("model")
    if model is not None and model != model_id:
        raise NotFound(f"The model `{model}` does not exist. This engine serves `{model_id}`.", code="model_not_found", param="model")
    if "messages" not in data:
        return _prompt_tokens(parse_prompt(f), tokenizer)
    return _chat_tokens(tokenizer, parse_messages(f), add_generation_prompt=f.boolean("add_generation_prompt", default=True))


def _chat_tokens(tokenizer: Tokenizer, messages: tuple[Message, ...], add_generation_prompt: bool = True) -> list[int]:
    try:
        return tokenizer.encode_chat([message_body(m) for m in messages], add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), param="messages", code="invalid_messages") from None


def _prompt_tokens(prompt: str | tuple[int, ...], tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{tokenizer.vocab_size - 1})", param="prompt")
    return list(prompt)


def _sampling(req: Request, prompt_len: int, max_model_len: int) -> SamplingParams:
    """The contract's sampling with the engine's defaults filled in and the context length checked."""
    if prompt_len >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for a completion.",
            param="messages" if req.kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    s: Sampling = req.sampling
    max_tokens = s.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len  # vLLM's default: whatever the context leaves
    elif prompt_len + max_tokens > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion).",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if s.temperature is None else s.temperature,
        top_p=1.0 if s.top_p is None else s.top_p,
        seed=s.seed,
        stop=s.stop,
        ignore_eos=s.ignore_eos,
    )


def _kv_transfer(req: Request) -> KVTransferParams | None:
    params = req.kv_transfer_params
    if not params or not (params.get("do_remote_decode") or params.get("do_remote_prefill")):
        return None
    f = Fields(params, "kv_transfer_params.")
    do_remote_decode = f.boolean("do_remote_decode")
    do_remote_prefill = f.boolean("do_remote_prefill")
    if do_remote_decode and do_remote_prefill:
        raise InvalidRequest("kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive", param="kv_transfer_params")
    transfer_id = f.string("transfer_id", required=True) or ""
    decode_kv_addr = f.string("decode_kv_addr", required=do_remote_decode)
    if decode_kv_addr is not None:
        host, _, port = decode_kv_addr.rpartition(":")
        if not host or not port.isdigit():
            raise f.bad("decode_kv_addr", f"must be host:port, got {decode_kv_addr!r}.")
    return KVTransferParams(do_remote_decode, do_remote_prefill, transfer_id, decode_kv_addr)


# -- responses -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponseIds:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, kind: Kind, request_id: str, model: str) -> ResponseIds:
        return cls(f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}", int(time.time()), model)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def completion_body(kind: Kind, ids: ResponseIds, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": ids.id,
        "object": obj,
        "created": ids.created,
        "model": ids.model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chunk_body(kind: Kind, ids: ResponseIds, text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
    """One streamed chunk; the first chat chunk carries `role: assistant`."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": ids.id, "object": obj, "created": ids.created, "model": ids.model, "choices": [choice]}


def usage_chunk(kind: Kind, ids: ResponseIds, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The final `stream_options.include_usage` chunk: empty `choices`, then `usage`."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": ids.id, "object": obj, "created": ids.created, "model": ids.model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
