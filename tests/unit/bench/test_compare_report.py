"""stack.bench.report, arms and compare: the table, the charts, the arms' compose changes and a whole compare run over
two servers."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from stack.bench import arms, compare, report, serve
from stack.bench.metrics import detailed_fields, outcome_from_chunks, summarize
from stack.common.config import build
from stack.engine.config import EngineConfig
from tests.unit.bench.conftest import StreamPlan, make_app

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_result(gap: float, rate: float = 2.0) -> dict:
    """Four 3-token requests whose token gaps are `gap` s (TTFT 0.1 s) plus one failure."""
    chunk = {"choices": [{"delta": {"content": "x"}}]}
    outcomes = [outcome_from_chunks(0.0, [(0.1, chunk), (0.1 + gap, chunk), (0.1 + 2 * gap, chunk)])] * 4
    outcomes.append(outcome_from_chunks(0.0, []))
    result = summarize(outcomes, 2.0, ["ttft", "tpot", "itl", "e2el"], [50, 90, 99], {"tpot": 150})
    return {"request_rate": rate, **result, **detailed_fields(outcomes)}


def test_table_has_ratios_against_the_first_stack() -> None:
    """The last column divides the second stack by the first: half the ITL reads 0.50×."""
    table = report.comparison_table({"colocated": fake_result(0.2), "disaggregated": fake_result(0.1)})
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
    assert rows["ITL P99 (ms)"].endswith("| 200.0 | 100.0 | 0.50× |")
    assert rows["TTFT mean (ms)"].endswith("| 100.0 | 100.0 | 1.00× |")
    assert rows["Goodput (req/s)"].endswith("| 0.000 | 2.000 | – |")  # 0 baseline: no ratio
    assert rows["Failed"].endswith("| 1 | 1 | 1.00× |")


def test_comparison_chart_is_png(tmp_path) -> None:
    """The latency CDF chart of one load point is written as PNG."""
    results = {"colocated": fake_result(0.2), "disaggregated": fake_result(0.1)}
    assert report.comparison_chart(results, tmp_path / "c.png").read_bytes().startswith(PNG_MAGIC)


@contextmanager
def server_thread(plan: StreamPlan) -> Iterator[str]:
    """The in-process SSE server on its own loop and thread (compare.main runs its own loops)."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(plan))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_compare_over_running_stacks_sweeps_repeats_and_reports(tmp_path) -> None:
    """`compare --url … --sweep --repeats 2` against two servers: every point of both repeats in alternating arm
    order, the same prompts for both arms, per-run JSON, compare.md with median [min–max] tables and the charts."""
    slow, fast = StreamPlan(tokens=4, gap=0.02), StreamPlan(tokens=4, gap=0.005)
    with server_thread(slow) as slow_url, server_thread(fast) as fast_url:
        parser = argparse.ArgumentParser()
        compare.add_cli_args(parser)
        args = parser.parse_args([
            "--url", f"colocated={slow_url}", "--url", f"disaggregated={fast_url}", "--num-prompts", "6",
            "--sweep", "20,40", "--synthetic-input-mean", "50", "--goodput", "tpot:1000", "--warmup", "1",
            "--repeats", "2", "--on-high-load", "flag", "--load-wait", "0", "--out", str(tmp_path), "--disable-tqdm",
        ])
        assert compare.main(args) == 0
    assert len(slow.bodies) == len(fast.bodies) == 2 * (2 + 2 * 6)  # per repeat: readiness, warm-up, two sweep points
    # Same seed: both stacks got the same prompts in the same order.
    assert [b["messages"] for b in slow.bodies] == [b["messages"] for b in fast.bodies]
    # Each point its own prompts (else the second finds the first's in the prefix cache), the same in every repeat.
    prompts = [json.dumps(b["messages"]) for b in slow.bodies]
    point_20, point_40 = set(prompts[2:8]), set(prompts[8:14])
    assert not point_20 & point_40 and not point_20 & {prompts[1]}
    assert set(prompts[16:22]) == point_20 and set(prompts[22:28]) == point_40
    table = (tmp_path / "compare.md").read_text()
    assert "Hardware:" in table and "Goodput SLOs: tpot ≤ 1000 ms" in table
    assert "Repeats: 2, arm order alternate: 1: colocated, disaggregated; 2: disaggregated, colocated" in table
    assert "Common load for the P99s: 40 req/s" in table
    row = next(line for line in table.splitlines() if line.startswith("| disaggregated | "))
    assert row.count("[") == 5  # every figure as median [min–max]
    itl = next(line for line in table.splitlines() if line.startswith("| ITL median"))
    assert float(itl.rsplit("|", 2)[1].strip(" ×")) < 1.0  # the fast server's gaps are shorter
    for name in ("compare.png", "load-numpy.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
    assert len(list((tmp_path / "runs").glob("*.json"))) == 8
    every = table.split("## Every run")[1]
    assert every.count("| colocated |") == every.count("| disaggregated |") == 4


def test_a_stopped_experiment_keeps_the_runs_it_measured(tmp_path, monkeypatch) -> None:
    """Ctrl-C during the second arm: the first arm's runs are on disk and reported, and compare exits 1."""
    real_run_arm = compare.run_arm

    def run_arm(args, arm, *rest):
        if arm.name == "disaggregated":
            raise KeyboardInterrupt
        return real_run_arm(args, arm, *rest)

    monkeypatch.setattr(compare, "run_arm", run_arm)
    with server_thread(StreamPlan(tokens=3, gap=0.001)) as url:
        parser = argparse.ArgumentParser()
        compare.add_cli_args(parser)
        args = parser.parse_args([
            "--url", f"colocated={url}", "--url", f"disaggregated={url}", "--num-prompts", "2", "--sweep", "20,40",
            "--synthetic-input-mean", "20", "--warmup", "0", "--repeats", "1", "--on-high-load", "flag",
            "--load-wait", "0", "--out", str(tmp_path), "--disable-tqdm",
        ])
        assert compare.main(args) == 1
    assert sorted(p.name for p in (tmp_path / "runs").glob("*.json")) == ["1-colocated-20.json", "1-colocated-40.json"]
    assert "| colocated |" in (tmp_path / "compare.md").read_text()


def test_reports_name_a_checkpoint_directory_by_its_own_name() -> None:
    """Titles and headings say which model, not where it lay on the machine that ran the experiment."""
    assert compare.model_label("/data/checkpoints/small-llama") == "small-llama"
    assert compare.model_label("dummy:small") == "dummy:small"


def test_stack_specs_pin_the_same_cores() -> None:
    """Default budget: colocated engine on cores 0,1; prefill on 0 and decode on 1; --url skips compose."""
    parser = argparse.ArgumentParser()
    compare.add_cli_args(parser)
    args = parser.parse_args(["--url", "disaggregated=http://h:1", "--api-key", "k"])
    colocated, disaggregated = arms.build_arms(args)
    assert [f.name for f in colocated.compose_files] == ["compose.colocated.yaml"] and colocated.url is None
    assert colocated.env["ENGINE_CPUS"] == "0,1" and colocated.env["PD_CHECKPOINT"] == "dummy:small"
    assert (disaggregated.compose_files, disaggregated.url) == ((), "http://h:1")
    assert (disaggregated.env["PREFILL_CPUS"], disaggregated.env["DECODE_CPUS"]) == ("0", "1")


def test_engine_env_override_targets_engine_services() -> None:
    """--engine-env reaches the engine services of each stack (not the router) through a compose override."""
    parser = argparse.ArgumentParser()
    compare.add_cli_args(parser)
    args = parser.parse_args(["--engine-env", "OPENBLAS_NUM_THREADS=1", "--api-key", "k"])
    colocated, disaggregated = arms.build_arms(args)
    assert arms.engine_override(colocated) == {"services": {"engine": {"environment": {"OPENBLAS_NUM_THREADS": "1"}}}}
    assert set(arms.engine_override(disaggregated)["services"]) == {"prefill", "decode"}


def test_colocated_chunked_prefill_mounts_a_generated_engine_config(tmp_path) -> None:
    """--colocated-chunked-prefill writes the colocated config with chunked_prefill and the budget, mounted at /config."""
    parser = argparse.ArgumentParser()
    compare.add_cli_args(parser)
    args = parser.parse_args(["--colocated-chunked-prefill", "--colocated-max-num-batched-tokens", "512",
                              "--api-key", "k", "--out", str(tmp_path)])
    colocated, disaggregated = arms.build_arms(args)
    override = arms.engine_override(colocated)
    assert override == {"services": {"engine": {"volumes": [f"{tmp_path / 'colocated-engine'}:/config:ro"]}}}
    written = json.loads((tmp_path / "colocated-engine" / "config.json").read_text())
    assert written == {**json.loads(arms.COLOCATED_CONFIG.read_text()), "chunked_prefill": True,
                       "max_num_batched_tokens": 512}
    # The engine itself accepts it, as role both with chunking on.
    engine = build(EngineConfig, written, "config.json")
    assert (engine.role, engine.chunked_prefill, engine.max_num_batched_tokens) == ("both", True, 512)
    assert disaggregated.config_dir is None and arms.engine_override(disaggregated) == {}


def test_colocated_chunked_prefill_defaults_to_a_budget_below_the_prompt_size(tmp_path) -> None:
    """Without a budget the flag uses CHUNKED_PREFILL_BUDGET (not the shipped 2048, which never cuts an 800-token prompt)."""
    parser = argparse.ArgumentParser()
    compare.add_cli_args(parser)
    args = parser.parse_args(["--colocated-chunked-prefill", "--engine-env", "OPENBLAS_NUM_THREADS=1",
                              "--api-key", "k", "--out", str(tmp_path)])
    assert serve.check_args(args) == []  # as compare.main does first
    colocated, _ = arms.build_arms(args)
    service = arms.engine_override(colocated)["services"]["engine"]
    assert service["environment"] == {"OPENBLAS_NUM_THREADS": "1"}  # both changes in the one override
    written = json.loads((colocated.config_dir / "config.json").read_text())
    assert written["max_num_batched_tokens"] == arms.CHUNKED_PREFILL_BUDGET < 800
    assert written["chunked_prefill"] is True
    assert "chunked_prefill=true, max_num_batched_tokens=256" in compare.conditions(args, [colocated], "cmd", [["colocated"]])
