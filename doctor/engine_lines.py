"""vLLM's own plain-text lines → records the checks read: start-ups, configuration, KV capacity, stats, deaths.

vLLM prints `(APIServer pid=N) INFO 12-01 12:12:11 [model.py:2152] Using max model len 2048` (the process, level,
month-day and time, source file), and uvicorn's access lines (`INFO:     127.0.0.1:5 - "POST /v1/… HTTP/1.1" 401`)
without a time. Each kind below is a record with event `vllm.<kind>` and its values in `data`; request ids are
vLLM's (`chatcmpl-<X-Request-ID>[-<8 hex>]`, `cmpl-…`), joined to the router's requests by doctor/engine_facts.py.
The strings come from vLLM 0.32.0's source (file named next to each pattern) and its recorded output
(tests/unit/doctor/bundles/vllm_*).
"""

from __future__ import annotations

import ast
import re
from datetime import datetime, timezone

VLLM = "vllm."
# (APIServer pid=10257) INFO 12-01 12:12:11 [api_utils.py:347] …   (EngineCore_DP0 pid=…), (Worker pid=…) too
_PREFIX = re.compile(r"^\((?P<proc>[A-Za-z_0-9]+) pid=(?P<pid>\d+)\) (?P<level>[A-Z]+) (?P<md>\d{2}-\d{2}) "
                     r"(?P<hms>\d{2}:\d{2}:\d{2})(?:\.\d+)? \[(?P<src>[^\]]+)\] (?P<msg>.*)$")
_ACCESS = re.compile(r'^INFO:\s+\S+ - "(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3})')
_NUMBER = r"([\d,]+(?:\.\d+)?)"


def _num(text: str) -> float:
    return float(text.replace(",", ""))


# kind, pattern over the message (after the prefix), the source it is printed by
KINDS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((kind, re.compile(pattern)) for kind, pattern in (
    ("banner", r"version (\d+\.\d+\.\S+)\s*$|vLLM API server version (\S+)"),  # entrypoints/utils.py, api_utils.py
    ("args", r"^non-default args: (\{.*\})$"),  # entrypoints/openai/api_server.py (api_utils.py in 0.32)
    ("engine_config", r"^Initializing a V1 LLM engine \((\S+)\) with config: (.*)$"),  # v1/engine/core.py
    ("max_len", r"^Using max model len (\d+)"),  # config/model.py
    ("kv_capacity", rf"^(?:GPU|CPU|XPU)? ?KV cache size: {_NUMBER} tokens"),  # v1/core/kv_cache_utils.py
    ("stats", r"^Engine \d+: Avg prompt throughput: .*Running: (\d+) reqs, Waiting: (\d+) reqs"),  # v1/metrics/loggers.py
    ("ready", r"^Starting vLLM (?:API )?server"),  # entrypoints (entry.py in 0.32)
    # a stop asked for (SIGTERM): entrypoints/launcher.py, v1/engine/core.py ("[shutdown] …" in 0.32)
    ("shutdown", r"^\[shutdown\] (?:API server: shutdown triggered|EngineCore: trigger received signal)|"
                 r"^Shutting down|^Application shutdown complete"),
    # v1/engine/core.py ("EngineCore encountered a fatal error.", "EngineCore failed to start."), v1/engine/exceptions.py
    # (EngineDeadError: "EngineCore encountered an issue. …"), v1/engine/core_client.py ("engine core exited
    # unexpectedly"), v1/engine/utils.py ("Engine core initialization failed."), v1/utils.py ("died with exit code")
    ("fatal", r"EngineCore encountered a fatal error|EngineCore failed to start|EngineCore encountered an issue|"
              r"EngineDeadError|engine core exited unexpectedly|Engine core initialization failed|"
              r"Engine core process \S+ died|Process \S+ \(PID: \d+\) died with exit code"),
))
_CHATCMPL = re.compile(r"\b((?:chatcmpl|cmpl|resp)-[A-Za-z0-9_-]+)")
_CONFIG_FIELD = re.compile(r"(\w+)=('[^']*'|[^,]+)")


def parse(text: str, service: str) -> tuple[str, str, str, dict] | None:
    """(ts, event, level, data) of one vLLM line this module knows, else None. `ts` has no year yet (fix_years)."""
    m = _PREFIX.match(text)
    if m is None:
        a = _ACCESS.match(text)
        if a is None:
            return None
        status = int(a.group("status"))
        return "", VLLM + "access", "WARNING" if status >= 400 else "INFO", \
            {"method": a.group("method"), "path": a.group("path"), "status": status}
    msg, ts = m.group("msg"), stamp(text)
    data: dict = {"process": m.group("proc"), "pid": int(m.group("pid")), "source": m.group("src")}
    for kind, rx in KINDS:
        hit = rx.search(msg)
        if hit is None:
            continue
        data.update(_values(kind, hit, msg))
        return ts, VLLM + kind, m.group("level"), data
    if m.group("level") in ("ERROR", "CRITICAL") or _CHATCMPL.search(msg):
        return ts, VLLM + "line", m.group("level"), data  # an error, or a line naming a request: kept as evidence
    return None


