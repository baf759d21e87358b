"""The one parser: an OpenAI chat or completion body in, a `Request` out, or an `InvalidRequest`
with OpenAI's `param` and `code`.

Fields outside the contract are ignored here, as vLLM does (the router refuses unknown ones
itself, as OpenAI does). Checks that need the model (its id, context length, vocabulary) and
what a backend can honour (stack.protocol.capabilities) come after, on the parsed request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stack.common.errors import InvalidRequest
from stack.protocol.bounds import bounds_for
from stack.protocol.constraints import parse_response_format, parse_structured_outputs, parse_tool_choice, parse_tools
from stack.protocol.fields import Fields, check_unicode
from stack.protocol.messages import parse_messages
from stack.protocol.types import Kind, Request, Sampling

_COMMON = frozenset({"model", "stream", "stream_options", "response_format", "structured_outputs", "kv_transfer_params"})
# Every wire field the contract reads, per kind.
FIELDS: dict[Kind, frozenset[str]] = {
    "chat": _COMMON | {"messages", "tools", "tool_choice", "parallel_tool_calls"} | {b.name for b in bounds_for("chat")},
    "completion": _COMMON | {"prompt"} | {b.name for b in bounds_for("completion")},
}


_ROWS = {kind: {b.name: b for b in bounds_for(kind)} for kind in FIELDS}


def parse(kind: Kind, body: dict[str, Any], *, labels: Mapping[str, str] | None = None, checked: bool = False) -> Request:
    """Validate `body` as a `kind` request; `labels` renames fields in error messages (see Fields). `checked`: every
    string in `body` came from decode_body (or a translation of one), which refused lone surrogates already; the
    walk for them is skipped (it encodes the whole body: ~0.3 ms for an agent's 30 kB request)."""
    if not checked:
        check_unicode(body, labels=labels)
    f = Fields(body, labels=labels)
    model = f.string("model", required=True) or ""
    messages = parse_messages(f) if kind == "chat" else ()
    prompt = parse_prompt(f) if kind == "completion" else ""
    stream = f.boolean("stream")
    options = f.nested("stream_options")
    include_usage = options.boolean("include_usage") if options is not None else False
    if options is not None and options.body and not stream:
        raise f.bad("stream_options", "only allowed when 'stream' is true.")
    sampling = _sampling(kind, f)
    tools = parse_tools(f) if kind == "chat" and "tools" in body else ()
    tool_choice = parse_tool_choice(f, tools) if kind == "chat" else None
    parallel = None if kind == "completion" or body.get("parallel_tool_calls") is None else f.boolean("parallel_tool_calls")
    return Request(kind, model, messages, prompt, stream, include_usage, sampling, tools, tool_choice, parallel,
                   parse_response_format(f), parse_structured_outputs(f), f.obj("kv_transfer_params"))


def parse_prompt(f: Fields) -> str | tuple[int, ...]:
    """`prompt`: a string or token ids, or a batch of one of those (vLLM takes batches; one choice per request here)."""
    prompt = f.body.get("prompt")
    if prompt is None:
        raise InvalidRequest(f"Missing required parameter: '{f.label('prompt')}'.", param=f.label("prompt"),
                             code="missing_required_parameter")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise InvalidRequest(f"Unsupported parameter: 'prompt' holds {len(prompt)} prompts; send one prompt per request.",
                                 param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise f.bad("prompt", f"token ids must be >= 0, got {min(prompt)}.")
        return tuple(prompt)
    raise f.wrong("prompt", "a string, an array of token ids, or an array with one of those", prompt)


def _sampling(kind: Kind, f: Fields) -> Sampling:
    # Only the fields the client set are read (the rest keep Sampling's "unset" defaults): this runs on every request.
    rows = _ROWS[kind]
    v = {name: f.bounded(rows[name]) for name, value in f.body.items() if value is not None and name in rows}
    if "max_completion_tokens" in v:
        v["max_tokens"] = v.pop("max_completion_tokens")
    if kind == "chat" and ("logprobs" in v or "top_logprobs" in v):
        wants, top = v.pop("logprobs", False), v.pop("top_logprobs", 0)
        if top and not wants:
            raise f.bad("top_logprobs", "needs 'logprobs' set to true.")
        if wants:
            v["logprobs"] = top
    if v.get("min_tokens") is not None and v.get("max_tokens") is not None and v["min_tokens"] > v["max_tokens"]:
        raise f.bad("min_tokens", f"must be <= max_tokens ({v['max_tokens']}), got {v['min_tokens']}.")
    return Sampling(**v)
