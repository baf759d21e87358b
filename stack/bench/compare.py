"""`python -m stack.bench compare`: colocated vs disaggregated on the same cores, same model, same load.

For each stack in turn it starts the compose project (pinning engine containers to the CPU
budget), waits until the router answers, warms up, runs the identical seeded workload through the
router (once, or per `--sweep` rate), stops the project, and finally writes to `--out`:
`compare.md` (table + conditions), `compare.png` (latency CDFs and P99), per-run result JSONs, and
with `--sweep` also `sweep.md`/`sweep.png` (goodput vs rate, DistServe-style).

`--url NAME=URL` benchmarks an already running stack instead of starting one (for a stack on
another machine, or the engines started by hand on loopback).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp

from stack.bench import report, serve

REPO = Path(__file__).resolve().parents[2]
# The arms, each its own best configuration on the same cores: one colocated engine on all of them, one colocated
# replica per core behind the router (cache_aware keeps a session on one replica), one colocated engine with chunked
# prefill, and 1P1D. `NAME:cache` / `NAME:nocache` runs the arm's engines with prefix caching on / off
# (PD_PREFIX_CACHING=1|0); a bare NAME leaves the engines' config as it ships.
STACKS = ("colocated", "colocated-x2", "colocated-chunked", "disaggregated")
CACHE_MODES = {"": None, "cache": "1", "nocache": "0"}
COMPOSE_FILES = {"colocated": "compose.colocated.yaml", "colocated-x2": "compose.colocated.yaml",
                 "colocated-chunked": "compose.colocated.yaml", "disaggregated": "compose.yaml"}
ENGINE_SERVICES = {"colocated": ("engine",), "colocated-x2": ("engine", "engine2"), "colocated-chunked": ("engine",),
                   "disaggregated": ("prefill", "decode")}
COLOCATED_CONFIG = REPO / "colocated" / "config.json"
# Chunk budget with --colocated-chunked-prefill: a 256-token chunk costs ≈ 0.15–0.2 s on one core
# here (≈ 3 batched decode steps, an 800-token prompt ≈ 0.55 s), so a prefill stalls decodes in
# ≈ 3 short steps instead of one long one; the shipped 2048 would never cut an ~800-token prompt.
CHUNKED_PREFILL_BUDGET = 256


@dataclass(frozen=True)
class StackSpec:
    """One arm of the experiment: how to start it (or where it already runs)."""

    name: str  # the arm, e.g. "colocated-x2:cache"
    compose_file: Path | None  # None: `url` is already running
    env: dict[str, str] = field(default_factory=dict)  # cpusets, model, key for compose
    url: str | None = None
    engine_env: dict[str, str] = field(default_factory=dict)  # extra environment of the engine containers
    config_dir: Path | None = None  # generated engine config.json mounted at /config instead of the shipped one
    replica_cpus: str = ""  # colocated-x2: the second replica's cpuset (the first takes ENGINE_CPUS)

    @property
    def base(self) -> str:
        """The stack without the cache mode: "colocated-x2" of "colocated-x2:cache"."""
        return self.name.partition(":")[0]


class StackError(RuntimeError):
    """A stack that would not start or answer; the message carries the compose output."""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    serve.add_workload_args(parser)
    parser.set_defaults(percentile_metrics="ttft,tpot,itl,e2el", metric_percentiles="90,99")
    parser.add_argument("--checkpoint", default="dummy:small", help="engine model for both stacks (PD_CHECKPOINT)")
    parser.add_argument("--stacks", default="colocated,disaggregated",
                        help=f"which arms, in run order: {', '.join(STACKS)}, each optionally :cache or :nocache "
                             "(ratios divide by the best colocated arm; without one, by the first)")
    parser.add_argument("--url", action="append", default=[], metavar="NAME=URL", help="use a running stack for NAME")
    parser.add_argument("--sweep", default=None, metavar="RATE,RATE,…", help="goodput vs request rate for both stacks")
    parser.add_argument("--warmup", type=int, default=4, help="requests sent (and ignored) before measuring")
    parser.add_argument("--out", default="results", help="directory for the table, charts and JSON")
    parser.add_argument("--project-prefix", default="pdbench", help="docker compose project name prefix")
    parser.add_argument("--colocated-cpus", default="0,1", help="cpuset of the colocated engine (colocated-x2: one replica per cpu)")
    parser.add_argument("--prefill-cpus", default="0", help="cpuset of the prefill engine")
    parser.add_argument("--decode-cpus", default="1", help="cpuset of the decode engine")
    parser.add_argument("--router-cpus", default="", help="cpuset of the router (default: unpinned)")
    parser.add_argument(
        "--engine-env", action="append", default=[], metavar="KEY=VALUE",
        help="extra environment for every engine container in both stacks, e.g. OPENBLAS_NUM_THREADS=1",
    )
    parser.add_argument(
        "--colocated-chunked-prefill", action="store_true",
        help="run the colocated engine with chunked_prefill (vLLM V1's default) instead of the shipped config",
    )
    parser.add_argument(
        "--colocated-max-num-batched-tokens", type=int, default=None, metavar="N",
        help=f"step token budget of the colocated engine (default with chunked prefill: {CHUNKED_PREFILL_BUDGET})",
    )
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a stack to come up")
    parser.add_argument("--keep-up", action="store_true", help="leave the last stack running (debugging)")


def stack_specs(args: argparse.Namespace) -> list[StackSpec]:
    urls = dict(item.split("=", 1) for item in args.url)
    common = {"TAOTOKEN_API_KEY": args.api_key, "PD_INTERNAL_KEY": secrets.token_hex(16),  # router → engines
              "PD_CHECKPOINT": args.checkpoint, "ROUTER_CPUS": args.router_cpus}
    first, _, rest = args.colocated_cpus.partition(",")
    cpus = {
        "colocated": {"ENGINE_CPUS": args.colocated_cpus},
        "colocated-chunked": {"ENGINE_CPUS": args.colocated_cpus},
        "colocated-x2": {"ENGINE_CPUS": first},
        "disaggregated": {"PREFILL_CPUS": args.prefill_cpus, "DECODE_CPUS": args.decode_cpus},
    }
    engine_env = dict(item.split("=", 1) for item in args.engine_env)
    specs = []
    for name in args.stacks.split(","):
        base, _, mode = name.partition(":")
        compose = None if name in urls else REPO / COMPOSE_FILES[base]
        changes = colocated_config_changes(args) if base == "colocated" else {}
        if base == "colocated-chunked":
            changes = {"chunked_prefill": True, "max_num_batched_tokens": args.colocated_max_num_batched_tokens or CHUNKED_PREFILL_BUDGET}
        config_dir = write_colocated_config(Path(args.out) / f"{base}-engine", changes) if compose and changes else None
        env = {**engine_env, **({"PD_PREFIX_CACHING": CACHE_MODES[mode]} if CACHE_MODES[mode] else {})}
        specs.append(StackSpec(name, compose, {**common, **cpus[base]}, urls.get(name), env, config_dir,
                               rest.split(",")[0] if base == "colocated-x2" else ""))
    return specs


def colocated_config_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The keys --colocated-chunked-prefill / --colocated-max-num-batched-tokens change in the shipped config."""
    changes: dict[str, Any] = {}
    if args.colocated_chunked_prefill:
        changes = {"chunked_prefill": True, "max_num_batched_tokens": CHUNKED_PREFILL_BUDGET}
    if args.colocated_max_num_batched_tokens is not None:
        changes["max_num_batched_tokens"] = args.colocated_max_num_batched_tokens
    return changes


