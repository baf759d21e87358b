"""The frozen request types: what an engine receives on /v1/chat/completions and /v1/completions.

Field names follow the OpenAI wire names vLLM accepts (vllm/entrypoints/openai/protocol.py,
`ChatCompletionRequest` / `CompletionRequest`); a value of None (or an empty tuple) means the client
left it unset, so the engine resolves its own default and the serialiser leaves the key out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["chat", "completion"]
Role = Literal["system", "user", "assistant", "tool"]  # "developer" is read as "system" (what chat templates know)
Json = dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """One function call an assistant message made (OpenAI `tool_calls[i]`, type "function")."""

    id: str
    name: str
    arguments: str  # JSON text, exactly as the model produced it (OpenAI never parses it)


@dataclass(frozen=True)
class Message:
    """One chat message; content is the text (text parts joined)."""

    role: Role
    content: str | None  # None only for an assistant message that carries tool_calls
    name: str | None = None  # OpenAI's optional participant name
    tool_calls: tuple[ToolCall, ...] = ()  # role assistant
    tool_call_id: str | None = None  # role tool: the call this message answers


@dataclass(frozen=True)
class Tool:
    """A function the model may call (OpenAI `tools[i]`, type "function")."""

    name: str
    description: str | None = None
    parameters: Json | None = None  # JSON Schema of the arguments
    strict: bool | None = None


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI `tool_choice`: "none", "auto", "required", or one named function."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None  # mode "function": the tool that must be called


@dataclass(frozen=True)
class ResponseFormat:
    """OpenAI `response_format`; json_schema carries the schema object's fields."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema.name (required by OpenAI for json_schema)
    schema: Json | None = None
    strict: bool | None = None
    description: str | None = None


@dataclass(frozen=True)
class StructuredOutputs:
    """vLLM's `structured_outputs` (vllm/sampling_params.py `StructuredOutputsParams`): exactly one constraint."""

    json: Json | str | None = None  # a JSON Schema (object or its text)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # an EBNF / Lark grammar


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens and when to stop; every field is in the bounds table (stack.protocol.bounds)."""

    max_tokens: int | None = None  # max_completion_tokens or max_tokens (the former wins, as in vLLM)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM: 0 or -1 = off
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM: 1 = off
    min_tokens: int | None = None
    ignore_eos: bool = False  # vLLM's extension (sent by `vllm bench serve`)
    logprobs: int | None = None  # how many top logprobs per token; None = no logprobs (vLLM's SamplingParams.logprobs)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs in the client's order


@dataclass(frozen=True)
class Request:
    """A validated chat or completion request, as any engine (ours or vLLM) receives it."""

    kind: Kind
    model: str
    messages: tuple[Message, ...] = ()  # kind "chat"
    prompt: str | tuple[int, ...] = ""  # kind "completion": text or token ids
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    sampling: Sampling = field(default_factory=Sampling)
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    kv_transfer_params: Json | None = None  # the PD hand-off: opaque here, the engine reads its keys
