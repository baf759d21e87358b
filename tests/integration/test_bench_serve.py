"""`python -m stack.bench serve` end to end against the disaggregated compose stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.compose_stack import Stack

pytestmark = pytest.mark.integration


def test_serve_writes_valid_result_json(pd_stack: Stack, tmp_path) -> None:
    """8 streamed chat requests through the router: all complete, the JSON has vLLM's fields and sane values."""
    argv = [sys.executable, "-m", "stack.bench", "serve", "--base-url", pd_stack.router_url, "--num-prompts", "8",
            "--request-rate", "4", "--max-concurrency", "4", "--synthetic-input-mean", "120",
            "--synthetic-output-mean", "12", "--synthetic-sigma", "0.3", "--goodput", "ttft:60000", "tpot:60000",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "run.json", "--disable-tqdm"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TAOTOKEN_API_KEY": pd_stack.api_key})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "============ Serving Benchmark Result ============" in done.stdout
    result = json.loads((tmp_path / "run.json").read_text())
    assert (result["completed"], result["failed"], result["num_prompts"]) == (8, 0, 8)
    assert result["errors"] == [""] * 8
    assert result["total_input_tokens"] >= 8 * 60  # usage.prompt_tokens from the engine: prompt + template
    assert result["total_output_tokens"] >= 8  # at least one token each (random weights may stop early)
    assert 0 < result["mean_ttft_ms"] <= result["p99_ttft_ms"] < 60000
    assert result["p99_e2el_ms"] >= result["p99_ttft_ms"] * 0.999
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # generous SLOs: all good


def test_serve_counts_rejected_requests_as_failed(pd_stack: Stack, tmp_path) -> None:
    """With a wrong key every request fails with the router's 401, counted and printed, exit code 1."""
    argv = [sys.executable, "-m", "stack.bench", "serve", "--base-url", pd_stack.router_url, "--model", "any",
            "--num-prompts", "3", "--synthetic-input-mean", "40", "--api-key", "sk-wrong", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bad.json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads((tmp_path / "bad.json").read_text())
    assert (result["completed"], result["failed"]) == (0, 3)
    assert all(e.startswith("HTTP 401") for e in result["errors"])
    assert "Error 0: HTTP 401" in done.stdout


def test_serve_random_dataset_gets_full_outputs(pd_stack: Stack, tmp_path) -> None:
    """`--dataset-name random` sends ignore_eos (as vLLM): every request yields exactly its 8-token budget."""
    argv = [sys.executable, "-m", "stack.bench", "serve", "--base-url", pd_stack.router_url, "--num-prompts", "4",
            "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "8",
            "--endpoint", "/v1/completions", "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
            "--result-filename", "random.json", "--disable-tqdm"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TAOTOKEN_API_KEY": pd_stack.api_key})
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "random.json").read_text())
    assert result["backend"] == "openai" and result["completed"] == 4
    assert result["output_lens"] == [8, 8, 8, 8]
    assert all(0 < ttft <= latency for ttft, latency in zip(result["ttfts"], result["latencies"]))
