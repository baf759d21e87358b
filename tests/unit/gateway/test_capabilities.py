"""The router is a gateway: what the backends declare they can do passes through unchanged, the rest is each API's 400.

Capabilities come from the backend's GET /health `capabilities` (our engine) or settings.toml (`capabilities =
"vllm"` or a list, for backends that report nothing); in PD mode a request needs both pools' (the intersection).
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from stack.common.config import ConfigError
from stack.router import config as router_config
from stack.router.appkeys import PD
from tests.unit.gateway.backend import BACKEND_MODEL
from tests.unit.gateway.conftest import ALL_FLAGS, MODEL, log_events, settings_text

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
# Every vLLM sampling extra and vLLM-only field, as a client sends them through the openai SDK's extra_body.
VLLM_EXTRA_BODY = {"top_k": 20, "min_p": 0.05, "min_tokens": 2, "repetition_penalty": 1.1, "stop_token_ids": [7, 9],
                   "ignore_eos": True, "include_stop_str_in_output": True, "skip_special_tokens": False,
                   "spaces_between_special_tokens": False, "chat_template_kwargs": {"enable_thinking": False},
                   "structured_outputs": {"choice": ["yes", "no"]}, "length_penalty": 1.0, "priority": 0,
                   "truncate_prompt_tokens": 100, "bad_words": ["darn"], "allowed_token_ids": [1, 2, 3]}


async def test_a_backend_reporting_nothing_gets_no_tools_and_each_api_says_so(gateway, logs) -> None:
    """No capabilities: a forced tool call is the 400 of each API (openai, anthropic SDK errors), naming tool_choice."""
    gw = await gateway(capabilities=None)
    with pytest.raises(openai.BadRequestError) as chat:
        await gw.oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=5)
    assert chat.value.body["param"] == "tool_choice" and chat.value.body["code"] == "unsupported_parameter"
    with pytest.raises(anthropic.BadRequestError) as messages:
        await gw.claude.messages.create(model=MODEL, max_tokens=5, messages=USER, tool_choice={"type": "any"},
                                        tools=[{"name": "get_weather", "input_schema": {"type": "object"}}])
    assert messages.value.body["type"] == "error" and "tool_choice" in messages.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as responses:
        await gw.oai.responses.create(model=MODEL, input="hi", tool_choice="required",
                                      tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}])
    assert responses.value.body["param"] == "tool_choice"
    for extra, param in (({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"extra_body": {"top_k": 5}}, "top_k"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"extra_body": {"include_stop_str_in_output": True}}, "include_stop_str_in_output")):
        with pytest.raises(openai.BadRequestError) as refused:
            await gw.oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, **extra)
        assert refused.value.body["param"] == param, refused.value.body
    assert gw.backend.seen == []  # nothing reached the backend
    refusals = [e for e in log_events(logs) if e["event"] == "router.unsupported_parameter"]
    assert {e["param"] for e in refusals} >= {"tool_choice", "n", "top_k"} and refusals[0]["capabilities"] == []
    # Tools with tool_choice auto have no effect on such a backend: accepted, not forwarded (agents always send them).
    await gw.oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=5)
    assert "tools" not in gw.body


async def test_capabilities_are_learned_from_the_backends_health(gateway, logs) -> None:
    """The engine's GET /health `capabilities` decide: tools yes, logprobs no (named in the 400)."""
    gw = await gateway(capabilities=["tools", "forced_tool_choice", "made_up_future_flag"])
    await gw.oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=5)
    assert gw.body["tools"] == TOOLS and gw.body["tool_choice"] == "required"
    with pytest.raises(openai.BadRequestError) as refused:
        await gw.oai.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=2, max_tokens=5)
    assert refused.value.body["param"] == "logprobs"
    learned = [e for e in log_events(logs) if e["event"] == "backend.capabilities"]
    assert learned and learned[0]["capabilities"] == ["tools", "forced_tool_choice"] and learned[0]["reported_by"].startswith("GET ")


