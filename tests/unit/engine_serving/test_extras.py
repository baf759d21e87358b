"""The engine does vLLM's extras for real, through the official openai SDK against the engine itself:
structured outputs, tool calls (auto parsing and forced), logprobs, n, sampling extras, /detokenize,
capabilities on /health, and constrained output across the PD hand-off."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from typing import Any

import jsonschema
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from stack.engine.checkpoint import DUMMY_CONFIGS, dummy_weights
from stack.engine.model import Model
from stack.engine.server import warm_up
from stack.engine.tokenizer import dummy_tokenizer
from stack.engine.weights import fingerprint
from stack.protocol.capabilities import Capabilities

from .conftest import chat, prefill_leg

SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
          "required": ["unit", "ok", "n"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "flag", "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}},
                                                                           "required": ["on"]}}}]
MESSAGES = [{"role": "user", "content": "what is the weather?"}]
A = dummy_tokenizer().encode("A", add_special_tokens=False)[0]  # the token logit_bias forces below


@pytest.fixture(scope="session")
def tiny_long() -> Model:
    """dummy:tiny's weights with a 4096-token window: room for the Hermes tools system prompt."""
    config = replace(DUMMY_CONFIGS["tiny"], max_seq_len=4096)
    weights = dummy_weights(config, 0)
    return Model("dummy:tiny", config, weights, dummy_tokenizer(), fingerprint(config, weights))


@pytest.fixture
async def sdk(engine_client, tiny_long: Model) -> Any:
    """(engine handle, AsyncOpenAI client pointed at the engine)."""
    engine = await engine_client(model=tiny_long)
    client = openai.AsyncOpenAI(base_url=str(engine.client.make_url("/v1")), api_key="unused", max_retries=0)
    yield engine, client
    await client.close()


async def test_health_reports_every_capability(sdk) -> None:
    """GET /health lists every Capabilities flag: the router learns the engine does them all."""
    engine, _ = sdk
    body = await (await engine.client.get("/health")).json()
    assert body["capabilities"] == [f.name for f in fields(Capabilities)]
    assert body["max_model_len"] == 4096


def test_dummy_small_context_fits_a_coding_agent() -> None:
    """dummy:small (the stacks' default) takes 65536 tokens; its KV is 16 KiB per token (1 GiB per full window)."""
    small = DUMMY_CONFIGS["small"]
    assert small.max_seq_len == 65536 and small.kv_bytes_per_token * small.max_seq_len == 2**30


@pytest.mark.parametrize("stream", [False, True])
async def test_json_schema_output_validates(sdk, stream: bool) -> None:
    """response_format json_schema: the random-weight model's answer parses and validates against the schema."""
    _, client = sdk
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    if stream:
        text = ""
        async for chunk in await client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, max_tokens=200,
                                                                 seed=5, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
    else:
        answer = await client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, max_tokens=200, seed=5)
        assert answer.choices[0].finish_reason == "stop"
        text = answer.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)


async def test_json_object_and_vllm_structured_outputs(sdk) -> None:
    """json_object gives a JSON object; vLLM's structured_outputs regex, choice and Lark grammar are honoured."""
    _, client = sdk
    answer = await client.chat.completions.create(model="tiny", messages=MESSAGES, response_format={"type": "json_object"},
                                                  max_tokens=300, temperature=0, logit_bias={"34": 30})  # '"' likelier: short keys
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    cases = [({"regex": "[0-9]{3}-[a-c]+"}, lambda t: len(t) >= 5 and t[:3].isdigit() and t[3] == "-" and set(t[4:]) <= set("abc")),
             ({"choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
             ({"grammar": 'start: "yes" | "no" | "x" NUM\nNUM: /[0-9]/'}, lambda t: t in ("yes", "no") or (t[0] == "x" and t[1:].isdigit()))]
    for so, ok in cases:
        out = await client.completions.create(model="tiny", prompt="answer:", max_tokens=30, seed=2, extra_body={"structured_outputs": so})
        assert ok(out.choices[0].text), (so, out.choices[0].text)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "flag"}}], ids=["required", "named"])
