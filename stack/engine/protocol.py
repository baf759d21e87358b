"""OpenAI request bodies in, typed objects out; typed results in, OpenAI response and chunk bodies out.

`parse_request` reads a `/v1/chat/completions` or `/v1/completions` body with the shared contract
(stack.protocol: the same parser, bounds and capability check as the router, so both give the same
verdict), then does the engine's own part: the model id, tokenizing, the context length, and
resolving defaults into the concrete `SamplingParams` the scheduler runs. Fields outside the
contract are ignored, as vLLM does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any

from stack.common.errors import InvalidRequest, NotFound
from stack.engine import grammar
from stack.engine.errors import ChatTemplateError
from stack.engine.tokenizer import Tokenizer
from stack.protocol.capabilities import Capabilities, fit
from stack.protocol.constraints import parse_tools
from stack.protocol.fields import Fields
from stack.protocol.messages import parse_messages
from stack.protocol.parse import parse, parse_prompt
from stack.protocol.serialise import message_body
from stack.protocol.types import Kind, Message, Request, Sampling, Tool

# The numpy engine does every extra for real (sampling.py, grammar.py, tool_parser.py): all flags on.
ENGINE_CAPABILITIES = Capabilities(**{f.name: True for f in fields(Capabilities)})


def capability_names(caps: Capabilities = ENGINE_CAPABILITIES) -> list[str]:
    """The flag names /health reports (the router learns them with the model)."""
    return [f.name for f in fields(Capabilities) if getattr(caps, f.name)]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop."""

    max_tokens: int  # new tokens at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # None: a random seed per request
    stop: tuple[str, ...] = ()  # strings that end the completion (not included in the text)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past end-of-sequence (benchmarks)
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    min_tokens: int = 0  # EOS and stop_token_ids are banned before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # ids that end the completion like EOS (not in the text)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's logprob and the k most likely
    grammar: str | None = None  # llguidance grammar the output must follow (grammar.py); EOS only where it accepts

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


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
    n: int = 1  # choices, each its own sequence and seed stream
    tools: tuple[Tool, ...] = ()  # tool calls are parsed from the output (tool_parser.py) when set
    forced_tool: bool = False  # tool_choice required / named: the output is constrained to tool calls


def parse_request(kind: Kind, data: dict[str, Any], *, model_id: str, tokenizer: Tokenizer, max_model_len: int) -> CompletionRequest:
    """Validate `data` and tokenize its prompt; every client mistake is an `InvalidRequest` (400)."""
    req = parse(kind, data)
    if req.model != model_id:
        raise NotFound(f"The model `{req.model}` does not exist. This engine serves `{model_id}`.", code="model_not_found", param="model")
    req = fit(req, ENGINE_CAPABILITIES)
    choice = req.tool_choice
    tools = req.tools if choice is None or choice.mode != "none" else ()
    if kind == "chat":
        prompt_tokens = _chat_tokens(tokenizer, req.messages, tools=req.tools if tools else ())
    else:
        prompt_tokens = _prompt_tokens(req.prompt, tokenizer)
    if not prompt_tokens:
        raise InvalidRequest("the prompt is empty", param="prompt" if kind == "completion" else "messages")
    sampling = _sampling(req, len(prompt_tokens), max_model_len, tokenizer)
    kv_transfer = _kv_transfer(req)
    if kv_transfer is not None and kv_transfer.do_remote_decode and req.stream:
        raise InvalidRequest("the prefill leg (do_remote_decode) must be stream=false", param="stream")
    n = req.sampling.n or 1
    if n > 1 and kv_transfer is not None:
        raise InvalidRequest("Unsupported parameter: 'n' must be 1 on the disaggregated (prefill/decode) path of this engine; "
                             "send n > 1 to a colocated engine.", param="n", code="unsupported_parameter")
    forced = choice is not None and choice.mode in ("required", "function")
    return CompletionRequest(kind, req.model, tuple(prompt_tokens), sampling, req.stream, req.include_usage, kv_transfer,
                             n, tools, forced)


def parse_tokenize(data: dict[str, Any], *, model_id: str, tokenizer: Tokenizer) -> list[int]:
    """POST /tokenize as vLLM takes it: `prompt`, or `messages` (+ `add_generation_prompt`, default true)."""
    f = Fields(data)
    model = f.string("model")
    if model is not None and model != model_id:
        raise NotFound(f"The model `{model}` does not exist. This engine serves `{model_id}`.", code="model_not_found", param="model")
    if "messages" not in data:
        return _prompt_tokens(parse_prompt(f), tokenizer)
    tools = parse_tools(f) if "tools" in data else ()
    return _chat_tokens(tokenizer, parse_messages(f), add_generation_prompt=f.boolean("add_generation_prompt", default=True), tools=tools)