def write_colocated_config(directory: Path, changes: dict[str, Any]) -> Path:
    """Copy colocated/config.json with `changes` into `directory` (absolute: compose mounts it)."""
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    config = {**json.loads(COLOCATED_CONFIG.read_text()), **changes}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def engine_override(spec: StackSpec) -> dict[str, Any]:
    """A compose override for each engine service: `spec.engine_env` added to its environment (compose
    merges `environment` maps key by key, so the base file's variables stay) and `spec.config_dir` at
    /config (compose merges `volumes` by container path, so it replaces the shipped config's mount)."""
    service: dict[str, Any] = {}
    if spec.engine_env:
        service["environment"] = spec.engine_env
    if spec.config_dir:
        service["volumes"] = [f"{spec.config_dir}:/config:ro"]
    services: dict[str, Any] = {name: dict(service) for name in ENGINE_SERVICES[spec.base]} if service else {}
    if spec.base == "colocated-x2":
        # The second replica is the first one's twin on the other core; the router spreads sessions over both.
        both = "http://engine:8000,http://engine2:8000"
        services.setdefault("engine2", {}).update(extends={"file": COMPOSE_FILES["colocated"], "service": "engine"},
                                                  cpuset=spec.replica_cpus)
        services["router"] = {"environment": {"PREFILL_ENDPOINT": both, "DECODE_ENDPOINT": both},
                              "depends_on": {"engine2": {"condition": "service_healthy"}}}
    return {"services": services} if services else {}