async def test_forced_tool_choice_returns_valid_tool_calls(sdk, tool_choice: Any) -> None:
    """tool_choice required / named: tool_calls whose arguments validate, content None, finish_reason tool_calls."""
    _, client = sdk
    answer = await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                                  max_tokens=200, seed=11, parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    if isinstance(tool_choice, dict):
        assert call.function.name == "flag"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


async def test_streamed_tool_call_deltas_add_up_to_the_message(sdk) -> None:
    """Streamed: id + name first, then argument fragments that join into the non-streamed arguments."""
    _, client = sdk
    kwargs = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "temperature": 0,
              "parallel_tool_calls": False}
    whole = (await client.chat.completions.create(**kwargs)).choices[0].message.tool_calls[0]
    deltas, finish = [], None
    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert deltas[0].id and deltas[0].function.name == whole.function.name and deltas[0].function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == whole.function.arguments
    assert finish == "tool_calls"


async def test_tool_history_replays_through_the_template(sdk) -> None:
    """An assistant tool call with content None and its tool result render (Hermes template) and answer."""
    engine, client = sdk
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "flag", "arguments": '{"on": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    answer = await client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=3)
    assert answer.choices[0].finish_reason in ("length", "stop")
    tokens = await (await engine.client.post("/tokenize", json={"model": "tiny", "messages": history, "tools": TOOLS})).json()
    text = (await (await engine.client.post("/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]})).json())["prompt"]
    assert '<tool_call>\n{"name": "flag", "arguments": {"on": true}}\n</tool_call>' in text
    assert "<tool_response>\ndone\n</tool_response>" in text and '"name": "weather"' in text
    assert answer.usage.prompt_tokens == tokens["count"]


async def test_chat_logprobs_match_the_sdk_types(sdk) -> None:
    """logprobs + top_logprobs: one entry per token, top lists of the asked length, greedy token = best."""
    engine, _ = sdk
    body = chat(max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    raw = await (await engine.client.post("/v1/chat/completions", json=body)).json()
    answer = ChatCompletion.model_validate(raw)
    entries = answer.choices[0].logprobs.content
    assert len(entries) == answer.usage.completion_tokens == 6
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob) and e.logprob <= 0
        assert bytes(e.bytes) == bytes(e.top_logprobs[0].bytes)
    assert raw["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_completion_logprobs_are_the_legacy_shape(sdk) -> None:
    """/v1/completions logprobs=2: tokens, token_logprobs, top_logprobs (dicts), text_offset, streamed and not."""
    engine, client = sdk
    raw = await (await engine.client.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 5, "logprobs": 2,
                                                                    "temperature": 0})).json()
    lp = Completion.model_validate(raw).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    streamed: list[float] = []
    async for chunk in await client.completions.create(model="tiny", prompt="abc", max_tokens=5, logprobs=2, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == lp.token_logprobs


async def test_n_choices_have_their_own_seed_streams(sdk) -> None:
    """n=3: three choices indexed 0..2, different draws, reproducible with the seed; streamed chunks carry the index."""
    _, client = sdk
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "n": 3, "seed": 9, "ignore_eos": True}
    a = await client.chat.completions.create(**{k: v for k, v in kwargs.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True})
    b = await client.chat.completions.create(**{k: v for k, v in kwargs.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True})
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices] and len(set(texts)) == 3
    assert a.usage.completion_tokens == 24
    streamed = {0: "", 1: "", 2: ""}
    async for chunk in await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, n=3, seed=9, stream=True,
                                                             extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert list(streamed.values()) == texts


async def test_sampling_extras_steer_the_engine(sdk) -> None:
    """logit_bias forces a token; stop_token_ids end on it; min_tokens holds back EOS; top_k=1 is greedy."""
    _, client = sdk
    forced = await client.completions.create(model="tiny", prompt="x", max_tokens=4, logit_bias={str(A): 100}, seed=1)
    assert forced.choices[0].text == "AAAA"
    stopped = await client.completions.create(model="tiny", prompt="x", max_tokens=4, logit_bias={str(A): 100}, seed=1,
                                              extra_body={"stop_token_ids": [A]})
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason, stopped.usage.completion_tokens) == ("", "stop", 1)
    assert stopped.choices[0].model_extra["stop_reason"] == A  # vLLM's choice field: the stop token id
    assert forced.choices[0].model_extra["stop_reason"] is None  # length: nothing matched
    eos = dummy_tokenizer().eos_id
    held = await client.completions.create(model="tiny", prompt="x", max_tokens=10, logit_bias={str(eos): 100}, seed=1,
                                           extra_body={"min_tokens": 3})
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 4)
    greedy = await client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0)
    top1 = await client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=1.5, seed=3, extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text


