"""`python -m stack.bench serve`: one benchmark run, flag- and JSON-compatible with `vllm bench serve`.

The printed block and the saved JSON use vLLM's layout and field names, so results from this
tool and from `vllm bench serve` against a GPU stack can be compared side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from stack.bench import agentic, dataset
from stack.bench.loadgen import Job, Progress, arrival_times, run_load
from stack.bench.metrics import METRICS, detailed_fields, parse_goodput, percentile_word, summarize

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `serve` and `compare`: what to send and how fast (vLLM's names)."""
    parser.add_argument("--model", default=None, help="model id; default: the first of GET /v1/models")
    parser.add_argument("--endpoint", default=CHAT, choices=[CHAT, COMPLETIONS], help="API path")
    parser.add_argument(
        "--dataset-name", default="synthetic", choices=["sharegpt", "random", "synthetic", "agentic"],
        help="sharegpt: --dataset-path file; random: vLLM's random set; synthetic: ShareGPT-like lengths; "
             "agentic: multi-turn coding-agent sessions (--agentic-*; closed loop, --request-rate unused)",
    )
    parser.add_argument("--dataset-path", default=None, help="ShareGPT_V3-format JSON file")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (Poisson); inf = all at t=0")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of gaps: 1 = Poisson, <1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="cap on requests in flight (agentic: on sessions running at once)")
    parser.add_argument("--seed", type=int, default=0, help="seed for prompts and arrival times")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json to count tokens (default: the dummy models' BPE, as the default stack counts)")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output budget for sharegpt")
    parser.add_argument("--synthetic-input-mean", type=int, default=800, help="mean prompt tokens (article: ~800)")
    parser.add_argument("--synthetic-output-mean", type=int, default=128, help="mean output tokens")
    parser.add_argument("--synthetic-sigma", type=float, default=0.5, help="log-normal spread of lengths (0 = fixed)")
    defaults = agentic.AgenticShape()
    for name, kind, text in (
        ("sessions", int, "concurrent agent sessions (--num-prompts becomes sessions × turns)"),
        ("turns", int, "turns per session"),
        ("system_len", int, "tokens of the system prompt every session shares"),
        ("tools", int, "tool definitions every request carries"),
        ("turn_len", int, "new user tokens per turn (task, then tool results)"),
        ("output_len", int, "tokens generated per turn (ignore_eos)"),
        ("think_mean_s", float, "mean think time between a session's turns (exponential)"),
        ("stagger_s", float, "sessions start uniformly within this many seconds"),
    ):
        parser.add_argument(f"--agentic-{name.replace('_', '-')}", dest=f"agentic_{name}", type=kind,
                            default=getattr(defaults, name), help=text)
    parser.add_argument("--agentic-profile", choices=sorted(agentic.PROFILES), default=None,
                        help="a real agent's system prompt and tool list sizes (claude-code: 27k characters, 14 tools); "
                             "overrides --agentic-system-len and --agentic-tools")
    parser.add_argument("--agentic-prefix-seed", type=int, default=None,
                        help="seed of the system prompt and tools alone (default: drawn with the sessions from --seed); "
                             "compare holds it at --seed over its whole ladder, as one agent product's prefix")
    parser.add_argument(
        "--ignore-eos", action="store_true",
        help="send vLLM's ignore_eos: generate the full output budget (always on for --dataset-name random)",
    )
    parser.add_argument(
        "--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs for goodput: ttft:MS tpot:MS e2el:MS"
    )
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument(
        "--api-key", default=os.environ.get("TAOTOKEN_API_KEY"), help="sent as Bearer (default: $TAOTOKEN_API_KEY)"
    )
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8080", help="server root, e.g. http://host:8080")
    add_workload_args(parser)
    parser.add_argument("--label", default=None, help="result label (default: the backend name)")
    parser.add_argument("--save-result", action="store_true", help="write the result JSON")
    parser.add_argument("--save-detailed", action="store_true", help="also keep per-request lists in the JSON")
    parser.add_argument("--result-dir", default=None)
    parser.add_argument("--result-filename", default=None)


def check_args(args: argparse.Namespace) -> list[str]:
    """Problems with the flags, one message each (empty = fine)."""
    problems = []
    try:
        args.goodput_ms = parse_goodput(args.goodput)
    except ValueError as exc:
        problems.append(str(exc))
    bad = [m for m in args.percentile_metrics.split(",") if m not in METRICS]
    if bad:
        problems.append(f"--percentile-metrics: unknown {bad}; choose from {list(METRICS)}")
    try:
        args.percentiles = [float(p) for p in args.metric_percentiles.split(",")]
        if not all(0 <= p <= 100 for p in args.percentiles):
            raise ValueError
    except ValueError:
        problems.append(f"--metric-percentiles: {args.metric_percentiles!r} is not numbers in [0, 100]")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        problems.append("--dataset-name sharegpt needs --dataset-path")
    if args.request_rate <= 0 or args.burstiness <= 0 or args.num_prompts <= 0:
        problems.append("--request-rate, --burstiness and --num-prompts must be > 0")
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        problems.append("--max-concurrency must be > 0")
    if args.dataset_name == "agentic":
        for name, value in agentic.PROFILES.get(args.agentic_profile or "", {}).items():
            setattr(args, f"agentic_{name}", value)
        problems += agentic_shape(args).problems()
        args.num_prompts = args.agentic_sessions * args.agentic_turns
    return problems


def agentic_shape(args: argparse.Namespace) -> agentic.AgenticShape:
    return agentic.AgenticShape(**{name: getattr(args, f"agentic_{name}") for name in agentic.AgenticShape.__dataclass_fields__})


def agentic_workload(args: argparse.Namespace) -> agentic.Workload:
    prefix = None if args.agentic_prefix_seed is None else agentic.prefix_rng(args.agentic_prefix_seed)
    return agentic.build_workload(agentic_shape(args), np.random.default_rng(args.seed), token_counter(args), prefix)


def token_counter(args: argparse.Namespace) -> dataset.TokenCounter:
    return dataset.hf_counter(args.tokenizer) if args.tokenizer else dataset.dummy_count


def sample_requests(args: argparse.Namespace, rng: np.random.Generator) -> list[dataset.SampleRequest]:
    assert args.dataset_name != "agentic", "agentic sessions are built by agentic.build_workload"
    count = token_counter(args)
    if args.dataset_name == "sharegpt":
        return dataset.load_sharegpt(args.dataset_path, args.num_prompts, rng, count, args.sharegpt_output_len)
    if args.dataset_name == "random":
        return dataset.random_requests(
            args.num_prompts, rng, args.random_input_len, args.random_output_len, args.random_range_ratio, count
        )
    return dataset.synthetic_sharegpt(
        args.num_prompts, rng, args.synthetic_input_mean, args.synthetic_output_mean, args.synthetic_sigma, count=count
    )


def build_job(args: argparse.Namespace, model: str, request: dataset.SampleRequest) -> Job:
    """The request body vLLM's openai / openai-chat backends send, with usage in the stream."""
    payload: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if args.endpoint == CHAT:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        payload["max_completion_tokens"] = request.expected_output_len
    else:
        payload["prompt"] = request.prompt
        payload["max_tokens"] = request.expected_output_len
    if args.ignore_eos or args.dataset_name == "random":  # vLLM forces it for random sets too
        payload["ignore_eos"] = True
    return Job(payload, request.prompt_len)


async def first_model(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> str:
    async with session.get(f"{base_url}/v1/models", headers=headers) as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload against `args.base_url` and return the result dict (with per-request lists)."""
    rng = np.random.default_rng(args.seed)
    requests = [] if args.dataset_name == "agentic" else sample_requests(args, rng)
    send_times = arrival_times(len(requests), args.request_rate, args.burstiness, rng)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base_url = args.base_url.rstrip("/")
    # One session for the run; no pool limit of its own (the semaphore is the only cap).
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=6 * 60 * 60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = args.model or await first_model(session, base_url, headers)
        if args.dataset_name == "agentic":
            workload = agentic_workload(args)
            print(f"Agentic sessions: {len(workload.sessions)} × {args.agentic_turns} turns (closed loop)")
            progress = Progress(workload.requests, stream=None if args.disable_tqdm else sys.stderr)
            outcomes, duration = await agentic.run_sessions(session, base_url + CHAT, workload, model, headers, progress,
                                                            max_sessions=args.max_concurrency)
            return _result(args, model, outcomes, duration)
        jobs = [build_job(args, model, r) for r in requests]
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Burstiness factor: {args.burstiness} ({'Poisson process' if args.burstiness == 1 else 'Gamma distribution'})")
        print(f"Maximum request concurrency: {args.max_concurrency}")
        progress = Progress(len(jobs), stream=None if args.disable_tqdm else sys.stderr)
        outcomes, duration = await run_load(
            session, base_url + args.endpoint, jobs, headers, send_times, args.max_concurrency, progress
        )
    return _result(args, model, outcomes, duration)


def _result(args: argparse.Namespace, model: str, outcomes: list, duration: float) -> dict[str, Any]:
    metrics = args.percentile_metrics.split(",")
    summary = summarize(outcomes, duration, metrics, args.percentiles, args.goodput_ms or None)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if args.endpoint == CHAT else "openai",
        "label": args.label,
        "model_id": model,
        "tokenizer_id": args.tokenizer or "dummy-bpe",
        "num_prompts": args.num_prompts,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "goodput_slos_ms": args.goodput_ms or None,
        **summary,
        **detailed_fields(outcomes),
    }
    return result


def format_result(result: dict[str, Any], percentile_metrics: list[str], percentiles: list[float]) -> str:
    """vLLM's "Serving Benchmark Result" block."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    row = "{:<40} {:<10}".format
    num = "{:<40} {:<10.2f}".format
    lines.append(row("Successful requests:", result["completed"]))
    lines.append(row("Failed requests:", result["failed"]))
    if result["max_concurrency"] is not None:
        lines.append(row("Maximum request concurrency:", result["max_concurrency"]))
    if result["request_rate"] != "inf":
        lines.append(num("Request rate configured (RPS):", result["request_rate"]))
    lines.append(num("Benchmark duration (s):", result["duration"]))
    lines.append(row("Total input tokens:", result["total_input_tokens"]))
    lines.append(row("Total generated tokens:", result["total_output_tokens"]))
    lines.append(num("Request throughput (req/s):", result["request_throughput"]))
    if result["request_goodput"] is not None:
        lines.append(num("Request goodput (req/s):", result["request_goodput"]))
    lines.append(num("Output token throughput (tok/s):", result["output_throughput"]))
    lines.append(num("Peak concurrent requests:", result["max_concurrent_requests"]))
    lines.append(num("Total token throughput (tok/s):", result["total_token_throughput"]))
    for metric in percentile_metrics:
        name, header = METRIC_HEADERS[metric]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(num(f"Mean {name} (ms):", result[f"mean_{metric}_ms"]))
        lines.append(num(f"Median {name} (ms):", result[f"median_{metric}_ms"]))
        for p in percentiles:
            word = percentile_word(p)
            lines.append(num(f"P{word} {name} (ms):", result[f"p{word}_{metric}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)


def failure_lines(result: dict[str, Any], cap: int = 10) -> list[str]:
    """vLLM prints the first errors of failed requests; so do we."""
    errors = [e for e in result["errors"] if e]
    if not errors:
        return []
    return ["Failed requests during benchmark run detected (capping to 10):"] + [
        f"Error {i}: {error}" for i, error in enumerate(errors[:cap])
    ]


def to_saved_json(result: dict[str, Any], detailed: bool) -> dict[str, Any]:
    """What `--save-result` writes: per-request lists only with `--save-detailed`, errors always."""
    if detailed:
        return result
    dropped = {"input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times"}
    return {k: v for k, v in result.items() if k not in dropped}


def result_path(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    """vLLM's default name: `<label>-<rate>qps[-concurrency<N>]-<model>-<date>.json`."""
    label = args.label or result["backend"]
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    model = str(result["model_id"]).split("/")[-1]
    name = args.result_filename or f"{label}-{args.request_rate}qps{concurrency}-{model}-{result['date']}.json"
    return Path(args.result_dir or ".") / name


def main(args: argparse.Namespace) -> int:
    problems = check_args(args)
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(benchmark(args))
    except (dataset.DatasetError, aiohttp.ClientError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for line in failure_lines(result):
        print(line)
    print(format_result(result, args.percentile_metrics.split(","), args.percentiles))
    if args.save_result:
        path = result_path(args, result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(to_saved_json(result, args.save_detailed), indent=2))
        print(f"Result saved to {path}")
    return 0 if result["completed"] else 1
