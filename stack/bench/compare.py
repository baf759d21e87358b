"""`python -m stack.bench compare`: the arms a user would pick between on the same cores, swept past their knees,
repeated, with the spread.

For each repeat, in that repeat's arm order (alternated or seeded-random, recorded), it starts the arm's compose
project, waits until the router answers a chat completion, warms up, then climbs the load ladder (`--sweep`: request
rates, or agent sessions with the agentic workload) until `--past-knee` points after SLO attainment falls below
`--knee-attainment`, and stops the project. Before every run the host's 1-minute load is checked (refused or flagged
above the core count) and recorded with the load after. `--out` gets compare.md (per engine: max goodput at the
SLOs and P99 TTFT / TPOT / ITL at a common load, median [min–max]; ratios to the best colocated arm, "no difference"
where their range crosses 1.0×; the goals; doctor advise's verdict at each load next to the measured winner),
load-<engine>.png (goodput and P99s against load per arm), compare.png (latency CDFs of the first repeat at the
common load) and every run's JSON under runs/. Arms: see stack/bench/arms.py.

The full experiment, on a quiet machine (nothing else running; images built first: `./pd build` and
scripts/vllm-cpu-image.sh), one command per engine and workload, each a few hours. Both engines serve the same
tiny-llama checkpoint; each engine gets its own ladder because their knees are far apart:

    NUMPY=colocated:cache,colocated-x2:cache,colocated-chunked:cache,disaggregated:cache,disaggregated:cache@0+1/1
    VLLM=vllm:colocated,vllm:colocated-x2,vllm:disaggregated@1/0,vllm:disaggregated@0/1
    CHAT="--dataset-name synthetic --synthetic-input-mean 800 --synthetic-output-mean 128 --num-prompts 60"
    AGENT="--dataset-name agentic --agentic-profile claude-code --agentic-turns 4 --max-model-len 32768"
    python -m stack.bench compare --checkpoint tiny-llama --repeats 3 --order random --stacks $NUMPY $CHAT \
        --sweep 0.25,0.5,1,1.5,2,3,4,6 --goodput ttft:2000 tpot:100 --out results/numpy-chat
    python -m stack.bench compare --checkpoint tiny-llama --repeats 3 --order random --stacks $VLLM $CHAT \
        --sweep 1,2,4,8,12,16,24,32 --goodput ttft:2000 tpot:100 --out results/vllm-chat
    python -m stack.bench compare --checkpoint tiny-llama --repeats 3 --order random --stacks $NUMPY $AGENT \
        --sweep 1,2,4,8 --goodput ttft:10000 tpot:200 --out results/numpy-agentic
    python -m stack.bench compare --checkpoint tiny-llama --repeats 3 --order random --stacks $VLLM $AGENT \
        --sweep 1,2,4,8,16 --goodput ttft:10000 tpot:200 --out results/vllm-agentic

`--url NAME=URL` benchmarks an already running stack instead of starting one.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import platform
import secrets
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from stack.bench import arms, report, repeats, scrape, serve, stacks, summary, sweep
from stack.bench.arms import Arm
from stack.bench.charts import load_chart


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    serve.add_workload_args(parser)
    parser.set_defaults(percentile_metrics="ttft,tpot,itl,e2el", metric_percentiles="90,99")
    parser.add_argument("--checkpoint", default="dummy:small",
                        help=f"model of every arm: dummy:tiny|dummy:small (numpy only), {arms.TINY_LLAMA} (written, served by "
                             "numpy and vLLM alike) or a Hugging Face checkpoint directory")
    parser.add_argument("--max-model-len", type=int, default=2048, help=f"context of {arms.TINY_LLAMA} and of vLLM's engines")
    parser.add_argument("--stacks", default="colocated,disaggregated",
                        help="arms, comma-separated: [vllm:]SHAPE[:cache|:nocache][@CPUS[/CPUS]] (stack/bench/arms.py)")
    parser.add_argument("--url", action="append", default=[], metavar="NAME=URL", help="use a running stack for NAME")
    parser.add_argument("--sweep", default=None, metavar="P,P,…",
                        help="ascending load points: req/s, or agent sessions with --dataset-name agentic")
    parser.add_argument("--knee-attainment", type=float, default=sweep.DEFAULT_THRESHOLD,
                        help="SLO attainment below which an arm is past its knee")
    parser.add_argument("--past-knee", type=int, default=sweep.DEFAULT_PAST_KNEE, help="points run after the knee")
    parser.add_argument("--repeats", type=int, default=3, help="times every arm runs its sweep")
    parser.add_argument("--order", choices=repeats.ORDERS, default="alternate", help="arm order per repeat")
    parser.add_argument("--order-seed", type=int, default=None, help="seed of --order random (default: --seed)")
    parser.add_argument("--max-load", type=float, default=None, help="1-minute load above which a run does not start "
                        "(default: the core count)")
    parser.add_argument("--on-high-load", choices=repeats.POLICIES, default="refuse",
                        help="refuse: stop the experiment; flag: run and mark the figures")
    parser.add_argument("--load-wait", type=float, default=120.0, help="seconds to wait for the load to fall first")
    parser.add_argument("--warmup", type=int, default=4, help="requests sent (and ignored) before measuring")
    parser.add_argument("--out", default="results", help="directory for the tables, charts and JSON")
    parser.add_argument("--project-prefix", default="pdbench", help="docker compose project name prefix")
    parser.add_argument("--colocated-cpus", default="0,1", help="cpus of a colocated engine (colocated-x2: one replica per cpu)")
    parser.add_argument("--prefill-cpus", default="0", help="cpus of the prefill engine")
    parser.add_argument("--decode-cpus", default="1", help="cpus of the decode engine")
    parser.add_argument("--router-cpus", default="", help="cpuset of the router (default: unpinned)")
    parser.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for every engine container, e.g. OPENBLAS_NUM_THREADS=1")
    parser.add_argument("--colocated-chunked-prefill", action="store_true",
                        help="run the numpy colocated engine with chunked_prefill (vLLM V1's default)")
    parser.add_argument("--colocated-max-num-batched-tokens", type=int, default=None, metavar="N",
                        help=f"step token budget of the numpy colocated engine (chunked default: {arms.CHUNKED_PREFILL_BUDGET})")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a stack to come up and answer")
    parser.add_argument("--keep-up", action="store_true", help="leave the last stack running (debugging)")


def agentic(args: argparse.Namespace) -> bool:
    return args.dataset_name == "agentic"


def unit(args: argparse.Namespace) -> str:
    return "sessions" if agentic(args) else "req/s"


def plan(args: argparse.Namespace) -> sweep.SweepPlan:
    if args.sweep:
        return sweep.SweepPlan.parse(args.sweep, args.knee_attainment, args.past_knee)
    return sweep.SweepPlan((float(args.agentic_sessions if agentic(args) else args.request_rate),), args.knee_attainment, 0)


def point_args(args: argparse.Namespace, base_url: str, point: float, label: str) -> argparse.Namespace:
    """The `serve` arguments of one measured run: a request rate, or with the agentic workload a number of sessions.
    Each point of the ladder draws its own prompts (seed + 2 + the point's rank; the warm-up has seed + 1), the same
    for every arm and repeat: with one set for the whole ladder, every point after the first would find its prompts
    in the engines' prefix cache (measured: 90 % of vLLM's prompt tokens cached) and prefill would cost nothing. The
    agentic workload's system prompt and tools are the exception: one agent product's prefix, the same at every point
    and in the warm-up, which heats it as a deployment's traffic keeps it hot (agentic.prefix_rng)."""
    one = copy.copy(args)
    one.base_url, one.label = base_url, label
    one.seed = args.seed + 2 + plan(args).points.index(point)
    if agentic(args):
        one.agentic_prefix_seed = product_seed(args)
        one.request_rate, one.agentic_sessions = float("inf"), int(point)
        one.num_prompts = one.agentic_sessions * args.agentic_turns
    else:
        one.request_rate = point
    return one


