"""stack.bench.report and compare: the table, the charts and a whole compare run over two servers."""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from stack.bench import compare, report
from stack.bench.metrics import detailed_fields, outcome_from_chunks, summarize
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