def _compose(spec: StackSpec, project: str, *command: str, timeout: float = 600) -> str:
    """Run `docker compose -p project -f file …`; raise StackError with its output on failure."""
    files = ["-f", str(spec.compose_file)]
    if override_spec := engine_override(spec):
        # JSON is YAML; relative paths (volumes) still resolve against the first file's directory.
        override = override_path(project)
        override.write_text(json.dumps(override_spec))
        files += ["-f", str(override)]
    argv = ["docker", "compose", "-p", project, *files, *command]
    env = {**os.environ, **{k: v for k, v in spec.env.items() if v}}
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise StackError(f"{shlex.join(argv)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return done.stdout


def override_path(project: str) -> Path:
    return Path(tempfile.gettempdir()) / f"{project}.override.json"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_stack(spec: StackSpec, project: str, timeout: float) -> str:
    """`up --wait` (health-gated) with the router on a free host port; returns the router's URL."""
    port = free_port()
    print(f"[compare] starting {spec.name}: docker compose -p {project} -f {spec.compose_file.name} up", flush=True)
    spec.env["ROUTER_PORT"] = str(port)
    # --no-build: the image comes from `./pd build` (it needs the offline wheelhouse/base image).
    _compose(spec, project, "up", "-d", "--no-build", "--wait", "--wait-timeout", str(int(timeout)),
             timeout=timeout + 60)
    return f"http://127.0.0.1:{port}"


def stop_stack(spec: StackSpec, project: str) -> None:
    print(f"[compare] stopping {spec.name}", flush=True)
    _compose(spec, project, "down", "-v", "--remove-orphans", timeout=180)
    override_path(project).unlink(missing_ok=True)


async def wait_ready(base_url: str, api_key: str | None, timeout: float) -> None:
    """Poll GET /v1/models through the router until it answers 200 (compose health is not enough
    when the router is healthy before its backends are)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    last = ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"{base_url}/v1/models", headers=headers) as response:
                    if response.status == 200:
                        return
                    last = f"HTTP {response.status}: {(await response.text())[:200]}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                last = repr(exc)
            await asyncio.sleep(1.0)
    raise StackError(f"{base_url} not ready after {timeout:.0f}s: {last}")


def run_args(args: argparse.Namespace, base_url: str, rate: float, **overrides: Any) -> argparse.Namespace:
    """The `serve` arguments for one measured run (same seed → same prompts and arrival times)."""
    one = copy.copy(args)
    one.base_url, one.request_rate, one.label = base_url, rate, overrides.pop("label", None)
    for key, value in overrides.items():
        setattr(one, key, value)
    return one


def point_args(args: argparse.Namespace, base_url: str, point: float, label: str) -> argparse.Namespace:
    """One measured run at a sweep point: a request rate, or with the agentic workload a number of sessions."""
    if args.dataset_name != "agentic":
        return run_args(args, base_url, point, label=label)
    sessions = int(point) if args.sweep else args.agentic_sessions
    return run_args(args, base_url, float("inf"), label=label, agentic_sessions=sessions, num_prompts=sessions * args.agentic_turns)


def warmup_args(args: argparse.Namespace, base_url: str) -> argparse.Namespace:
    """Warm-up on other prompts (seed + 1): loads code paths and the model, not the measured run's prefixes."""
    if args.dataset_name == "agentic":  # one short session, no pauses
        return run_args(args, base_url, float("inf"), seed=args.seed + 1, disable_tqdm=True, agentic_sessions=1, agentic_turns=2,
                        agentic_think_mean_s=0.0, agentic_stagger_s=0.0, num_prompts=2)
    return run_args(args, base_url, float("inf"), num_prompts=args.warmup, max_concurrency=1, seed=args.seed + 1, disable_tqdm=True)


# The router's counters of where prompts went and what the engines' prefix caches served (stack/router/metrics.py).
ROUTER_COUNTERS = ("pd_router_prompt_tokens_total", "pd_router_cached_prompt_tokens_total", "pd_router_affinity_decisions_total")


async def router_counters(base_url: str) -> dict[str, float]:
    """ROUTER_COUNTERS series from GET /metrics ("name{labels}" → value); empty if the router does not answer."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(f"{base_url}/metrics") as response:
                text = await response.text() if response.status == 200 else ""
    except (aiohttp.ClientError, asyncio.TimeoutError):
        text = ""
    return parse_counters(text)


def parse_counters(text: str) -> dict[str, float]:
    series = {}
    for line in text.splitlines():
        if line.startswith(ROUTER_COUNTERS):
            name, _, value = line.rpartition(" ")
            series[name] = float(value)
    return series


def cache_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What one run added: prompt and cached tokens (hit rate) and the routing decisions, summed over backends."""
    added = {k: v - before.get(k, 0.0) for k, v in after.items()}
    prompt = sum(v for k, v in added.items() if k.startswith(ROUTER_COUNTERS[0]))
    cached = sum(v for k, v in added.items() if k.startswith(ROUTER_COUNTERS[1]))
    decisions: dict[str, float] = {}
    for key, value in added.items():
        if key.startswith(ROUTER_COUNTERS[2]) and value:
            decision = key.split('decision="', 1)[1].split('"', 1)[0]
            decisions[decision] = decisions.get(decision, 0.0) + value
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None,
            "affinity_decisions": decisions}