def _values(kind: str, hit: re.Match[str], msg: str) -> dict:
    if kind == "banner":
        return {"version": hit.group(1) or hit.group(2)}
    if kind == "args":
        try:  # a Python dict literal, except values like KVTransferConfig(…): keep the plain ones
            args = ast.literal_eval(re.sub(r"\w+Config\([^)]*\)", "None", hit.group(1)))
            return {"args": {k: v for k, v in args.items() if k != "api_key"}}
        except (ValueError, SyntaxError):
            return {"args": {}}
    if kind == "engine_config":
        fields = {k: v.strip("'") for k, v in _CONFIG_FIELD.findall(hit.group(2))}
        return {"version": hit.group(1), "model": fields.get("model"), "tokenizer": fields.get("tokenizer"),
                "dtype": (fields.get("dtype") or "").removeprefix("torch."), "max_seq_len": fields.get("max_seq_len"),
                "kv_cache_dtype": fields.get("kv_cache_dtype")}
    if kind == "max_len":
        return {"max_model_len": int(hit.group(1))}
    if kind == "kv_capacity":
        return {"kv_tokens": int(_num(hit.group(1)))}
    if kind == "stats":
        out: dict = {"running": int(hit.group(1)), "waiting": int(hit.group(2))}
        usage = re.search(r"KV cache usage: ([\d.]+)%", msg)
        fetch = re.search(r"KV fetch: (\d+) waiting to start", msg)
        preempted = re.search(r"Preemptions: (\d+)", msg)
        if preempted:
            out["preemptions"] = int(preempted.group(1))
        if usage:
            out["kv_usage_pct"] = float(usage.group(1))
        if fetch:
            out["kv_fetch_waiting"] = int(fetch.group(1))
        return out
    return {}


_API_KEY = re.compile(r"('api_key': )(?:'[^']*'|\[[^\]]*\])")


def redact(line: str) -> str:
    """vLLM prints --api-key among its non-default args: evidence never shows a key."""
    return _API_KEY.sub(r"\1'<redacted>'", line) if "'api_key'" in line else line


def request_ids(line: str) -> list[str]:
    """vLLM's request ids in a line (chatcmpl-<id>[-<8 hex>], cmpl-…): the router's or the client's id is inside."""
    return _CHATCMPL.findall(line)


def fix_years(records: list, now: datetime | None = None) -> None:
    """vLLM prints month-day without a year: take it from the ISO times of the other lines read (else this year)."""
    years = [r.ts[:4] for r in records if len(r.ts) > 10 and r.ts[4:5] == "-"]
    year = max(years) if years else str((now or datetime.now(timezone.utc)).year)
    for r in records:
        if r.event.startswith(VLLM) and r.ts[2:3] == "-":
            r.ts = f"{year}-{r.ts}"


def stamp(text: str) -> str | None:
    """The MM-DDTHH:MM:SS a vLLM line was stamped with (its prefix: no year, to the second), or None."""
    m = _PREFIX.match(text)
    return f"{m.group('md')}T{m.group('hms')}" if m else None


def join_requests(records: list) -> None:
    """Give vLLM's lines that name a request (chatcmpl-<id>…) the router's id of that request, by the router's id or
    the client's X-Request-ID inside vLLM's (the router passes both on: stack/router/upstream.py _headers)."""
    known: dict[str, str] = {}
    for r in records:
        if r.service == "router" and r.request_id != "-":
            known[r.request_id] = r.request_id
            client = r.data.get("client_request_id")
            if isinstance(client, str):
                known.setdefault(client, r.request_id)
    if not known:
        return
    for r in records:
        if r.request_id == "-" and (r.event.startswith(VLLM) or r.event.startswith("upstream.")):
            owner = next((known[c] for vllm_id in request_ids(r.line) for c in _candidates(vllm_id) if c in known), None)
            if owner is not None:
                r.request_id = owner


def _candidates(vllm_id: str) -> tuple[str, ...]:
    """chatcmpl-<id>-<8 hex> → (<id>-<8 hex>, <id>): vLLM 0.32 appends a random suffix to the id it was given."""
    bare = vllm_id.split("-", 1)[1] if "-" in vllm_id else vllm_id
    head, _, tail = bare.rpartition("-")
    return (bare, head) if head and re.fullmatch(r"[0-9a-f]{8}", tail) else (bare,)
