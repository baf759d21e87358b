"""What a backend can honour, as a value, and the one check of a request against it.

`fit(request, caps)` refuses what the backend cannot do (400 `unsupported_parameter` naming the
field, never silently ignored) and drops what has no effect on it (tool definitions with
tool_choice auto/none, for a model that never calls tools: agents always send their tool list).
Router and engine both call it; for now both use `CPU_ENGINE`. A backend kind with more
abilities (vLLM) is another `Capabilities` value, chosen per backend.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from stack.common.errors import InvalidRequest
from stack.protocol.types import Request, Sampling


@dataclass(frozen=True)
class Capabilities:
    """Flags for what a backend honours beyond temperature, top_p, seed, stop strings, ignore_eos and max_tokens."""

    tools: bool = False  # uses tool definitions, emits tool calls, reads tool results
    forced_tool_choice: bool = False  # tool_choice "required" or a named function
    multiple_choices: bool = False  # n > 1
    logprobs: bool = False
    structured_outputs: bool = False  # response_format json_object / json_schema, structured_outputs
    logit_bias: bool = False
    penalties: bool = False  # presence, frequency and repetition penalties
    top_k: bool = False
    min_p: bool = False
    min_tokens: bool = False
    stop_token_ids: bool = False


CPU_ENGINE = Capabilities()  # the numpy engine (stack/engine): none of the extras

_NOT_SUPPORTED = "is not supported by this deployment"
# Sampling field -> (flag it needs, values that mean "off" and need nothing, why it is refused)
_SAMPLING_NEEDS: dict[str, tuple[str, tuple[object, ...], str]] = {
    "n": ("multiple_choices", (1,), "must be 1: this deployment returns one choice per request"),
    "logprobs": ("logprobs", (), _NOT_SUPPORTED),
    "logit_bias": ("logit_bias", ((),), _NOT_SUPPORTED),
    "presence_penalty": ("penalties", (0,), f"{_NOT_SUPPORTED} (only 0)"),
    "frequency_penalty": ("penalties", (0,), f"{_NOT_SUPPORTED} (only 0)"),
    "repetition_penalty": ("penalties", (1,), f"{_NOT_SUPPORTED} (only 1)"),
    "top_k": ("top_k", (0, -1), f"{_NOT_SUPPORTED} (only 0 or -1: no top-k)"),
    "min_p": ("min_p", (0,), f"{_NOT_SUPPORTED} (only 0)"),
    "min_tokens": ("min_tokens", (0,), f"{_NOT_SUPPORTED} (only 0)"),
    "stop_token_ids": ("stop_token_ids", ((),), f"{_NOT_SUPPORTED}; use 'stop' strings"),
}


def unsupported(param: str, why: str) -> InvalidRequest:
    """The 400 for a parameter this deployment cannot honour (OpenAI's wording)."""
    return InvalidRequest(f"Unsupported parameter: '{param}' {why}.", param=param, code="unsupported_parameter")


def fit(request: Request, caps: Capabilities) -> Request:
    """`request` as the backend with `caps` receives it, or the 400 for the first thing it cannot honour."""
    _check_sampling(request.sampling, caps)
    if not caps.tools:
        for i, message in enumerate(request.messages):
            if message.role == "tool":
                raise InvalidRequest(f"Unsupported message role 'tool' at 'messages[{i}].role': this deployment has no tool calling.",
                                     param=f"messages[{i}].role", code="unsupported_parameter")
            if message.tool_calls:
                raise unsupported(f"messages[{i}].tool_calls", "cannot be replayed: this deployment has no tool calling")
    choice = request.tool_choice
    if choice is not None and choice.mode in ("required", "function") and not (caps.tools and caps.forced_tool_choice):
        raise unsupported("tool_choice", "may only be \"auto\" or \"none\": this model never calls tools")
    if not caps.structured_outputs:
        if request.response_format is not None and request.response_format.type != "text":
            raise unsupported("response_format", "other than {\"type\": \"text\"} " + _NOT_SUPPORTED)
        if request.structured_outputs is not None:
            raise unsupported("structured_outputs", _NOT_SUPPORTED)
    if not caps.tools and (request.tools or request.tool_choice or request.parallel_tool_calls is not None):
        request = replace(request, tools=(), tool_choice=None, parallel_tool_calls=None)  # no effect on this backend
    return request


def _check_sampling(sampling: Sampling, caps: Capabilities) -> None:
    for name, (flag, off, why) in _SAMPLING_NEEDS.items():
        value = getattr(sampling, name)
        if value is not None and value not in off and not getattr(caps, flag):
            raise unsupported(name, why)