def product_seed(args: argparse.Namespace) -> int:
    """The agentic system prompt's and tools' seed over the whole experiment."""
    return args.seed if args.agentic_prefix_seed is None else args.agentic_prefix_seed


# The agentic warm-up's sessions, each with its own session id, run one after another. Cache-aware routing places a
# session by its id, so several are needed for every engine of an arm to compute the product's prefix once (six
# leave one of two replicas cold with probability 1/32), as a deployment's traffic keeps every replica's copy hot.
# Measured without it: the one warm-up session heated one of colocated-x2's replicas, and the first measured session
# that hashed to the other waited 130 s for a cold one-core prefill of the 29k-token prefix. In turn, not at once:
# concurrent cold copies of one prefix would each be computed.
WARM_SESSIONS = 6


def warmup_args(args: argparse.Namespace, base_url: str) -> argparse.Namespace:
    """Warm-up on other prompts (seed + 1): loads code paths and the model, not the measured run's prefixes (but for
    the agentic product's system prompt and tools, which it heats)."""
    one = copy.copy(args)
    one.base_url, one.seed, one.disable_tqdm, one.request_rate, one.label = base_url, args.seed + 1, True, float("inf"), None
    one.max_concurrency = 1  # one request (agentic: one session) at a time
    if agentic(args):  # short sessions one after another, no pauses, on the product's prefix
        one.agentic_prefix_seed = product_seed(args)
        one.agentic_sessions, one.agentic_turns, one.agentic_think_mean_s, one.agentic_stagger_s = WARM_SESSIONS, 1, 0.0, 0.0
        one.num_prompts = WARM_SESSIONS
    else:
        one.num_prompts = args.warmup
    return one


