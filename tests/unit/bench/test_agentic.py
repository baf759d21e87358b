"""The agentic multi-turn workload, its closed-loop run, the arms of compare and the ratios to the best colocated arm."""

from __future__ import annotations

import argparse

import numpy as np

from stack.bench import agentic, arms, compare, report, scrape, serve
from stack.bench.dataset import byte_count
from tests.unit.bench.test_serve import parse

SHAPE = agentic.AgenticShape(sessions=3, turns=3, system_len=500, tools=2, turn_len=40, output_len=4, think_mean_s=0.01,
                             stagger_s=0.05)


def test_sessions_are_seeded_share_one_prefix_and_grow_each_turn() -> None:
    """Same seed, same sessions; every session opens with the same system prompt and tools, and each turn resends
    the previous turn's conversation plus its answer and a new user text."""
    workload = agentic.build_workload(SHAPE, np.random.default_rng(3))
    assert workload == agentic.build_workload(SHAPE, np.random.default_rng(3))
    assert workload.system != agentic.build_workload(SHAPE, np.random.default_rng(4)).system
    assert byte_count(workload.system) == SHAPE.system_len and len(workload.tools) == 2
    assert len({s.session_id for s in workload.sessions}) == 3 and workload.requests == 9
    for session in workload.sessions:
        lengths = [workload.prompt_len(session, t) for t in range(SHAPE.turns)]
        for turn in range(SHAPE.turns - 1):
            now, then = workload.messages(session, turn), workload.messages(session, turn + 1)
            assert then[: len(now)] == now and then[len(now)] == {"role": "assistant", "content": session.turns[turn].answer}
            assert lengths[turn + 1] - lengths[turn] == SHAPE.turn_len + SHAPE.output_len
        assert workload.messages(session, 0)[0] == {"role": "system", "content": workload.system}
    body = workload.payload("m", workload.sessions[0], 1)
    assert body["ignore_eos"] and body["max_completion_tokens"] == 4 and body["tools"] == list(workload.tools)


async def test_agentic_run_sends_each_sessions_turns_in_order_with_its_header(sse_server, plan) -> None:
    """`serve --dataset-name agentic`: every turn completes, carries its session's Claude Code header, and a session's
    turns arrive one after another with a growing history (closed loop: at most one request per session in flight)."""
    args = parse(["--base-url", str(sse_server.make_url("")), "--dataset-name", "agentic", "--agentic-sessions", "3",
                  "--agentic-turns", "3", "--agentic-system-len", "300", "--agentic-turn-len", "30", "--agentic-output-len", "3",
                  "--agentic-think-mean-s", "0.01", "--agentic-stagger-s", "0.05", "--disable-tqdm"])
    assert args.num_prompts == 9
    result = await serve.benchmark(args)
    assert (result["completed"], result["failed"]) == (9, 0)
    assert plan.max_in_flight <= 3
    by_session: dict[str, list[int]] = {}
    for headers, body in zip(plan.headers, plan.bodies):
        by_session.setdefault(headers[agentic.SESSION_HEADER], []).append(len(body["messages"]))
    assert len(by_session) == 3 and all(counts == [2, 4, 6] for counts in by_session.values())


async def test_max_concurrency_runs_agentic_sessions_one_after_another(sse_server, plan) -> None:
    """--max-concurrency 1 with agentic sessions: each session runs whole before the next starts (compare's warm-up
    relies on it, so one engine computes a cold prefix once, not once per concurrent session)."""
    args = parse(["--base-url", str(sse_server.make_url("")), "--dataset-name", "agentic", "--agentic-sessions", "3",
                  "--agentic-turns", "2", "--agentic-system-len", "300", "--agentic-turn-len", "30", "--agentic-output-len", "3",
                  "--agentic-think-mean-s", "0", "--agentic-stagger-s", "0", "--max-concurrency", "1", "--disable-tqdm"])
    result = await serve.benchmark(args)
    assert (result["completed"], result["failed"]) == (6, 0)
    order = [headers[agentic.SESSION_HEADER] for headers in plan.headers]
    assert plan.max_in_flight == 1 and order == [order[0]] * 2 + [order[2]] * 2 + [order[4]] * 2 and len(set(order)) == 3


def test_bad_agentic_knobs_are_reported() -> None:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(["--dataset-name", "agentic", "--agentic-sessions", "0", "--agentic-think-mean-s", "-1"])
    assert serve.check_args(args) == ["--agentic-sessions must be > 0", "--agentic-think-mean-s must be >= 0"]


