"""`python -m stack.bench compare` end to end: two numpy arms through their real compose stacks, swept, repeated."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_compare(args: list[str], prefix: str, timeout_s: float) -> None:
    """`python -m stack.bench compare ARGS` with its own project prefix and key, runs flagged (not refused) on this
    loaded test host (the guard's refusal is unit-tested); every project it started is gone afterwards, also when it
    failed."""
    argv = [sys.executable, "-m", "stack.bench", "compare", *args, "--project-prefix", prefix,
            "--on-high-load", "flag", "--load-wait", "0", "--disable-tqdm"]
    env = {**os.environ, "TAOTOKEN_API_KEY": "sk-bench-" + secrets.token_hex(8)}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        ps = subprocess.run(["docker", "ps", "-aq", "--filter", f"name={prefix}"], capture_output=True, text=True, timeout=30)
        leftovers = ps.stdout.split()
        if leftovers:
            subprocess.run(["docker", "rm", "-f", *leftovers], capture_output=True, timeout=120)
        assert leftovers == []


def test_compare_sweeps_two_arms_over_two_repeats_and_writes_the_report(app_image: None, tmp_path) -> None:
    """Two repeats in alternating order: each arm's stack comes up, answers, climbs two load points, goes down; the
    report gives median [min–max] per arm, the host's load before and after every run, the chart and every run's JSON."""
    run_compare(["--stacks", "colocated,disaggregated", "--repeats", "2", "--sweep", "2,4", "--num-prompts", "4",
                 "--synthetic-input-mean", "120", "--synthetic-output-mean", "8", "--goodput", "tpot:60000", "--warmup", "1",
                 "--checkpoint", "dummy:tiny", "--out", str(tmp_path)], f"pdtest-bench-{secrets.token_hex(3)}", timeout_s=600)
    report = (tmp_path / "compare.md").read_text()
    assert "Repeats: 2, arm order alternate: 1: colocated, disaggregated; 2: disaggregated, colocated" in report
    arm_table = report.split("## numpy")[1].split("### Ratios")[0]
    arm_rows = [line for line in arm_table.splitlines() if line.startswith(("| colocated |", "| disaggregated |"))]
    assert len(arm_rows) == 2 and all(row.count("[") == 5 for row in arm_rows)  # median [min–max] of 2 repeats each
    runs = [json.loads(p.read_text()) for p in sorted((tmp_path / "runs").glob("*.json"))]
    assert sorted((r["repeat"], r["stack"], r["sweep_point"]) for r in runs) == sorted(
        (rep, arm, point) for rep in (0, 1) for arm in ("colocated", "disaggregated") for point in (2.0, 4.0))
    assert all(r["completed"] == 4 and r["loadavg_1m_before"] >= 0 and r["loadavg_1m_after"] >= 0 for r in runs)
    assert all(r["advise"]["verdict"] in ("balanced", "more_prefill", "more_decode", "both", "pd_overhead") for r in runs)
    assert (tmp_path / "load-numpy.png").read_bytes().startswith(PNG_MAGIC)