async def test_detokenize_inverts_tokenize(sdk) -> None:
    """POST /detokenize (vLLM's shape) gives back the text /tokenize encoded; bad ids are a 400 naming tokens."""
    engine, _ = sdk
    tokens = (await (await engine.client.post("/tokenize", json={"model": "tiny", "prompt": "héllo wörld"})).json())["tokens"]
    back = await (await engine.client.post("/detokenize", json={"model": "tiny", "tokens": tokens})).json()
    assert back == {"prompt": "héllo wörld"}
    bad = await engine.client.post("/detokenize", json={"model": "tiny", "tokens": [10**7]})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "tokens"


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
    {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
], ids=["json_schema", "tool_choice"])
async def test_pd_constrained_output_equals_colocated(engine_client, tiny_long: Model, constraint: dict[str, Any]) -> None:
    """Prefill → KV socket → decode: the decode leg's matcher is advanced by prefill's first token, so the
    constrained greedy answer (and its logprobs) equal the colocated one token for token."""
    colocated, prefill, decode = [await engine_client(role, model=tiny_long) for role in ("both", "prefill", "decode")]
    await warm_up(decode.client.app)
    body = chat("what is the weather?", max_tokens=150, temperature=0, logprobs=True, **constraint)
    expected = await (await colocated.client.post("/v1/chat/completions", json=body)).json()
    leg = await (await prefill.client.post("/v1/chat/completions", json=prefill_leg(body, "t-constrained", decode.kv_addr))).json()
    got = await (await decode.client.post("/v1/chat/completions", json=body | {"kv_transfer_params": leg["kv_transfer_params"]})).json()

    def strip_ids(choice: dict[str, Any]) -> dict[str, Any]:
        for call in choice["message"].get("tool_calls") or []:
            call["id"] = "-"
        return choice
    assert [strip_ids(c) for c in got["choices"]] == [strip_ids(c) for c in expected["choices"]]
    assert got["choices"][0]["finish_reason"] == ("tool_calls" if "tools" in constraint else "stop")
    assert got["usage"] == expected["usage"]


async def test_hf_tokenizer_checkpoint_gets_constrained_too(engine_client, tmp_path) -> None:
    """A Hugging Face checkpoint (byte-level BPE tokenizer.json): llguidance builds its tokenizer from it,
    and json_schema output validates; the choice constraint picks one of the strings."""
    from stack.engine.model import load_model

    from .conftest import write_hf_checkpoint

    engine = await engine_client("both", model=load_model(str(write_hf_checkpoint(tmp_path / "hf"))))
    body = {"model": "tiny", "prompt": "json:", "max_tokens": 120, "seed": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}
    out = await (await engine.client.post("/v1/completions", json=body)).json()
    jsonschema.validate(json.loads(out["choices"][0]["text"]), SCHEMA)
    picked = await (await engine.client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 20,
                                                                        "structured_outputs": {"choice": ["red", "green"]}})).json()
    assert picked["choices"][0]["text"] in ("red", "green")


async def test_the_stop_string_that_matched_is_the_choices_stop_reason(sdk) -> None:
    """As vLLM: a stop string ends the text before it and is named in the choice's `stop_reason`, streamed and not."""
    _, client = sdk
    body = dict(model="tiny", prompt="x", max_tokens=8, logit_bias={str(A): 100}, seed=1, stop=["zz", "AA"])
    answer = await client.completions.create(**body)
    assert (answer.choices[0].text, answer.choices[0].finish_reason, answer.choices[0].model_extra["stop_reason"]) == ("", "stop", "AA")
    chunks = [chunk async for chunk in await client.completions.create(**body, stream=True)]
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert (last.choices[0].finish_reason, last.choices[0].model_extra["stop_reason"]) == ("stop", "AA")
