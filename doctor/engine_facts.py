"""What each engine said about itself: every start-up (configuration, KV capacity), its deaths and its load.

Read from vLLM's plain-text lines (doctor/engine_lines.py) and from our engine's JSON `service.starting`; the checks
engine_config, lifecycle and slowness compare and time these. One `Start` per start-up banner of a service: a second
banner in one service's log is a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from doctor.engine_lines import VLLM
from doctor.findings import Context
from doctor.parse import Record
from stack.common import events

ENGINES = ("prefill", "decode", "engine")
# What must agree between prefill and decode for the KV one computes to be the KV the other reads.
COMPARED = ("model", "tokenizer", "max_model_len", "block_size", "dtype", "kv_cache_dtype")


@dataclass
class Start:
    """One start-up of one engine process."""

    service: str
    kind: str  # "vllm" | "pd-engine"
    ts: str
    version: str | None = None
    values: dict = field(default_factory=dict)  # COMPARED keys (and served_model_name) as the engine printed them
    kv_tokens: int | None = None  # vLLM: "KV cache size: N tokens"
    ready_ts: str | None = None  # serving: vLLM "Starting vLLM server on …", our service.ready
    records: list[Record] = field(default_factory=list)  # the lines the values were read from

    def evidence(self, key: str) -> list[Record]:
        """The line(s) that show `key` (its value), else the start-up line."""
        hits = [r for r in self.records if _shows(r, key)]
        return hits[:1] or self.records[:1]


def _shows(r: Record, key: str) -> bool:
    if r.event == VLLM + "args":
        return key in (r.data.get("args") or {})
    if r.event == VLLM + "engine_config":
        return key in ("model", "tokenizer", "dtype", "kv_cache_dtype") and r.data.get(key) is not None
    if r.event == VLLM + "max_len":
        return key == "max_model_len"
    if r.event == VLLM + "kv_capacity":
        return key == "kv_tokens"
    return r.event == events.SERVICE_STARTING and key in ("model", "checkpoint")


def starts(ctx: Context) -> dict[str, list[Start]]:
    """Every start-up of every engine service, in read order."""
    out: dict[str, list[Start]] = {}
    for r in ctx.records:
        if r.service not in ENGINES:
            continue
        runs = out.setdefault(r.service, [])
        if r.event == VLLM + "banner":
            runs.append(Start(r.service, "vllm", r.ts, r.data.get("version"), records=[r]))
            continue
        if r.event == events.SERVICE_STARTING:
            runs.append(Start(r.service, "pd-engine", r.ts, values={"model": r.data.get("model"),
                                                                     "checkpoint": r.data.get("checkpoint")},
                              records=[r]))
            continue
        if not runs:
            continue
        run = runs[-1]
        if r.event == VLLM + "args":
            args = r.data.get("args") or {}
            run.records.append(r)
            for key in ("tokenizer", "block_size", "dtype", "kv_cache_dtype", "max_model_len"):
                if args.get(key) is not None:
                    run.values.setdefault(key, args[key])
            if args.get("served_model_name"):
                run.values["served_model_name"] = args["served_model_name"]
        elif r.event == VLLM + "engine_config":
            run.records.append(r)
            for key in ("model", "tokenizer", "dtype", "kv_cache_dtype"):
                if r.data.get(key) not in (None, ""):
                    run.values[key] = r.data[key]
        elif r.event == VLLM + "max_len":
            run.records.append(r)
            run.values["max_model_len"] = r.data["max_model_len"]
        elif r.event == VLLM + "kv_capacity":
            run.records.append(r)
            run.kv_tokens = r.data["kv_tokens"]
        elif r.event in (VLLM + "ready", events.SERVICE_READY) and run.ready_ts is None:
            run.ready_ts = r.ts
    return {s: runs for s, runs in out.items() if runs}


def kind_of(ctx: Context, service: str) -> str:
    """"vllm" when the service printed vLLM's lines, else "pd-engine" (our engine, JSON lines)."""
    return "vllm" if any(r.service == service and r.event.startswith(VLLM) for r in ctx.records) else "pd-engine"


def compose(ctx: Context) -> bool:
    """The stack runs under compose: read from a project, or from `docker compose logs` output."""
    return ctx.docker is not None or ctx.stats.compose > 0


def logs_command(ctx: Context, service: str, pattern: str) -> str:
    """How to read a service's lines for `pattern`, valid for how it runs: a compose service, or a process log."""
    if compose(ctx):
        return f"docker compose logs {service} --since 10m | grep -E '{pattern}'"
    return f"grep -E '{pattern}' <{service}'s log>"