async def measure(args: argparse.Namespace, arm: Arm, base_url: str, repeat: int, guard: repeats.LoadGuard) -> list[dict]:
    """Warm up, then climb the ladder until the sweep plan says the arm is past its knee."""
    await stacks.wait_answering(base_url, args.api_key, args.startup_timeout)
    if args.warmup:
        print(f"[compare] {arm.name}: warm-up", flush=True)
        await serve.benchmark(warmup_args(args, base_url))
    ladder = plan(args)
    results: list[dict] = []
    while (point := ladder.next_point(results)) is not None:
        one = point_args(args, base_url, point, arm.name)
        what = f"repeat {repeat + 1}, {arm.name}, {point:g} {unit(args)}"
        load_before, flagged = guard.check(what)
        print(f"[compare] {what}: {one.num_prompts} requests (load {load_before:.2f}{', FLAGGED' if flagged else ''})", flush=True)
        before = await scrape.router_metrics(base_url)
        result = await serve.benchmark(one)
        after = await scrape.router_metrics(base_url)
        result.update(stack=arm.name, repeat=repeat, sweep_point=point, loadavg_1m_before=load_before,
                      loadavg_1m_after=os.getloadavg()[0], load_flagged=flagged,
                      cpus={k: v for k, v in arm.env.items() if k.endswith("_CPUS")},
                      router_cache=scrape.cache_summary(scrape.parse_counters(before[1]), scrape.parse_counters(after[1])),
                      advise=scrape.advise_verdict(before, after, args.goodput_ms or {}))
        if result["request_goodput"] is not None:
            result["slo_attainment"] = result["request_goodput"] * result["duration"] / one.num_prompts
        for line in serve.failure_lines(result):
            print(line)
        print(serve.format_result(result, args.percentile_metrics.split(","), args.percentiles), flush=True)
        results.append(result)
    return results


def run_arm(args: argparse.Namespace, arm: Arm, repeat: int, guard: repeats.LoadGuard, last: bool) -> list[dict]:
    if arm.url:
        return asyncio.run(measure(args, arm, arm.url.rstrip("/"), repeat, guard))
    project = f"{args.project_prefix}-{arm.name}".replace(":", "-").replace("@", "-at").replace("/", "-").replace("+", "_")
    try:
        base_url = stacks.start(arm, project, args.startup_timeout)
        return asyncio.run(measure(args, arm, base_url, repeat, guard))
    finally:
        if not (args.keep_up and last):
            stacks.stop(arm, project)