def test_arms_pin_the_same_two_cores_and_switch_prefix_caching() -> None:
    """Each arm on cores 0,1 its own way; :cache / :nocache set PD_PREFIX_CACHING on its engines; colocated-x2 runs a
    second replica on the second core behind the same router."""
    parser = argparse.ArgumentParser()
    compare.add_cli_args(parser)
    args = parser.parse_args(["--api-key", "k", "--stacks", "colocated:nocache,colocated-x2:cache,colocated-chunked,disaggregated:cache"])
    plain, x2, chunked, pd = arms.build_arms(args)
    assert plain.env["ENGINE_CPUS"] == "0,1" and plain.engine_env == {"PD_PREFIX_CACHING": "0"}
    assert chunked.config_dir is not None and chunked.engine_env == {}
    override = arms.engine_override(x2)["services"]
    assert x2.env["ENGINE_CPUS"] == "0" and override["engine2"]["cpuset"] == "1"
    assert override["engine2"]["environment"] == {"PD_PREFIX_CACHING": "1"} == override["engine"]["environment"]
    assert override["router"]["environment"]["DECODE_ENDPOINT"] == "http://engine:8000,http://engine2:8000"
    assert set(arms.engine_override(pd)["services"]) == {"prefill", "decode"}
    bad = parser.parse_args(["--stacks", "colocated:warm,colocated-x2", "--colocated-cpus", "0"])
    bad.api_key = "k"
    assert compare.main(bad) == 2


def test_cache_summary_reads_what_a_run_added_to_the_routers_counters() -> None:
    """From the router's own /metrics text: prompt and cached tokens a run added (hit rate) and its routing decisions."""
    from stack.router.backends import PoolConfig, build_pool
    from stack.router.metrics import Metrics

    metrics = Metrics()
    a, b = build_pool(PoolConfig(endpoints=("http://e1:8000", "http://e2:8000")), "both", 3, 30.0)
    metrics.observe_prompt_cache(a, {"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 0}})
    before = scrape.parse_counters(metrics.render()[0])
    metrics.observe_prompt_cache(a, {"prompt_tokens": 1200, "prompt_tokens_details": {"cached_tokens": 900}})
    metrics.observe_prompt_cache(b, {"prompt_tokens": 800})  # an engine without caching reports no details
    metrics.affinity.inc(role="decode", backend=a.url, decision="session")
    metrics.affinity.inc(role="decode", backend=b.url, decision="imbalanced")
    summary = scrape.cache_summary(before, scrape.parse_counters(metrics.render()[0]))
    assert (summary["prompt_tokens"], summary["cached_tokens"]) == (2000, 900) and summary["hit_rate"] == 0.45
    assert summary["affinity_decisions"] == {"session": 1, "imbalanced": 1}
    table = report.cache_table({"colocated-x2:cache": {"router_cache": summary}, "colocated": {}})
    assert "| colocated-x2:cache | 2000 | 900 | 45 % | imbalanced 1, session 1 |" in table and "| colocated | – | – | – | – |" in table


def test_claude_code_profile_sends_its_system_prompt_and_tool_list_sizes() -> None:
    """--agentic-profile claude-code: every request opens with a ~27k-character system prompt and 14 tools, whatever
    --agentic-system-len / --agentic-tools said."""
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(["--dataset-name", "agentic", "--agentic-profile", "claude-code", "--agentic-tools", "2"])
    assert serve.check_args(args) == []
    workload = agentic.build_workload(serve.agentic_shape(args), np.random.default_rng(0))
    assert len(workload.system) == 27000 and len(workload.tools) == 14
    body = workload.payload("m", workload.sessions[0], 0)
    assert body["messages"][0]["content"] == workload.system and len(body["tools"]) == 14


def test_compare_keeps_the_agent_products_prefix_over_its_ladder_and_warm_up(tmp_path) -> None:
    """Every point of an agentic ladder draws new sessions, but the system prompt and tools are one product's: the
    same at every point and in the warm-up (which heats them), as a deployed agent's prefix is on every request.
    A chat ladder still draws wholly new prompts per point."""
    parser = argparse.ArgumentParser()
    compare.add_cli_args(parser)
    args = parser.parse_args(["--dataset-name", "agentic", "--agentic-system-len", "300", "--agentic-tools", "2",
                              "--agentic-turn-len", "30", "--sweep", "1,2", "--api-key", "k", "--out", str(tmp_path)])
    one, two = (serve.agentic_workload(compare.point_args(args, "http://x", p, "l")) for p in (1.0, 2.0))
    warming = compare.warmup_args(args, "http://x")
    warm = serve.agentic_workload(warming)
    assert one.system == two.system == warm.system and one.tools == two.tools == warm.tools
    # The warm-up: several one-turn sessions (each its own id, so cache-aware routing reaches every replica), in turn.
    assert len({s.session_id for s in warm.sessions}) == compare.WARM_SESSIONS > 1 and warming.max_concurrency == 1
    assert one.sessions[0].turns[0].user != two.sessions[0].turns[0].user != warm.sessions[0].turns[0].user
    assert len(one.sessions) == 1 and len(two.sessions) == 2
    # --agentic-prefix-seed moves the product; plain serve without it draws prefix and sessions from --seed alone.
    other = parser.parse_args([*["--dataset-name", "agentic", "--agentic-system-len", "300", "--sweep", "1"],
                               "--agentic-prefix-seed", "9", "--api-key", "k", "--out", str(tmp_path)])
    assert serve.agentic_workload(compare.point_args(other, "http://x", 1.0, "l")).system != one.system
    alone = serve.agentic_workload(args)
    assert alone == agentic.build_workload(serve.agentic_shape(args), np.random.default_rng(args.seed), serve.token_counter(args))
