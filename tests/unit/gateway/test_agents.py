"""Issue 10's "must show": coding agents' sessions through a real router process over a real engine process.

`python -m stack.router` (its settings.toml: our engine, capabilities learned from its GET /health) in front of
`python -m stack.engine` (role both, dummy:small random weights, whose 32k window holds a coding agent's system prompt
and tool list — dummy:tiny's 512 tokens do not; the text is gibberish, but forced tool calls and structured outputs
are grammar-constrained, so they are valid whatever the weights). Driven by the official SDKs:
- a Claude-Code-shaped session through anthropic's `messages.stream`: system blocks with cache_control, a tool list,
  three turns (tool_choice any → tool_use, the client answers tool_result; the last turn ends in text);
- a Codex-shaped session on /v1/responses through `client.responses.stream`: a function call →
  function_call_output → the final answer;
- the openai Agents SDK (`openai-agents`) running its own tool loop on /v1/responses (tracing off: it would export
  to OpenAI);
- json_schema outputs on all three APIs, validated with `jsonschema`.
These need the engine to do tools and structured outputs (gateway-engine's side of issue 10).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.unit.router_front.conftest import ServiceProcess, free_port

KEY = "pd-agents-test-key-4c3b2a"
MODEL = "your-model-id"
BASH = {"name": "Bash", "description": "Run a shell command", "cache_control": {"type": "ephemeral"},
        "input_schema": {"type": "object", "properties": {"command": {"type": "string", "maxLength": 16}}, "required": ["command"]}}
READ = {"name": "Read", "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string", "maxLength": 16}}, "required": ["file_path"]}}
# Bounded (maxLength, maximum) so that random weights finish the object well within max_tokens.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "count"], "additionalProperties": False}


class EngineProcess(ServiceProcess):
    """`python -m stack.engine`, role both, on free loopback ports (gRPC health SERVING once it is up)."""

    def __init__(self, workdir: Path, checkpoint: str = "dummy:small") -> None:
        self.port, self.health_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.health_addr = f"127.0.0.1:{self.health_port}"
        config = workdir / "engine.json"
        config.write_text(json.dumps({"model": MODEL, "role": "both", "checkpoint": checkpoint, "kv_transfer_config": {"kv_port": 0}}))
        super().__init__("engine", ["stack.engine", "--config", str(config), "--host", "127.0.0.1", "--port", str(self.port),
                                    "--health-port", str(self.health_port)], workdir / "engine.log", self.health_addr, bound_s=120)


class RouterProcess(ServiceProcess):
    """`python -m stack.router` over one engine (colocated), on free loopback ports."""

    def __init__(self, workdir: Path, engine: EngineProcess) -> None:
        self.port, self.health_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = workdir / "settings.toml"
        settings.write_text(f"""