def parse_detokenize(data: dict[str, Any], *, model_id: str, tokenizer: Tokenizer) -> list[int]:
    """POST /detokenize as vLLM takes it (vllm/entrypoints/openai/protocol.py `DetokenizeRequest`: model, tokens)."""
    f = Fields(data)
    model = f.string("model")
    if model is not None and model != model_id:
        raise NotFound(f"The model `{model}` does not exist. This engine serves `{model_id}`.", code="model_not_found", param="model")
    tokens = data.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise f.wrong("tokens", "an array of token ids", tokens) if "tokens" in data else InvalidRequest(
            "Missing required parameter: 'tokens'.", param="tokens", code="missing_required_parameter")
    _check_ids(tokens, tokenizer.vocab_size, "tokens")
    return tokens


def _chat_tokens(tokenizer: Tokenizer, messages: tuple[Message, ...], add_generation_prompt: bool = True,
                 tools: tuple[Tool, ...] = ()) -> list[int]:
    try:
        return tokenizer.encode_chat([message_body(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                     tools=[tool_body(t) for t in tools] or None)
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), param="messages", code="invalid_messages") from None


def _prompt_tokens(prompt: str | tuple[int, ...], tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{tokenizer.vocab_size - 1})", param="prompt")
    return list(prompt)


def tool_body(tool: Tool) -> dict[str, Any]:
    """A tool as Hugging Face's apply_chat_template receives it ({"type": "function", "function": {…}})."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _constraint(req: Request, tokenizer: Tokenizer) -> str | None:
    """The llguidance grammar the request's output must follow, or None; a bad one is a 400 naming its field."""
    so, fmt, choice = req.structured_outputs, req.response_format, req.tool_choice
    if choice is not None and choice.mode in ("required", "function"):
        param, source = "tool_choice", lambda: grammar.tool_call_grammar(req.tools, choice.name, req.parallel_tool_calls is not False)
        if not req.tools:
            raise InvalidRequest(f"Invalid value for 'tool_choice': {choice.mode!r} needs 'tools'.", param="tool_choice",
                                 code="invalid_value")
    elif so is not None:
        kind = next(k for k in ("json", "regex", "choice", "grammar") if getattr(so, k) is not None)
        param, source = f"structured_outputs.{kind}", lambda: grammar.grammar_of(kind, getattr(so, kind))
    elif fmt is not None and fmt.type == "json_object":
        param, source = "response_format", lambda: grammar.grammar_of("json_object", None)
    elif fmt is not None and fmt.type == "json_schema":
        param, source = "response_format.json_schema.schema", lambda: grammar.grammar_of("json", fmt.schema or {"type": "object"})
    else:
        return None
    try:
        text = source()
        grammar.validate(text, tokenizer)
    except (grammar.GrammarError, ValueError, TypeError) as exc:
        raise InvalidRequest(f"Invalid value for '{param}': the grammar does not compile: {exc}", param=param,
                             code="invalid_grammar") from None
    return text


def _check_ids(ids: list[int], vocab: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"Invalid value for '{param}': token id {bad[0]} is outside the vocabulary (0..{vocab - 1}).", param=param,
                             code="invalid_value")


def _sampling(req: Request, prompt_len: int, max_model_len: int, tokenizer: Tokenizer) -> SamplingParams:
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
    _check_ids(list(s.stop_token_ids), tokenizer.vocab_size, "stop_token_ids")
    _check_ids([t for t, _ in s.logit_bias], tokenizer.vocab_size, "logit_bias")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if s.temperature is None else s.temperature,
        top_p=1.0 if s.top_p is None else s.top_p,
        seed=s.seed,
        stop=s.stop,
        ignore_eos=s.ignore_eos,
        top_k=max(s.top_k or 0, 0),
        min_p=s.min_p or 0.0,
        min_tokens=s.min_tokens or 0,
        stop_token_ids=s.stop_token_ids,
        presence_penalty=s.presence_penalty or 0.0,
        frequency_penalty=s.frequency_penalty or 0.0,
        repetition_penalty=1.0 if s.repetition_penalty is None else s.repetition_penalty,
        logit_bias=s.logit_bias,
        logprobs=s.logprobs,
        grammar=_constraint(req, tokenizer),
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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI usage; cached_tokens: prompt tokens whose KV came from the prefix cache, not computed."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice_body(kind: Kind, index: int, text: str | None, finish_reason: str, logprobs: dict[str, Any] | None = None,
                tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One non-streamed choice; a chat message with tool calls has `content` None when it has no text."""
    if kind == "completion":
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not tool_calls else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_body(kind: Kind, ids: ResponseIds, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "id": ids.id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": ids.created,
        "model": ids.model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
    }


def chunk_body(kind: Kind, ids: ResponseIds, text: str | None, finish_reason: str | None, first: bool, *, index: int = 0,
               logprobs: dict[str, Any] | None = None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One streamed chunk of choice `index`; the first chat chunk of a choice carries `role: assistant`."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or (first and not tool_calls):
            delta["content"] = text or ""
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": ids.id, "object": obj, "created": ids.created, "model": ids.model, "choices": [choice]}


def usage_chunk(kind: Kind, ids: ResponseIds, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The final `stream_options.include_usage` chunk: empty `choices`, then `usage`."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": ids.id, "object": obj, "created": ids.created, "model": ids.model, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
