"""stack.bench.serve: a whole run against the in-process SSE server, vLLM's output and JSON names."""

from __future__ import annotations

import argparse
import json

import pytest

from stack.bench import serve
from stack.bench.dataset import SampleRequest, dummy_count


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(argv)
    assert serve.check_args(args) == []
    return args


VLLM_FIELDS = {
    "date", "backend", "label", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "errors",
}


async def test_run_produces_vllm_fields(sse_server, plan, tmp_path) -> None:
    """A 12-request run: all complete, vLLM's field names, model from /v1/models, chat body as vLLM sends."""
    plan.tokens = 4
    args = parse([
        "--base-url", str(sse_server.make_url("")), "--num-prompts", "12", "--request-rate", "200",
        "--max-concurrency", "3", "--dataset-name", "synthetic", "--synthetic-input-mean", "60",
        "--synthetic-sigma", "0", "--goodput", "ttft:5000", "tpot:5000", "--percentile-metrics",
        "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99.9", "--api-key", "sk-test", "--disable-tqdm",
    ])
    result = await serve.benchmark(args)
    assert VLLM_FIELDS <= result.keys()
    assert (result["completed"], result["failed"], result["model_id"]) == (12, 0, "dummy:small")
    assert result["total_output_tokens"] == 12 * 4
    assert result["total_input_tokens"] == 12 * 5  # the server's usage.prompt_tokens
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # loose SLOs: all good
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms", f"p50_{metric}_ms",
                f"p99.9_{metric}_ms"} <= result.keys()
    body = plan.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    # 60 tokens as the default stack counts them (the dummy models' BPE), the nearest prefix of whole words
    assert body["messages"][0]["role"] == "user" and 55 <= dummy_count(body["messages"][0]["content"]) <= 60
    assert body["max_completion_tokens"] > 0 and "ignore_eos" not in body
    assert plan.headers[0]["Authorization"] == "Bearer sk-test"
    assert plan.max_in_flight <= 3

    text = serve.format_result(result, ["ttft", "tpot", "itl", "e2el"], [50, 99.9])
    assert text.splitlines()[0] == "{:=^50}".format(" Serving Benchmark Result ")
    assert "{:<40} {:<10}".format("Successful requests:", 12) in text
    assert "Request goodput (req/s):" in text and "P99.9 E2EL (ms):" in text

    args.save_result, args.result_dir = True, str(tmp_path)
    saved = serve.to_saved_json(result, detailed=False)
    json.dumps(saved)  # serializable
    assert "ttfts" not in saved and saved["errors"] == [""] * 12
    assert serve.result_path(args, result).name.startswith("openai-chat-200.0qps-concurrency3-dummy:small-")


async def test_failed_requests_are_counted_with_errors(sse_server, plan) -> None:
    """Every request answered 401: failed = num_prompts, errors kept, printed like vLLM."""
    plan.status = 401
    args = parse(["--base-url", str(sse_server.make_url("")), "--model", "m", "--num-prompts", "3",
                  "--synthetic-input-mean", "20", "--disable-tqdm"])
    result = await serve.benchmark(args)
    assert (result["completed"], result["failed"]) == (0, 3)
    assert all(e.startswith("HTTP 401") for e in result["errors"])
    assert serve.failure_lines(result)[1].startswith("Error 0: HTTP 401")


def test_completions_body_and_ignore_eos() -> None:
    """--endpoint /v1/completions sends `prompt`/`max_tokens`; ignore_eos only when asked or for random sets."""
    sample = SampleRequest("hello", 5, 7)
    job = serve.build_job(parse(["--endpoint", "/v1/completions", "--ignore-eos"]), "m", sample)
    assert job.payload["prompt"] == "hello" and job.payload["max_tokens"] == 7 and job.payload["ignore_eos"] is True
    assert "messages" not in job.payload
    assert "ignore_eos" not in serve.build_job(parse([]), "m", sample).payload
    assert serve.build_job(parse(["--dataset-name", "random"]), "m", sample).payload["ignore_eos"] is True


def test_bad_flags_are_reported() -> None:
    """Unknown goodput keys, metrics and percentiles each give one message."""
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(["--goodput", "itl:5", "--percentile-metrics", "ttft,foo",
                              "--metric-percentiles", "99,abc", "--dataset-name", "sharegpt"])
    problems = serve.check_args(args)
    assert len(problems) == 4
    assert any("itl:5" in p for p in problems) and any("foo" in p for p in problems)
