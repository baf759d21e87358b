"""stack.bench.report and compare: the table, the charts and a whole compare run over two servers."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from stack.bench import compare, report, serve
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


def test_charts_are_png(tmp_path) -> None:
    """The comparison and sweep charts are written as PNG files."""
    results = {"colocated": fake_result(0.2), "disaggregated": fake_result(0.1)}
    assert report.comparison_chart(results, tmp_path / "c.png").read_bytes().startswith(PNG_MAGIC)
    sweep = {n: [fake_result(g, 1.0), fake_result(g, 2.0)] for n, g in (("colocated", 0.2), ("disaggregated", 0.1))}
    assert report.sweep_chart(sweep, tmp_path / "s.png").read_bytes().startswith(PNG_MAGIC)
    assert report.sweep_table(sweep).splitlines()[2].startswith("| 1.0 | 0.000 | 200.0")


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


def test_compare_over_running_stacks_writes_table_chart_and_sweep(tmp_path) -> None:
    """`compare --url … --sweep` against two servers: per-run JSON, compare.md/png and sweep.md/png."""
    slow, fast = StreamPlan(tokens=4, gap=0.02), StreamPlan(tokens=4, gap=0.005)
    with server_thread(slow) as slow_url, server_thread(fast) as fast_url:
        parser = argparse.ArgumentParser()
        compare.add_cli_args(parser)
        args = parser.parse_args([
            "--url", f"colocated={slow_url}", "--url", f"disaggregated={fast_url}", "--num-prompts", "6",
            "--sweep", "20,40", "--synthetic-input-mean", "50", "--goodput", "tpot:1000", "--warmup", "1",
            "--out", str(tmp_path), "--disable-tqdm",
        ])
        assert compare.main(args) == 0
    assert len(slow.bodies) == len(fast.bodies) == 1 + 2 * 6  # warm-up + two sweep points
    # Same seed: both stacks got the same prompts in the same order.
    assert [b["messages"] for b in slow.bodies] == [b["messages"] for b in fast.bodies]
    table = (tmp_path / "compare.md").read_text()
    assert "| Metric | colocated | disaggregated | disaggregated / colocated |" in table
    assert "Hardware:" in table and "Goodput SLOs: tpot ≤ 1000 ms" in table
    itl_ratio = next(line for line in table.splitlines() if line.startswith("| ITL median"))
    assert float(itl_ratio.rsplit("|", 2)[1].strip(" ×")) < 1.0  # the fast server's gaps are shorter
    for name in ("compare.png", "sweep.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
    assert "| 20.0 |" in (tmp_path / "sweep.md").read_text()
    assert {p.name for p in tmp_path.glob("*qps.json")} == {
        "colocated-20.0qps.json", "colocated-40.0qps.json", "disaggregated-20.0qps.json", "disaggregated-40.0qps.json"}


def test_stack_specs_pin_the_same_cores() -> None:
    """Default budget: colocated engine on cores 0,1; prefill on 0 and decode on 1; --url skips compose."""
    parser = argparse.ArgumentParser()
    compare.add_cli_args(parser)
    args = parser.parse_args(["--url", "disaggregated=http://h:1", "--api-key", "k"])
    colocated, disaggregated = compare.stack_specs(args)
    assert colocated.compose_file.name == "compose.colocated.yaml" and colocated.url is None
    assert colocated.env["ENGINE_CPUS"] == "0,1" and colocated.env["PD_CHECKPOINT"] == "dummy:small"
    assert (disaggregated.compose_file, disaggregated.url) == (None, "http://h:1")
    assert (disaggregated.env["PREFILL_CPUS"], disaggregated.env["DECODE_CPUS"]) == ("0", "1")


def test_engine_env_override_targets_engine_services() -> None:
    """--engine-env reaches the engine services of each stack (not the router) through a compose override."""
    parser = argparse.ArgumentParser()
    compare.add_cli_args(parser)
    args = parser.parse_args(["--engine-env", "OPENBLAS_NUM_THREADS=1", "--api-key", "k"])
    colocated, disaggregated = compare.stack_specs(args)
    assert compare.engine_override(colocated) == {"services": {"engine": {"environment": {"OPENBLAS_NUM_THREADS": "1"}}}}
    assert set(compare.engine_override(disaggregated)["services"]) == {"prefill", "decode"}


def test_colocated_chunked_prefill_mounts_a_generated_engine_config(tmp_path) -> None:
    """--colocated-chunked-prefill writes the colocated config with chunked_prefill and the budget, mounted at /config."""
    parser = argparse.ArgumentParser()
    compare.add_cli_args(parser)
    args = parser.parse_args(["--colocated-chunked-prefill", "--colocated-max-num-batched-tokens", "512",
                              "--api-key", "k", "--out", str(tmp_path)])
    colocated, disaggregated = compare.stack_specs(args)
    override = compare.engine_override(colocated)
    assert override == {"services": {"engine": {"volumes": [f"{tmp_path / 'colocated-engine'}:/config:ro"]}}}
    written = json.loads((tmp_path / "colocated-engine" / "config.json").read_text())
    assert written == {**json.loads(compare.COLOCATED_CONFIG.read_text()), "chunked_prefill": True,
                       "max_num_batched_tokens": 512}
    # The engine itself accepts it, as role both with chunking on.
    engine = build(EngineConfig, written, "config.json")
    assert (engine.role, engine.chunked_prefill, engine.max_num_batched_tokens) == ("both", True, 512)
    assert disaggregated.config_dir is None and compare.engine_override(disaggregated) == {}


def test_colocated_chunked_prefill_defaults_to_a_budget_below_the_prompt_size(tmp_path) -> None:
    """Without a budget the flag uses CHUNKED_PREFILL_BUDGET (not the shipped 2048, which never cuts an 800-token prompt)."""
    parser = argparse.ArgumentParser()
    compare.add_cli_args(parser)
    args = parser.parse_args(["--colocated-chunked-prefill", "--engine-env", "OPENBLAS_NUM_THREADS=1",
                              "--api-key", "k", "--out", str(tmp_path)])
    assert serve.check_args(args) == []  # as compare.main does first
    colocated, _ = compare.stack_specs(args)
    service = compare.engine_override(colocated)["services"]["engine"]
    assert service["environment"] == {"OPENBLAS_NUM_THREADS": "1"}  # both changes in the one override
    written = json.loads((colocated.config_dir / "config.json").read_text())
    assert written["max_num_batched_tokens"] == compare.CHUNKED_PREFILL_BUDGET < 800
    assert written["chunked_prefill"] is True
    assert "chunked_prefill=true, max_num_batched_tokens=256" in compare.conditions(args, [colocated], "cmd")
