"""What a backend can honour, as a value, and the one check of a request against it.

`fit(request, caps)` refuses what the backend cannot do (400 `unsupported_parameter` naming the
field, never silently ignored) and drops what has no effect on it (tool definitions with
tool_choice auto/none, for a model that never calls tools: agents always send their tool list).
The engine checks requests against its own value (`CPU_ENGINE` until it does more); the router
against what every backend it may pick declares (issue 10): learned from our engine's GET /health
`"capabilities": [flag names]`, or set per pool in router/settings.toml (`capabilities = "vllm"`,
a preset, or a list of flag names) for backends that report nothing (vLLM). `PRESETS["vllm"]` is
everything vLLM's OpenAI server takes (vllm/entrypoints/openai/protocol.py `ChatCompletionRequest`,
`CompletionRequest`), so those requests pass through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

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

    @property
    def names(self) -> tuple[str, ...]:
        """The flags that are set, in declaration order (what GET /health reports)."""
        return tuple(name for name in FLAGS if getattr(self, name))

    def __and__(self, other: Capabilities) -> Capabilities:
        """What both backends honour (a request may land on either)."""
        if other == self:  # the usual pools: every backend alike (asked per request, so not rebuilt each time)
            return self
        return Capabilities(**{name: getattr(self, name) and getattr(other, name) for name in FLAGS})


FLAGS: tuple[str, ...] = tuple(f.name for f in fields(Capabilities))
CPU_ENGINE = Capabilities()  # the numpy engine (stack/engine) before it does the extras
VLLM = Capabilities(**dict.fromkeys(FLAGS, True))
PRESETS: dict[str, Capabilities] = {"none": CPU_ENGINE, "vllm": VLLM}

# vLLM request fields outside the contract (vllm/entrypoints/openai/protocol.py, ChatCompletionRequest's and
# CompletionRequest's "-- begin of vLLM-specific sampling/extra parameters --" blocks), forwarded unchanged only
# where every backend is declared vLLM (settings.toml `capabilities = "vllm"`): no flag an engine reports can claim
# them, since an engine that does not know a field ignores it (vLLM's parser, and ours, drop unknown fields). Elsewhere
# they are the unknown-parameter 400.
VLLM_EXTRAS: frozenset[str] = frozenset({
    "best_of", "use_beam_search", "length_penalty", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words",
    "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "vllm_xargs",
    "prompt_embeds", "thinking_token_budget",
})


def from_setting(value: str | tuple[str, ...] | list[str]) -> Capabilities:
    """A settings.toml `capabilities` value: a preset name ("vllm", "none") or a list of flag names.

    ValueError says what is wrong (the config loader adds file and key)."""
    if isinstance(value, str):
        if value not in PRESETS:
            raise ValueError(f"unknown preset {value!r}: use one of {', '.join(PRESETS)} or a list of flags ({', '.join(FLAGS)})")
        return PRESETS[value]
    return from_names(value)


def from_names(names: object) -> Capabilities:
    """The flags a backend reported (GET /health `capabilities`); ValueError for a name that is no flag."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"expected a list of flag names, got {names!r}")
    unknown = [n for n in names if n not in FLAGS]
    if unknown:
        raise ValueError(f"unknown capability {unknown[0]!r} (known: {', '.join(FLAGS)})")
    return Capabilities(**dict.fromkeys(names, True))

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