[server]
host = "127.0.0.1"
port = {self.port}
health_port = {self.health_port}
[taotoken]
model_id = "{MODEL}"
model_aliases = ["claude-*"]
[prefill]
endpoint = "{engine.url}"
health_addrs = ["{engine.health_addr}"]
[decode]
endpoint = "{engine.url}"
health_addrs = ["{engine.health_addr}"]
[usage]
db_path = "{workdir / 'usage.sqlite3'}"
""")
        super().__init__("router", ["stack.router", "--config", str(settings)], workdir / "router.log",
                         f"127.0.0.1:{self.health_port}", env={**os.environ, "TAOTOKEN_API_KEY": KEY})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    engine = EngineProcess(tmp_path_factory.mktemp("engine"))
    router = None
    try:
        router = RouterProcess(tmp_path_factory.mktemp("router"), engine)
        yield router
    finally:
        if router is not None:
            router.stop()
        engine.stop()


@pytest.fixture
def claude(stack, sdk) -> anthropic.AsyncAnthropic:
    return sdk(anthropic.AsyncAnthropic, base_url=stack.url, auth_token=KEY)


@pytest.fixture
def oai(stack, sdk) -> openai.AsyncOpenAI:
    return sdk(openai.AsyncOpenAI, base_url=f"{stack.url}/v1", api_key=KEY)


async def test_claude_code_session(claude) -> None:
    system = [{"type": "text", "text": "You are Claude Code, an interactive CLI tool.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Use the tools to answer.", "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is in README.md?"}]
    for turn in range(3):
        last = turn == 2
        # Claude Code's max_tokens 32000 (clamped to the window) on the tool turns: the grammar ends them; the text turn
        # is kept short, since random weights would write gibberish to the end of the window.
        async with claude.messages.stream(model="claude-sonnet-4-20250514", max_tokens=24 if last else 32000, system=system,
                                          tools=[BASH, READ],
                                          messages=messages, tool_choice={"type": "none"} if last else {"type": "any", "disable_parallel_tool_use": True},
                                          extra_body={"temperature": 0}) as stream:
            message = await stream.get_final_message()
        assert message.usage.input_tokens > 0
        if last:
            assert message.stop_reason in ("end_turn", "max_tokens", "model_context_window_exceeded")
            assert message.content and all(block.type == "text" for block in message.content)
            break
        assert message.stop_reason == "tool_use", message
        uses = [block for block in message.content if block.type == "tool_use"]
        assert uses and all(use.name in ("Bash", "Read") for use in uses)
        for use in uses:
            jsonschema.validate(use.input, (BASH if use.name == "Bash" else READ)["input_schema"])
        messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "# pd-deploy"}
                                                     for use in uses]})


async def test_a_stop_sequence_that_matched_is_named_streamed_and_not(claude) -> None:
    """Anthropic's stop_reason "stop_sequence" with the string that matched, from our engine's choice stop_reason. The
    stop is cut from greedy output seen first, so it matches whatever the random weights write."""
    ask = dict(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Say something."}], extra_body={"temperature": 0})
    free = await claude.messages.create(**ask)
    text = free.content[0].text
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    answer = await claude.messages.create(**ask, stop_sequences=[stop])
    assert (answer.stop_reason, answer.stop_sequence) == ("stop_sequence", stop)
    assert "".join(block.text for block in answer.content) == text[:text.index(stop)]
    async with claude.messages.stream(**ask, stop_sequences=[stop]) as stream:
        streamed = await stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert "".join(block.text for block in streamed.content) == text[:text.index(stop)]


async def _final(stream: Any) -> Any:
    """The response of the terminal event: response.completed, or response.incomplete (max_output_tokens hit, as
    OpenAI ends such a stream; the SDK's get_final_response() only takes response.completed)."""
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    return events[-1].response


async def test_codex_session(oai) -> None:
    tool = {"type": "function", "name": "shell", "description": "Run a command", "strict": True,
            "parameters": {"type": "object", "properties": {"command": {"type": "string", "maxLength": 16}}, "required": ["command"],
                           "additionalProperties": False}}
    items: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "input_text", "text": "List the files."}]}]
    async with oai.responses.stream(model=MODEL, instructions="You are Codex.", input=items, tools=[tool], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=200, temperature=0) as stream:
        first = await _final(stream)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "shell"
    jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
    items += [{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls]
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": "README.md\npd"} for c in calls]
    async with oai.responses.stream(model=MODEL, input=items, tools=[tool], tool_choice="none", max_output_tokens=16) as stream:
        final = await _final(stream)
    assert [o.type for o in final.output] == ["message"] and final.status in ("completed", "incomplete")


async def test_openai_agents_sdk_runs_its_tool_loop(oai) -> None:
    """The Agents SDK's Runner: a forced function call, the SDK runs the tool and sends its output back (tool_choice
    back to auto, its default reset_tool_choice), and the run ends with the agent's typed output (a json_schema
    text.format: the grammar ends it, where free text from random weights would hit max_output_tokens, which the SDK
    takes for a failure)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
    from pydantic import BaseModel

    class Done(BaseModel):
        done: bool

    ran = []

    @function_tool
    def list_files() -> str:
        """List the files of the project."""
        ran.append(True)
        return "README.md\npd"

    agent = Agent(name="coder", instructions="You are a coding agent.", tools=[list_files], output_type=Done,
                  model=OpenAIResponsesModel(model=MODEL, openai_client=oai),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0))
    result = await Runner.run(agent, "List the files.", max_turns=3, run_config=RunConfig(tracing_disabled=True))
    assert ran == [True]
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert isinstance(result.final_output, Done)


async def test_json_schema_outputs_validate_on_all_three_apis(oai, claude) -> None:
    chat = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A name and a count."}], max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "Item", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    response = await oai.responses.create(model=MODEL, input="A name and a count.", max_output_tokens=200, temperature=0,
                                          text={"format": {"type": "json_schema", "name": "Item", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    async with claude.messages.stream(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "A name and a count."}],
                                      output_config={"format": {"type": "json_schema", "schema": SCHEMA}}) as stream:
        message = await stream.get_final_message()
    jsonschema.validate(json.loads(message.content[0].text), SCHEMA)
