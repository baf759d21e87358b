"""OpenAI request bodies in, typed objects out; typed results in, OpenAI response and chunk bodies out.

`parse_request` validates a `/v1/chat/completions` or `/v1/completions` body (raising
`InvalidRequest`/`NotFound` with OpenAI's `param` and `code`) and tokenizes the prompt. Fields we do
not implement but clients commonly send (frequency_penalty, user, …) are ignored, as vLLM does;
ones that would change the answer's shape (`n` > 1, `logprobs`) are refused.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

from stack.common.errors import InvalidRequest, NotFound
from stack.engine.errors import ChatTemplateError
from stack.engine.tokenizer import Tokenizer

Kind = Literal["chat", "completion"]
MAX_STOP_SEQUENCES = 4  # OpenAI's limit


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
    model = _field(data, "model", str, required=True)
    if model != model_id:
        raise NotFound(f"The model `{model}` does not exist. This engine serves `{model_id}`.", code="model_not_found", param="model")
    if kind == "chat":
        messages = _messages(data)
        try:
            prompt_tokens = tokenizer.encode_chat(messages)
        except ChatTemplateError as exc:
            raise InvalidRequest(str(exc), param="messages", code="invalid_messages") from None
    else:
        prompt_tokens = _prompt_tokens(data, tokenizer)
    if not prompt_tokens:
        raise InvalidRequest("the prompt is empty", param="prompt" if kind == "completion" else "messages")
    n = _field(data, "n", int)
    if n is not None and n != 1:
        raise InvalidRequest(f"n={n} is not supported; this engine returns one choice (n=1)", param="n")
    if data.get("logprobs") not in (None, False, 0) or data.get("top_logprobs"):
        raise InvalidRequest("`logprobs` is not supported by this engine", param="logprobs")
    sampling = _sampling(data, len(prompt_tokens), max_model_len)
    stream = bool(_field(data, "stream", bool))
    options = _field(data, "stream_options", dict)
    include_usage = False
    if options is not None:
        if not stream:
            raise InvalidRequest("stream_options is only allowed with stream=true", param="stream_options")
        include_usage = bool(_field(options, "include_usage", bool, prefix="stream_options."))
    kv_transfer = _kv_transfer(data)
    if kv_transfer is not None and kv_transfer.do_remote_decode and stream:
        raise InvalidRequest("the prefill leg (do_remote_decode) must be stream=false", param="stream")
    return CompletionRequest(kind, model, tuple(prompt_tokens), sampling, stream, include_usage, kv_transfer)


def parse_tokenize(data: dict[str, Any], *, model_id: str, tokenizer: Tokenizer) -> list[int]:
    """POST /tokenize as vLLM takes it: `prompt`, or `messages` (+ `add_generation_prompt`, default true)."""
    model = _field(data, "model", str)
    if model is not None and model != model_id:
        raise NotFound(f"The model `{model}` does not exist. This engine serves `{model_id}`.", code="model_not_found", param="model")
    if "messages" not in data:
        return _prompt_tokens(data, tokenizer)
    add_generation_prompt = _field(data, "add_generation_prompt", bool)
    try:
        return tokenizer.encode_chat(_messages(data), add_generation_prompt=add_generation_prompt is not False)
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), param="messages", code="invalid_messages") from None


def _field(data: dict[str, Any], key: str, tp: type, *, required: bool = False, prefix: str = "") -> Any:
    value = data.get(key)
    if value is None:
        if required:
            raise InvalidRequest(f"`{prefix}{key}` is required", param=f"{prefix}{key}", code="missing_required_parameter")
        return None
    ok = isinstance(value, tp) and not (tp in (int, float) and isinstance(value, bool))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object", list: "an array"}
        raise InvalidRequest(
            f"`{prefix}{key}` must be {names[tp]}, got {type(value).__name__} {json.dumps(value)[:40]}",
            param=f"{prefix}{key}",
            code="invalid_type",
        )
    return value


def _messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    messages = _field(data, "messages", list, required=True)
    if not messages:
        raise InvalidRequest("`messages` must contain at least one message", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"`messages[{i}]` must be an object", param=f"messages[{i}]", code="invalid_type")
        _field(message, "role", str, required=True, prefix=f"messages[{i}].")
        content = message.get("content")
        text_parts = isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content)
        if content is not None and not isinstance(content, str) and not text_parts:
            raise InvalidRequest(
                f"`messages[{i}].content` must be a string or a list of text parts", param=f"messages[{i}].content", code="invalid_type"
            )
    return messages


def _prompt_tokens(data: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = data.get("prompt")
    if prompt is None:
        raise InvalidRequest("`prompt` is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{tokenizer.vocab_size - 1})", param="prompt")
        return list(prompt)
    raise InvalidRequest("`prompt` must be a string, a list of token ids, or a list with one of those", param="prompt", code="invalid_type")


def _sampling(data: dict[str, Any], prompt_len: int, max_model_len: int) -> SamplingParams:
    if prompt_len >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for a completion.",
            param="messages",
            code="context_length_exceeded",
        )
    key = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(data, key, int)
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len  # vLLM's default: whatever the context leaves
    elif max_tokens <= 0:
        raise InvalidRequest(f"`{key}` must be at least 1, got {max_tokens}", param=key)
    elif prompt_len + max_tokens > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion).",
            param=key,
            code="context_length_exceeded",
        )
    temperature = _field(data, "temperature", float)
    if temperature is not None and not 0 <= temperature <= 2:
        raise InvalidRequest(f"`temperature` must be between 0 and 2, got {temperature}", param="temperature")
    top_p = _field(data, "top_p", float)
    if top_p is not None and not 0 < top_p <= 1:
        raise InvalidRequest(f"`top_p` must be in (0, 1], got {top_p}", param="top_p")
    seed = _field(data, "seed", int)
    stop = data.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise InvalidRequest("`stop` must be a non-empty string or a list of them", param="stop", code="invalid_type")
    if stop is not None and len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"`stop` allows at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}", param="stop")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=seed,
        stop=tuple(stop or ()),
        ignore_eos=bool(_field(data, "ignore_eos", bool)),
    )


def _kv_transfer(data: dict[str, Any]) -> KVTransferParams | None:
    params = _field(data, "kv_transfer_params", dict)
    if not params or not (params.get("do_remote_decode") or params.get("do_remote_prefill")):
        return None
    p = "kv_transfer_params."
    do_remote_decode = bool(_field(params, "do_remote_decode", bool, prefix=p))
    do_remote_prefill = bool(_field(params, "do_remote_prefill", bool, prefix=p))
    if do_remote_decode and do_remote_prefill:
        raise InvalidRequest("kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive", param="kv_transfer_params")
    transfer_id = _field(params, "transfer_id", str, required=True, prefix=p)
    decode_kv_addr = _field(params, "decode_kv_addr", str, required=do_remote_decode, prefix=p)
    if decode_kv_addr is not None:
        host, _, port = decode_kv_addr.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidRequest(f"`{p}decode_kv_addr` must be host:port, got {decode_kv_addr!r}", param=f"{p}decode_kv_addr")
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
