"""Claude Code, unchanged, on the default disaggregated stack: two turns of one session through both README routes.

    (a) ANTHROPIC_MODEL=your-model-id (and the small/fast model): every request names the served model;
    (b) the CLI's own claude-* names, which the router takes with model_aliases = ["claude-*"].

Each turn is `claude -p … --output-format stream-json --verbose` (the second with `--continue`), sealed off from the
internet (claude_code.run_claude): it must end with a `result` that is no error (or, as random weights never end a
turn, the CLI's own error for an answer cut at CLAUDE_CODE_MAX_OUTPUT_TOKENS: `_ended_well`), every request it made must be a 200
in the router's `router.request_done` lines, and it must have connected to the router alone. The second turn resends
the first one's prompt, so it must report cache reads (the engines' prefix cache, through cache_read_input_tokens)
and be routed by the CLI's X-Claude-Code-Session-Id header: the router's cache_aware decisions for it are all
"session" (pd_router_affinity_decisions_total, /metrics). Each turn prints its figures (`agents-turn`: prompt tokens,
TTFT, cached tokens, the status of every request) for whoever reads the run (-s).

A third test gives one session (route a) a ~60k-token history: its first prompt pipes a long document on stdin, so
the CLI's first request (its own system prompt and tools, then the document) is a cold prefill of most of the
65,536-token window, pushed to decode; the second turn reads that history from the prefix cache. On two busy cores
that prefill takes minutes (docs/long-prompts.md): the runs get LONG_TIMEOUT_S, as the CLI's requests do.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stack.engine.tokenizer import dummy_tokenizer
from tests.agents.claude_code import MAX_OUTPUT_TOKENS, Run, run_claude
from tests.integration.compose_stack import Stack
from tests.unit.engine_core.agent_prompt import long_prompt

pytestmark = [pytest.mark.agents, pytest.mark.integration]
MODEL_ID = "your-model-id"  # router/settings.toml's model_id
ROUTES = {"model-id": MODEL_ID, "claude-alias": None}  # None: the CLI's own claude-* model names
PROMPTS = ("Reply with one word: ready?", "And one more word, please.")
WINDOW = 65_536  # dummy:small's max_seq_len
DOCUMENT_TOKENS = 46_000  # + the CLI's ~14k tokens of system prompt, environment block and tools: a ~60k-token request
LONG_TIMEOUT_S = 3600  # a hang guard for the cold ~60k-token prefill on a loaded 2-core box, not an expectation


def _decisions(stack: Stack) -> Counter[tuple[str, str]]:
    """The router's cache_aware decisions so far: (role, decision) -> count."""
    with urllib.request.urlopen(f"{stack.router_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pd_router_affinity_decisions_total":
                counts[(sample.labels["role"], sample.labels["decision"])] += int(sample.value)
    return counts


def _turn(stack: Stack, binary: Path, workdir: Path, prompt: str, model: str | None, resume: bool,
          **options: Any) -> tuple[Run, list[dict[str, Any]], Counter]:
    """One CLI run (`options`: run_claude's stdin, timeout_s): (the run, the router's log lines it caused, the
    affinity decisions it caused)."""
    seen, decided = len(stack.events("router")), _decisions(stack)
    run = run_claude(binary, prompt, stack.router_url, stack.api_key, workdir, model=model, resume=resume, **options)
    # The router logs request_done as a response ends and the CLI may exit first: wait for one per scheduled request.
    deadline = time.monotonic() + 30
    while True:
        lines = stack.events("router")[seen:]
        done = sum(line.get("event") == "router.request_done" for line in lines)
        if done >= len(_scheduled(lines)) or time.monotonic() > deadline:
            return run, lines, _decisions(stack) - decided
        time.sleep(0.3)


def _scheduled(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The router.scheduled line of each request's first attempt (what it asked: api, model, stream)."""
    return list({line["request_id"]: line for line in reversed(lines) if line.get("event") == "router.scheduled"}.values())


def _figures(run: Run, lines: list[dict[str, Any]]) -> dict[str, Any]:
    done = [line for line in lines if line.get("event") == "router.request_done"]
    usage = run.result.get("usage") or {}
    return {"requests": [{"status": line.get("status"), "prompt_tokens": line.get("prompt_tokens"), "e2e_ms": line.get("e2e_ms")} for line in done],
            "ttft_ms": [line.get("ttft_ms") for line in lines if line.get("event") == "router.decode_first_token"],
            "cache_read_input_tokens": usage.get("cache_read_input_tokens"), "input_tokens": usage.get("input_tokens"),
            "cli_ttft_ms": run.result.get("ttft_ms"), "duration_ms": run.result.get("duration_ms")}


def _problems(stack: Stack, router_lines: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The warnings and errors of every hop (the router's of this turn), for a failure's message."""
    lines = [("router", line) for line in router_lines] + [(service, line) for service in ("prefill", "decode") for line in stack.events(service)]
    return [(service, line.get("event", ""), line.get("msg", "")) for service, line in lines if line.get("level") in ("WARNING", "ERROR")][-8:]


def _ended_well(run: Run) -> bool:
    """A result without error; or, since random weights never end a turn, the one error Claude Code makes of an
    answer cut at CLAUDE_CODE_MAX_OUTPUT_TOKENS: it asks the model to resume (3 times, each one more 200 request)
    and then ends the run with this api_error result, exit code 1. No other error passes."""
    result = run.result
    if result.get("is_error") is False and result.get("subtype") == "success":
        return run.returncode == 0
    capped = f"exceeded the {MAX_OUTPUT_TOKENS} output token maximum" in str(result.get("result"))
    return run.returncode == 1 and result.get("terminal_reason") == "api_error" and result.get("api_error_status") is None and capped


def _check_turn(stack: Stack, run: Run, lines: list[dict[str, Any]], model: str | None) -> None:
    result = run.result
    summary = {key: result.get(key) for key in ("subtype", "is_error", "result", "terminal_reason", "api_error_status", "num_turns")}
    assert _ended_well(run), (run.returncode, summary, run.stderr[-2000:], _problems(stack, lines))
    received = _scheduled(lines)
    done = [line for line in lines if line.get("event") == "router.request_done"]
    assert received and len(done) == len(received), (received, done)
    assert [line.get("status") for line in done] == [200] * len(done), done
    models = {line.get("model") for line in received}
    assert models == {model} if model else all(name.startswith("claude-") for name in models), models
    assert set(run.connects) == {("127.0.0.1", stack.router_port)}, run.connects  # the router, and nothing else


@pytest.mark.parametrize("route", ROUTES)
def test_two_turns_of_a_claude_code_session(agents_stack: Stack, claude_binary: Path, tmp_path: Path, route: str) -> None:
    """Both turns end in a successful result over 200s only; the second reads the first one's cached prompt and is
    routed by the session header."""
    model = ROUTES[route]
    first, first_lines, _ = _turn(agents_stack, claude_binary, tmp_path, PROMPTS[0], model, resume=False)
    print("agents-turn", json.dumps({"route": route, "turn": 1, **_figures(first, first_lines)}))
    _check_turn(agents_stack, first, first_lines, model)

    second, second_lines, decisions = _turn(agents_stack, claude_binary, tmp_path, PROMPTS[1], model, resume=True)
    print("agents-turn", json.dumps({"route": route, "turn": 2, **_figures(second, second_lines)}))
    _check_turn(agents_stack, second, second_lines, model)
    assert second.session_id == first.session_id, "--continue started a new session"
    assert (second.result.get("usage") or {}).get("cache_read_input_tokens", 0) > 0, second.result.get("usage")
    requests = len([line for line in second_lines if line.get("event") == "router.request_done"])
    assert decisions == Counter({("prefill", "session"): requests, ("decode", "session"): requests}), decisions


def _through_pd(stack: Stack, request_id: str, prompt_tokens: int) -> None:
    """The request's whole prompt went prefill → decode: prefill pushed its KV, decode received it."""
    sent = [e for e in stack.events("prefill", request_id) if e.get("event") == "kv_producer.sent"]
    received = [e for e in stack.events("decode", request_id) if e.get("event") == "kv_consumer.received"]
    assert sent and received, (request_id, [e.get("event") for e in stack.events("prefill", request_id)],
                               [e.get("event") for e in stack.events("decode", request_id)])
    assert sent[-1]["num_tokens"] == received[-1]["num_tokens"] == prompt_tokens, (sent[-1], received[-1], prompt_tokens)


@pytest.mark.agents_long
def test_a_claude_code_session_with_a_60k_token_history(agents_stack: Stack, claude_binary: Path, tmp_path: Path) -> None:
    """A first turn whose request is ~60k tokens (inside the 65,536-token window) completes through prefill → KV push
    → decode over 200s only, within the CLI's raised request timeout; the second turn (--continue) resends that
    history and reads nearly all of it from the prefix cache."""
    document = long_prompt(DOCUMENT_TOKENS, dummy_tokenizer())
    prompt = "Reply with one word: what is the document below about?"
    first, first_lines, _ = _turn(agents_stack, claude_binary, tmp_path, prompt, MODEL_ID, resume=False,
                                  stdin=document, timeout_s=LONG_TIMEOUT_S)
    print("agents-turn", json.dumps({"route": "model-id", "history": "60k", "turn": 1, **_figures(first, first_lines)}))
    _check_turn(agents_stack, first, first_lines, MODEL_ID)
    done = [line for line in first_lines if line.get("event") == "router.request_done"]
    longest = max(done, key=lambda line: line.get("prompt_tokens", 0))
    assert 55_000 <= longest["prompt_tokens"] < WINDOW, longest
    for line in done:
        _through_pd(agents_stack, line["request_id"], line["prompt_tokens"])

    second, second_lines, _ = _turn(agents_stack, claude_binary, tmp_path, PROMPTS[1], MODEL_ID, resume=True,
                                    timeout_s=LONG_TIMEOUT_S)
    print("agents-turn", json.dumps({"route": "model-id", "history": "60k", "turn": 2, **_figures(second, second_lines)}))
    _check_turn(agents_stack, second, second_lines, MODEL_ID)
    assert second.session_id == first.session_id, "--continue started a new session"
    for line in second_lines:
        if line.get("event") == "router.request_done":
            _through_pd(agents_stack, line["request_id"], line["prompt_tokens"])
    usage = second.result.get("usage") or {}
    cached, uncached = usage.get("cache_read_input_tokens", 0), usage.get("input_tokens", 0)
    # The history is the first turn's longest prompt; what the second turn computes afresh is its new words alone.
    assert cached >= 0.9 * longest["prompt_tokens"] and cached >= 0.9 * (cached + uncached), usage