async def test_vllm_preset_passes_everything_through_unchanged(gateway) -> None:
    """settings.toml `capabilities = "vllm"` for a backend that reports nothing (vLLM): tools, tool_choice, n, logprobs,
    structured outputs and every vLLM extra (openai SDK extra_body) reach the backend exactly as sent."""
    gw = await gateway(capabilities=None, settings='capabilities = "vllm"')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    await gw.oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=7, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False, n=2, logprobs=True, top_logprobs=3, presence_penalty=0.5, frequency_penalty=0.25, seed=1,
        logit_bias={"5": 10}, response_format={"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}},
        extra_body=VLLM_EXTRA_BODY)
    body = gw.body
    sent = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
            "n": 2, "logprobs": True, "top_logprobs": 3, "presence_penalty": 0.5, "frequency_penalty": 0.25, "seed": 1,
            "logit_bias": {"5": 10}, "max_tokens": 7, "model": BACKEND_MODEL, "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}},
            **VLLM_EXTRA_BODY}
    assert {k: body.get(k) for k in sent} == sent
    # Assistant tool calls with content null and tool results replay as sent (issue 10's first symptom).
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    await gw.oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=5)
    assert gw.body["messages"] == history
    await gw.oai.completions.create(model=MODEL, prompt="x", max_tokens=3, echo=True, logprobs=2, best_of=1,
                                    extra_body={"top_k": 3, "prompt_logprobs": 1})
    assert {k: gw.body.get(k) for k in ("echo", "logprobs", "top_k", "prompt_logprobs")} == \
        {"echo": True, "logprobs": 2, "top_k": 3, "prompt_logprobs": 1}


async def test_pd_needs_both_pools_capabilities(gateway) -> None:
    """PD: a request goes through a prefill and a decode, so it needs what both declare (the intersection)."""
    gw = await gateway(capabilities=ALL_FLAGS, prefill_capabilities=None, pd=True)
    monitor = gw.router.app[PD].monitor
    assert monitor.capabilities.names == ()  # the prefill reports nothing
    with pytest.raises(openai.BadRequestError) as refused:
        await gw.oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=5)
    assert refused.value.body["param"] == "tool_choice"
    both = await gateway(capabilities=ALL_FLAGS, prefill_capabilities=["tools", "forced_tool_choice", "logprobs"], pd=True)
    assert both.router.app[PD].monitor.capabilities.names == ("tools", "forced_tool_choice", "logprobs")
    preset = await gateway(capabilities=["tools"], prefill_settings='capabilities = "vllm"', pd=True)
    assert preset.router.app[PD].monitor.capabilities.names == ("tools",)


@pytest.mark.parametrize("value, problem", [('"gpu"', "unknown preset 'gpu'"), ('["tools", "telepathy"]', "unknown capability 'telepathy'"),
                                            ("3", "expected")])
def test_capabilities_setting_is_validated_at_load(tmp_path, value, problem) -> None:
    path = tmp_path / "settings.toml"
    path.write_text(settings_text(tmp_path, "http://a:8000", "http://a:8000", decode_caps=f"capabilities = {value}"))
    with pytest.raises(ConfigError) as err:
        router_config.load(path, env={})
    assert err.value.key == "decode.capabilities" and problem in err.value.problem and str(path) in str(err.value)


async def test_translated_apis_name_their_own_fields_in_refusals(gateway) -> None:
    """No structured outputs: Anthropic's refusal names output_config.format, Responses' text.format."""
    gw = await gateway(capabilities=["tools"])
    schema = {"type": "object"}
    with pytest.raises(anthropic.BadRequestError) as messages:
        await gw.claude.messages.create(model=MODEL, max_tokens=5, messages=USER,
                                        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert "'output_config.format'" in messages.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as responses:
        await gw.oai.responses.create(model=MODEL, input="x", text={"format": {"type": "json_object"}})
    assert responses.value.body["param"] == "text.format" and "'text.format'" in responses.value.body["message"]


@pytest.mark.parametrize("env, expected", [("vllm", "vllm"), ("tools, logprobs", ("tools", "logprobs"))])
def test_backend_capabilities_env_sets_both_pools(tmp_path, env, expected) -> None:
    """The GPU overlay's BACKEND_CAPABILITIES=vllm (vLLM reports nothing) reaches [prefill] and [decode]."""
    path = tmp_path / "settings.toml"
    path.write_text(settings_text(tmp_path, "http://a:8000", "http://b:8000"))
    config = router_config.load(path, env={"BACKEND_CAPABILITIES": env})
    assert config.prefill.capabilities == expected and config.decode.capabilities == expected
    with pytest.raises(ConfigError) as err:
        router_config.load(path, env={"BACKEND_CAPABILITIES": "tools,mind_reading"})
    assert "mind_reading" in err.value.problem


async def test_vllm_own_fields_need_the_vllm_preset(gateway) -> None:
    """An engine reporting every flag still gets no vLLM-only field (it would ignore it silently): 400 naming it."""
    gw = await gateway(capabilities=ALL_FLAGS)
    with pytest.raises(openai.BadRequestError) as refused:
        await gw.oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, extra_body={"skip_special_tokens": False})
    assert refused.value.body["param"] == "skip_special_tokens" and refused.value.body["code"] == "unknown_parameter"
    await gw.oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, extra_body={"top_k": 3, "min_tokens": 1})
    assert gw.body["top_k"] == 3 and gw.body["min_tokens"] == 1  # contract fields: per flag