def hardware() -> str:
    """CPU model and count from lscpu (the figures mean nothing without the hardware next to them)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    model = fields.get("Model name", "?").strip()
    return f"{model}, {fields.get('CPU(s)', '?').strip()} vCPU ({fields.get('Hypervisor vendor', 'bare metal').strip()})"


def conditions(args: argparse.Namespace, specs: list[Arm], command: str, orders: list[list[str]]) -> str:
    slos = ", ".join(f"{k} ≤ {v:g} ms" for k, v in (args.goodput_ms or {}).items()) or "none"
    cpus = "; ".join(f"{s.name}: " + ", ".join(f"{k}={v}" for k, v in s.env.items() if k.endswith("_CPUS") and v) for s in specs)
    engine_env = "; ".join(f"{s.name}: " + " ".join(f"{k}={v}" for k, v in s.engine_env.items()) for s in specs if s.engine_env) \
        or "none (as the compose files ship)"
    changes = arms.colocated_config_changes(args)
    colocated_config = ("colocated/config.json with " + ", ".join(f"{k}={json.dumps(v)}" for k, v in changes.items())
                        if changes else "colocated/config.json as shipped")
    workload = (f"agentic: sessions × {args.agentic_turns} turns, system prompt {args.agentic_system_len} tokens, "
                f"{args.agentic_tools} tools" if agentic(args) else f"{args.dataset_name}, {args.num_prompts} prompts per point")
    seed = args.seed if args.order_seed is None else args.order_seed
    return "\n".join([
        f"- Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Command: `{command}`",
        f"- Hardware: {hardware()}; Python {platform.python_version()}",
        f"- CPU placement: {cpus}",
        f"- Model: {args.checkpoint} (max model len {args.max_model_len}); lengths in {'its tokens' if args.tokenizer else 'bytes'}; "
        f"endpoint {args.endpoint}; workload {workload}; "
        f"seed {args.seed}; burstiness {args.burstiness}; max concurrency {args.max_concurrency}",
        f"- Goodput SLOs: {slos}; knee: SLO attainment < {args.knee_attainment:.0%}, then {args.past_knee} more point(s)",
        f"- Repeats: {args.repeats}, arm order {args.order}" + (f" (seed {seed})" if args.order == "random" else "") + ": "
        + "; ".join(f"{i + 1}: {', '.join(o)}" for i, o in enumerate(orders)),
        f"- Extra engine environment: {engine_env}",
        f"- Colocated numpy engine config: {colocated_config}",
    ])


def runs_table(runs: list[dict], unit_name: str) -> str:
    """Markdown: every run in the order it ran, with the host's load before and after and whether it was flagged."""
    lines = [f"| # | Repeat | Arm | Load ({unit_name}) | 1-min load before → after | Flagged | SLO attainment | Failed |",
             "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs, 1):
        attained = r.get("slo_attainment")
        lines.append(f"| {i} | {r['repeat'] + 1} | {r['stack']} | {r['sweep_point']:g} | {r['loadavg_1m_before']:.2f} → "
                     f"{r['loadavg_1m_after']:.2f} | {'yes' if r['load_flagged'] else ''} | "
                     f"{'–' if attained is None else f'{attained:.0%}'} | {r['failed']} |")
    return "\n".join(lines)


def model_label(checkpoint: str) -> str:
    """The checkpoint as the report's titles name it: a dummy model's id, or a directory's own name (not where it lies
    on the machine that ran the experiment)."""
    return checkpoint if checkpoint.startswith("dummy:") else Path(checkpoint).name


def save_runs(args: argparse.Namespace, runs: list[dict]) -> None:
    """Each run's JSON under --out/runs/, written as its arm finishes: an experiment of hours that is stopped keeps
    what it measured."""
    directory = Path(args.out) / "runs"
    directory.mkdir(parents=True, exist_ok=True)
    for r in runs:
        name = f"{r['repeat'] + 1}-{r['stack']}-{r['sweep_point']:g}".replace(":", "-").replace("/", "-")
        (directory / f"{name}.json").write_text(json.dumps(r))


def write_report(args: argparse.Namespace, specs: list[Arm], runs: list[dict], command: str, orders: list[list[str]]) -> Path:
    """compare.md and the charts from `runs` (each already saved by save_runs as its arm finished)."""
    out = Path(args.out)
    unit_name = unit(args)
    flagged = sum(r["load_flagged"] for r in runs)
    model = model_label(args.checkpoint)
    body = [f"# Colocated vs disaggregated ({model})", "", conditions(args, specs, command, orders), ""]
    if flagged:
        body += [f"**{flagged} of {len(runs)} runs started with the host's load above {args.max_load or os.cpu_count()}: "
                 "their figures measure other work too (Flagged column below).**", ""]
    for engine in ("numpy", "vllm"):
        section = summary.engine_section(runs, engine, args.knee_attainment, unit_name)
        if section:
            chart = load_chart([r for r in runs if summary.engine_of(r["stack"]) == engine], out / f"load-{engine}.png",
                               unit_name, title=f"{engine}: {model}, median and min–max of "
                                     f"{len(summary.repeats_of(runs))} repeats")  # those that ran
            body += [*section, f"![latency and goodput vs load]({chart.name})", ""]
    first = [r for r in runs if r["repeat"] == 0]
    names = list(dict.fromkeys(r["stack"] for r in first))
    common = summary.common_load(first, names, args.knee_attainment)
    detail = {n: r for n in names if (r := sweep.at_point([x for x in first if x["stack"] == n], common or math.nan))}
    if detail:
        body += [f"## Detail: repeat 1 at {common:g} {unit_name}", "", report.comparison_table(detail), "", "![latency](compare.png)",
                 "", "Prefix cache and routing (router /metrics over the run):", "", report.cache_table(detail), ""]
        report.comparison_chart(detail, out / "compare.png", title=f"{model}, repeat 1, {common:g} {unit_name}")
    body += ["## Every run", "", runs_table(runs, unit_name), ""]
    path = out / "compare.md"
    path.write_text("\n".join(body))
    return path


def check(args: argparse.Namespace) -> list[str]:
    problems = serve.check_args(args)
    try:
        plan(args)
    except sweep.SweepError as exc:
        problems.append(str(exc))
    if args.colocated_max_num_batched_tokens is not None and args.colocated_max_num_batched_tokens <= 0:
        problems.append(f"--colocated-max-num-batched-tokens must be positive, got {args.colocated_max_num_batched_tokens}")
    malformed = [item for item in args.url + args.engine_env if "=" not in item]
    if malformed:
        problems.append(f"--url / --engine-env take NAME=VALUE, got {malformed}")
    if args.repeats < 1:
        problems.append(f"--repeats must be >= 1, got {args.repeats}")
    return problems + arms.arms_problems(args)


def main(args: argparse.Namespace) -> int:
    problems = check(args)
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    # The stacks need a unified key; make a throwaway one when the environment has none.
    args.api_key = args.api_key or "bench-" + secrets.token_urlsafe(16)
    specs = {arm.name: arm for arm in arms.build_arms(args)}
    if not args.tokenizer and not args.checkpoint.startswith("dummy:"):
        # Prompt lengths in the served model's tokens, not bytes (the dummy models' byte tokenizer counts bytes).
        args.tokenizer = str(arms.checkpoint_dir(args) / "tokenizer.json")
    orders = repeats.arm_orders(list(specs), args.repeats, args.order, args.seed if args.order_seed is None else args.order_seed)
    guard = repeats.LoadGuard.for_host(args.max_load, args.on_high_load, args.load_wait)
    runs: list[dict] = []
    try:
        for repeat, order in enumerate(orders):
            for i, name in enumerate(order):
                last = repeat == len(orders) - 1 and i == len(order) - 1
                arm_runs = run_arm(args, specs[name], repeat, guard, last)
                save_runs(args, arm_runs)
                runs += arm_runs
    except (stacks.StackError, repeats.HostBusy, subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        print(f"error: {exc or 'interrupted'}", file=sys.stderr)
        if runs:
            print(f"[compare] wrote the {len(runs)} runs so far: {write_report(args, list(specs.values()), runs, command_of(args), orders)}")
        return 1
    path = write_report(args, list(specs.values()), runs, command_of(args), orders)
    print(path.read_text())
    print(f"[compare] wrote {path}")
    return 0


def command_of(args: argparse.Namespace) -> str:
    return getattr(args, "command_line", "python -m stack.bench compare …")