async def measure_stack(args: argparse.Namespace, spec: StackSpec, base_url: str, rates: list[float]) -> list[dict]:
    await wait_ready(base_url, args.api_key, args.startup_timeout)
    if args.warmup:
        print(f"[compare] {spec.name}: warm-up", flush=True)
        await serve.benchmark(warmup_args(args, base_url))
    results = []
    for rate in rates:
        one = point_args(args, base_url, rate, spec.name)
        what = f"{one.agentic_sessions} agent sessions" if args.dataset_name == "agentic" else f"{rate} req/s"
        print(f"[compare] {spec.name}: {one.num_prompts} requests, {what}", flush=True)
        load_before = os.getloadavg()[0]
        counters = await router_counters(base_url)
        result = await serve.benchmark(one)
        result["router_cache"] = cache_summary(counters, await router_counters(base_url))
        result["stack"] = spec.name
        result["sweep_point"] = rate
        result["loadavg_1m_before"] = load_before
        result["loadavg_1m_after"] = os.getloadavg()[0]
        result["cpus"] = {k: v for k, v in spec.env.items() if k.endswith("_CPUS")}
        if result["request_goodput"] is not None:
            result["slo_attainment"] = result["request_goodput"] * result["duration"] / one.num_prompts
        for line in serve.failure_lines(result):
            print(line)
        print(serve.format_result(result, args.percentile_metrics.split(","), args.percentiles), flush=True)
        results.append(result)
    return results


def run_stack(args: argparse.Namespace, spec: StackSpec, rates: list[float], last: bool) -> list[dict]:
    if spec.url:
        return asyncio.run(measure_stack(args, spec, spec.url.rstrip("/"), rates))
    project = f"{args.project_prefix}-{spec.name.replace(':', '-')}"
    try:
        base_url = start_stack(spec, project, args.startup_timeout)
        return asyncio.run(measure_stack(args, spec, base_url, rates))
    finally:
        if not (args.keep_up and last):
            stop_stack(spec, project)


