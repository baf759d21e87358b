"""The contract parser: each client mistake is an InvalidRequest with OpenAI's wording, `param` and `code`."""

from __future__ import annotations

from typing import Any

import pytest

from stack.common.errors import InvalidRequest
from stack.protocol.parse import FIELDS, parse
from stack.protocol.types import Message, ResponseFormat, StructuredOutputs, Tool, ToolCall, ToolChoice

USER = [{"role": "user", "content": "hi"}]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **extra}


def refused(kind: str, body: dict[str, Any], labels: dict[str, str] | None = None) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse(kind, body, labels=labels)  # type: ignore[arg-type]
    return info.value


MISTAKES = [
    ("chat", {"messages": USER}, "model", "missing_required_parameter", "Missing required parameter: 'model'."),
    ("chat", {"model": "m"}, "messages", "missing_required_parameter", "Missing required parameter: 'messages'."),
    ("chat", chat(messages=[]), "messages", "invalid_value", "must contain at least one message"),
    ("chat", chat(messages=["hi"]), "messages[0]", "invalid_type", "expected an object"),
    ("chat", chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", "invalid_value", "expected one of system"),
    ("chat", chat(messages=[{"role": "user"}]), "messages[0].content", "missing_required_parameter", "'messages[0].content'"),
    ("chat", chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_type", "string or an array of content parts"),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content[0]", "unsupported_content",
     "(type 'image_url')"),
    ("chat", chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id", "missing_required_parameter", "tool_call_id"),
    ("chat", chat(messages=[{"role": "function", "content": "x"}]), "messages[0].role", "unsupported_parameter", "deprecated function role"),
    ("chat", chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "f"}}]}]),
     "messages[0].tool_calls[0].function.arguments", "missing_required_parameter", "arguments"),
    ("chat", chat(max_tokens="ten"), "max_tokens", "invalid_type", "Invalid type for 'max_tokens': expected an integer, got a string."),
    ("chat", chat(max_tokens=0), "max_tokens", "invalid_value", "Invalid value for 'max_tokens': must be >= 1, got 0."),
    ("chat", chat(temperature=2.5), "temperature", "invalid_value", "must be between 0 and 2, got 2.5."),
    ("chat", chat(top_p=0), "top_p", "invalid_value", "must be in (0, 1], got 0."),
    ("chat", chat(temperature=float("nan")), "temperature", "invalid_value", "must be a finite number"),
    ("chat", chat(repetition_penalty=0), "repetition_penalty", "invalid_value", "must be > 0, got 0."),
    ("chat", chat(seed=2**63), "seed", "invalid_value", "must be between"),
    ("chat", chat(stop=""), "stop", "invalid_value", "must not be empty"),
    ("chat", chat(stop=["a"] * 5), "stop", "invalid_value", "at most 4 sequences, got 5."),
    ("chat", chat(stop=[1]), "stop", "invalid_type", "expected a string or an array of strings"),
    ("chat", chat(stop_token_ids=[-1]), "stop_token_ids", "invalid_value", "token ids must be >= 0"),
    ("chat", chat(logit_bias={"7": 101}), "logit_bias", "invalid_value", "the bias for token 7 must be between -100 and 100"),
    ("chat", chat(logit_bias={"seven": 1}), "logit_bias", "invalid_value", "keys must be token ids"),
    ("chat", chat(top_logprobs=2), "top_logprobs", "invalid_value", "needs 'logprobs' set to true"),
    ("chat", chat(min_tokens=5, max_tokens=4), "min_tokens", "invalid_value", "must be <= max_tokens (4)"),
    ("chat", chat(stream="yes"), "stream", "invalid_type", "expected true or false"),
    ("chat", chat(stream_options={"include_usage": True}), "stream_options", "invalid_value", "only allowed when 'stream' is true"),
    ("chat", chat(stream=True, stream_options={"include_usage": "y"}), "stream_options.include_usage", "invalid_type", "true or false"),
    ("chat", chat(tools=[{"type": "function", "function": {}}]), "tools[0].function.name", "missing_required_parameter", "name"),
    ("chat", chat(tools=[{"type": "retrieval"}]), "tools[0].type", "unsupported_parameter", "only 'function' tools"),
    ("chat", chat(tool_choice="sometimes"), "tool_choice", "invalid_value", "expected one of none, auto, required"),
    ("chat", chat(tools=[{"function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice",
     "invalid_value", "'g' is not among 'tools'"),
    ("chat", chat(response_format={"type": "xml"}), "response_format.type", "invalid_value", "expected one of text, json_object"),
    ("chat", chat(response_format={"type": "json_schema"}), "response_format.json_schema", "missing_required_parameter", "json_schema"),
    ("chat", chat(structured_outputs={}), "structured_outputs", "invalid_value", "exactly one of json, regex, choice, grammar, got 0"),
    ("chat", chat(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs", "invalid_value", "got 2"),
    ("chat", chat(structured_outputs={"json_object": True}), "structured_outputs.json_object", "unsupported_parameter", "only json"),
    ("chat", chat(kv_transfer_params=[1]), "kv_transfer_params", "invalid_type", "expected an object"),
    ("completion", {"model": "m"}, "prompt", "missing_required_parameter", "Missing required parameter: 'prompt'."),
    ("completion", {"model": "m", "prompt": 42}, "prompt", "invalid_type", "expected a string, an array of token ids"),
    ("completion", {"model": "m", "prompt": ["a", "b"]}, "prompt", "unsupported_parameter", "send one prompt per request"),
    ("completion", {"model": "m", "prompt": [3, -1]}, "prompt", "invalid_value", "token ids must be >= 0"),
    ("completion", {"model": "m", "prompt": "x", "logprobs": 6}, "logprobs", "invalid_value", "must be between 0 and 5"),
    ("completion", {"model": "m", "prompt": "x", "logprobs": True}, "logprobs", "invalid_type", "expected an integer"),
]


@pytest.mark.parametrize(("kind", "body", "param", "code", "words"), MISTAKES, ids=[m[2] + "-" + m[3] for m in MISTAKES])
def test_each_mistake_names_its_field(kind: str, body: dict[str, Any], param: str, code: str, words: str) -> None:
    """Every mistake is a 400 whose param, code and message say exactly what is wrong."""
    err = refused(kind, body)
    assert (err.param, err.code) == (param, code)
    assert words in err.message


def test_a_full_chat_request_parses_into_the_contract_types() -> None:
    """Messages with tool calls, tools, tool_choice and the constraints come out as their frozen types."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    req = parse("chat", chat(
        messages=[{"role": "developer", "content": "sys"}, {"role": "user", "content": [{"type": "text", "text": "a"}], "name": "bo"},
                  {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "1", "tool_call_id": "c1"}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}],
        tool_choice={"type": "function", "function": {"name": "f"}}, parallel_tool_calls=False,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
        structured_outputs={"choice": ["y", "n"]}, max_completion_tokens=7, max_tokens=3, logprobs=True, top_logprobs=2,
        logit_bias={"5": -1}, stop="x", temperature=1, stream=True, stream_options={"include_usage": True}))
    assert req.messages == (Message("system", "sys"), Message("user", "a", name="bo"),
                            Message("assistant", None, tool_calls=(ToolCall("c1", "f", "{}"),)), Message("tool", "1", tool_call_id="c1"))
    assert req.tools == (Tool("f", parameters={"type": "object"}, strict=True),)
    assert req.tool_choice == ToolChoice("function", "f") and req.parallel_tool_calls is False
    assert req.response_format == ResponseFormat("json_schema", "s", {"type": "object"})
    assert req.structured_outputs == StructuredOutputs(choice=("y", "n"))
    s = req.sampling
    assert (s.max_tokens, s.logprobs, s.logit_bias, s.stop, s.temperature) == (7, 2, ((5, -1.0),), ("x",), 1.0)
    assert isinstance(s.temperature, float) and req.stream and req.include_usage


def test_unset_and_null_are_the_same() -> None:
    """A null field is read as absent, so the engine applies its own default."""
    assert parse("chat", chat(temperature=None, stop=None, n=None, seed=None)) == parse("chat", chat())


def test_fields_outside_the_contract_are_ignored_and_listed_per_kind() -> None:
    """Unknown fields are the router's to refuse (as OpenAI does); the parser ignores them (as vLLM does)."""
    assert parse("chat", chat(frobnicate=1)) == parse("chat", chat())
    assert {"messages", "top_logprobs", "tools"} <= FIELDS["chat"] and not {"prompt"} & FIELDS["chat"]
    assert {"prompt", "logprobs"} <= FIELDS["completion"] and not {"messages", "top_logprobs", "tools"} & FIELDS["completion"]


def test_labels_name_the_clients_own_field() -> None:
    """A translated request (Anthropic stop_sequences → stop) names the field the client sent."""
    err = refused("chat", chat(stop=[""]), labels={"stop": "stop_sequences"})
    assert err.param == "stop_sequences" and "'stop_sequences'" in err.message


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "messages": [{"role": "user", "content": "half an emoji \ud83d"}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, "messages[0].content[0].text"),
    ({"model": "m", "messages": [{"role": "user", "content": "ok"}], "stop": ["\ud800"]}, "stop[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "ok"}], "tools": [{"type": "function", "function": {
        "name": "f", "description": "\udfff"}}]}, "tools[0].function.description"),
])
def test_lone_surrogates_are_a_400_naming_the_field(body: dict, param: str) -> None:
    """Text no tokenizer can encode (a lone UTF-16 surrogate) is refused at parse time, router and engine alike."""
    with pytest.raises(InvalidRequest, match="lone UTF-16 surrogate") as caught:
        parse("chat", body)
    assert caught.value.param == param


def test_surrogate_pairs_are_fine() -> None:
    """A whole emoji (a valid surrogate pair in JSON) parses to one character."""
    import json

    body = json.loads('{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert parse("chat", body).messages[0].content == "\U0001F600"