def hardware() -> str:
    """CPU model and count from lscpu (the README wants the hardware next to the numbers)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    model = fields.get("Model name", "?").strip()
    return f"{model}, {fields.get('CPU(s)', '?').strip()} vCPU ({fields.get('Hypervisor vendor', 'bare metal').strip()})"


def conditions(args: argparse.Namespace, specs: list[StackSpec], command: str) -> str:
    slos = ", ".join(f"{k} ≤ {v:g} ms" for k, v in (args.goodput_ms or {}).items()) or "none"
    cpus = "; ".join(
        f"{s.name}: " + ", ".join(f"{k}={v}" for k, v in s.env.items() if k.endswith("_CPUS") and v) for s in specs
    )
    engine_env = "; ".join(f"{s.name}: " + " ".join(f"{k}={v}" for k, v in s.engine_env.items()) for s in specs if s.engine_env) \
        or "none (as the compose files ship)"
    changes = colocated_config_changes(args)
    colocated_config = (
        "colocated/config.json with " + ", ".join(f"{k}={json.dumps(v)}" for k, v in changes.items())
        if changes else "colocated/config.json as shipped"
    )
    return "\n".join([
        f"- Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Command: `{command}`",
        f"- Hardware: {hardware()}; Python {platform.python_version()}",
        f"- CPU pinning: {cpus}",
        f"- Model: {args.checkpoint}; endpoint {args.endpoint}; dataset {args.dataset_name}; {args.num_prompts} prompts;"
        f" seed {args.seed}; burstiness {args.burstiness}; max concurrency {args.max_concurrency}",
        f"- Goodput SLOs: {slos}",
        f"- Extra engine environment: {engine_env}",
        f"- Colocated engine config: {colocated_config}",
    ])


def write_report(args: argparse.Namespace, specs: list[StackSpec], runs: dict[str, list[dict]], command: str) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    agentic = args.dataset_name == "agentic"
    unit = "sessions" if agentic else "qps"
    for name, results in runs.items():
        for result in results:
            point = result["sweep_point"] if agentic else result["request_rate"]
            (out / f"{name.replace(':', '-')}-{point}{unit}.json").write_text(json.dumps(result))
    head = [f"# Colocated vs disaggregated ({args.checkpoint})", "", conditions(args, specs, command), ""]
    loads = "; ".join(
        f"{n} {r['request_rate']} req/s: {r['loadavg_1m_before']:.2f}→{r['loadavg_1m_after']:.2f}"
        for n, rs in runs.items() for r in rs
    )
    head += [f"- Host 1-min load average before→after each run (other work shares these cores): {loads}", ""]
    final = {name: results[-1] for name, results in runs.items()}
    last = next(iter(final.values()))
    point = f"{last['num_prompts'] // args.agentic_turns} agent sessions × {args.agentic_turns} turns" if agentic else f"{last['request_rate']} req/s"
    body = [f"## At {point}", "", report.comparison_table(final), "", "![latency](compare.png)", ""]
    best = report.best_colocated(final)
    if best is not None:
        body += [f"### Against the best colocated arm ({best})", "", report.ratio_table(final, best), ""]
        for arm in (n for n in final if n.startswith("disaggregated")):
            body += [f"Goals for {arm}:", "", *report.goal_lines(final, best, arm), ""]
    body += ["### Prefix cache and routing (router /metrics over the run)", "", report.cache_table(final), ""]
    report.comparison_chart(final, out / "compare.png", title=f"{args.checkpoint}, {point}, {last['num_prompts']} requests")
    if args.sweep:
        axis = ("Agent sessions", "agent sessions") if agentic else ("Rate (req/s)", "request rate (req/s)")
        body += ["## Sweep", "", report.sweep_table(runs, axis[0]), "", "![sweep](sweep.png)", ""]
        report.sweep_chart(runs, out / "sweep.png", title=f"{args.checkpoint}, sweep", axis=axis[1])
        (out / "sweep.md").write_text("\n".join(head + body[-5:]))
    path = out / "compare.md"
    path.write_text("\n".join(head + body))
    return path


def main(args: argparse.Namespace) -> int:
    problems = serve.check_args(args)
    if args.sweep:
        try:
            rates = [float(r) for r in args.sweep.split(",")]
        except ValueError:
            problems.append(f"--sweep: {args.sweep!r} is not comma-separated rates")
    else:
        rates = [args.request_rate]
    if args.colocated_max_num_batched_tokens is not None and args.colocated_max_num_batched_tokens <= 0:
        problems.append(f"--colocated-max-num-batched-tokens must be positive, got {args.colocated_max_num_batched_tokens}")
    malformed = [item for item in args.url + args.engine_env if "=" not in item]
    if malformed:
        problems.append(f"--url / --engine-env take NAME=VALUE, got {malformed}")
    unknown = [n for n in args.stacks.split(",") if n.partition(":")[0] not in STACKS or n.partition(":")[2] not in CACHE_MODES]
    if unknown:
        problems.append(f"--stacks: unknown {unknown}; choose from {list(STACKS)}, each optionally :cache or :nocache")
    if "colocated-x2" in {n.partition(":")[0] for n in args.stacks.split(",")} and "," not in args.colocated_cpus:
        problems.append(f"--stacks colocated-x2 needs two cpus in --colocated-cpus (one per replica), got {args.colocated_cpus!r}")
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    # The stacks need a unified key; make a throwaway one when the environment has none.
    args.api_key = args.api_key or "bench-" + secrets.token_urlsafe(16)
    specs = stack_specs(args)
    command = getattr(args, "command_line", "python -m stack.bench compare …")
    runs: dict[str, list[dict]] = {}
    try:
        for i, spec in enumerate(specs):
            runs[spec.name] = run_stack(args, spec, rates, last=i == len(specs) - 1)
    except (StackError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    path = write_report(args, specs, runs, command)
    print(path.read_text())
    print(f"[compare] wrote {path} and {path.with_suffix('.png')}")
    return 0
