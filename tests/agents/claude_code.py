"""Run the real Claude Code CLI as a user does, sealed off from the internet, and describe what it sends.

    binary = install()                                    # scripts/claude-code.sh: the pinned CLI (cached)
    run = run_claude(binary, "Say hi", base_url, key, workdir, model="your-model-id")
    run.result                                            # the stream-json `result` message
    run.connects                                          # every socket address it connected to (strace)

The CLI runs with HOME in a fresh directory (no user config, no login), the variables that turn off its
non-essential traffic (auto-updater, telemetry, error reports), ANTHROPIC_BASE_URL on loopback, and under
`strace -f -e trace=connect`, so a test can assert that it reached nothing but the router. Random weights never stop
on their own: CLAUDE_CODE_MAX_OUTPUT_TOKENS caps every answer (the CLI sends it as max_tokens).

`shape(...)` describes one request without its content (the fixture tests/agents/fixtures/ keeps): header values that
are secrets or per-session ids replaced, every string of prose in the body replaced by its length, and the sizes a
reader of the issue asks about (system characters, tool count, message blocks, JSON bytes). `fill(skeleton)` turns
the skeleton back into a body of the same shape and sizes, for tests that replay it without the CLI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MAX_OUTPUT_TOKENS = 32  # per answer: random weights would otherwise write until the window is full
# Claude Code's own switches for traffic that is not the model API (its docs' "Environment variables" table).
QUIET = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
         "DISABLE_ERROR_REPORTING": "1"}
API_TIMEOUT_DEFAULT_MS = 600_000  # the CLI's bound on one request unless API_TIMEOUT_MS says otherwise
STREAM_IDLE_MAX_MS = 1_800_000  # the most CLAUDE_STREAM_IDLE_TIMEOUT_MS allows (5 min unless set)
SECRET_HEADERS = {"x-api-key", "authorization"}
VARYING_HEADERS = {"x-claude-code-session-id", "host", "content-length"}  # per session / per run: recorded by name only
_PLAIN = re.compile(r"[A-Za-z0-9_.:/+-]{0,40}")  # identifiers, types, enum values: kept in a skeleton as they are
_HOLE = re.compile(r"<text (\d+)>")
_CONNECT = re.compile(r'connect\(\d+, \{sa_family=AF_INET6?, sin6?_port=htons\((\d+)\), sin6?_addr=inet_(?:addr|pton)\((?:AF_INET6?, )?"([^"]+)"')


def install() -> Path:
    """The pinned `claude` binary (scripts/claude-code.sh downloads and verifies it once, then answers from cache)."""
    out = subprocess.run([str(REPO / "scripts" / "claude-code.sh")], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def cli_version(binary: Path) -> str:
    return subprocess.run([str(binary), "--version"], check=True, capture_output=True, text=True).stdout.strip()


@dataclass
class Run:
    """One `claude -p` run: its exit code, its stream-json messages, stderr, and where it connected."""

    returncode: int
    messages: list[dict[str, Any]]
    stderr: str
    connects: list[tuple[str, int]]  # (address, port) of every AF_INET/AF_INET6 connect()

    @property
    def result(self) -> dict[str, Any]:
        """The run's final `result` message (the last one)."""
        results = [m for m in self.messages if m.get("type") == "result"]
        assert results, f"no result message (exit {self.returncode}); stderr: {self.stderr[-2000:]}"
        return results[-1]

    @property
    def session_id(self) -> str | None:
        return self.result.get("session_id")


def run_claude(binary: Path, prompt: str, base_url: str, key: str, workdir: Path, *, model: str | None = None,
               resume: bool = False, stdin: str = "", timeout_s: float = 900) -> Run:
    """`claude -p PROMPT --output-format stream-json --verbose` (with `--continue` when `resume`) in `workdir`, whose
    `home/` is the CLI's HOME (the same for both turns of a session, as a user's would be). `model`: what
    ANTHROPIC_MODEL (and the small/fast model) name; None leaves the CLI's own claude-* defaults. `stdin`: text piped
    to the CLI, which appends it to PROMPT (`cat doc | claude -p "…"`): one argv string is limited to 128 KiB.
    `timeout_s` bounds the run, and each of its requests when longer than the CLI's own 10 min (API_TIMEOUT_MS)."""
    home = workdir / "home"
    project = workdir / "project"
    home.mkdir(parents=True, exist_ok=True)
    project.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "ANTHROPIC_BASE_URL": base_url,
           "ANTHROPIC_API_KEY": key, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS), **QUIET,
           # A failed request fails the turn at once: the tests assert every request is a 200, and the CLI's own
           # retries (10, with backoff) would only hide the failure behind minutes of resent long prompts.
           "CLAUDE_CODE_MAX_RETRIES": "0"}
    if timeout_s * 1000 > API_TIMEOUT_DEFAULT_MS:
        # The CLI's own bounds on one request would cut a cold long prefill on CPU (a 60k-token prompt takes
        # minutes, silent until its first token): the whole request may take as long as the run, and the silence
        # before its first byte as long as the CLI allows. Raised only: the CLI sends its timeout as a header
        # (x-stainless-timeout) that the recorded shape holds.
        env |= {"API_TIMEOUT_MS": str(round(timeout_s * 1000)),
                "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(min(round(timeout_s * 1000), STREAM_IDLE_MAX_MS))}
    if model is not None:
        # ANTHROPIC_SMALL_FAST_MODEL is the older name of ANTHROPIC_DEFAULT_HAIKU_MODEL; the CLI reads either.
        env |= {"ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model}
    trace = workdir / f"connects-{len(list(workdir.glob('connects-*')))}.txt"
    argv = ["strace", "-f", "-qq", "-e", "trace=connect", "-e", "signal=none", "-o", str(trace),
            str(binary), "-p", prompt, *(["--continue"] if resume else []), "--output-format", "stream-json", "--verbose"]
    # The CLI's own temp files and sockets (claude-<uid>/, cc-socks/) go under TMPDIR: one short directory a run
    # (a socket's path must fit 108 bytes), removed after it, instead of /tmp for good.
    scratch = Path(tempfile.mkdtemp(prefix="pd-cc-"))
    try:
        done = subprocess.run(argv, cwd=project, env=env | {"TMPDIR": str(scratch)}, capture_output=True, text=True,
                              timeout=timeout_s, input=stdin)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    messages = []
    for line in done.stdout.splitlines():
        try:
            messages.append(json.loads(line))
        except ValueError:
            continue
    connects = [(address, int(port)) for port, address in _CONNECT.findall(trace.read_text())]
    return Run(done.returncode, messages, done.stderr, connects)


def _skeleton(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _skeleton(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_skeleton(item) for item in value]
    if isinstance(value, str) and not _PLAIN.fullmatch(value):
        return f"<text {len(value)}>"
    return value


def _blocks(content: Any) -> int:
    return len(content) if isinstance(content, list) else 1


def _chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(block.get("text", "")) for block in content if isinstance(block, dict))


def shape(method: str, path: str, query: dict[str, str], headers: dict[str, str], raw: bytes) -> dict[str, Any]:
    """A request as the fixture keeps it: no secret, no prose, the sizes."""
    body = json.loads(raw)
    kept = {}
    for name, value in headers.items():
        lower = name.lower()
        kept[lower] = "<secret>" if lower in SECRET_HEADERS else "<varies>" if lower in VARYING_HEADERS else value
    messages = body.get("messages") or []
    system_messages = [m for m in messages if m.get("role") == "system"]
    return {
        "method": method, "path": path, "query": query, "headers": dict(sorted(kept.items())),
        "sizes": {
            "json_bytes": len(raw),
            "system_chars": _chars(body.get("system") or []),
            "system_message_chars": sum(_chars(m.get("content", "")) for m in system_messages),
            "tools": len(body.get("tools") or []),
            "tool_json_bytes": len(json.dumps(body.get("tools") or [])),
            "messages": len(messages),
            "message_blocks": sum(_blocks(m.get("content")) for m in messages),
        },
        "body": _skeleton(body),
    }


def structure(value: Any) -> Any:
    """A skeleton with its lengths erased: what must not change between two runs of one CLI version (the working
    directory, the date and the prompt change the lengths)."""
    if isinstance(value, dict):
        return {key: structure(item) for key, item in value.items()}
    if isinstance(value, list):
        return [structure(item) for item in value]
    return _HOLE.sub("<text>", value) if isinstance(value, str) else value


def fill(skeleton: Any) -> Any:
    """A body of the skeleton's shape: each `<text N>` becomes N characters of plain prose."""
    if isinstance(skeleton, dict):
        return {key: fill(item) for key, item in skeleton.items()}
    if isinstance(skeleton, list):
        return [fill(item) for item in skeleton]
    if isinstance(skeleton, str) and (hole := _HOLE.fullmatch(skeleton)):
        n = int(hole.group(1))
        return ("lorem ipsum dolor sit amet " * (n // 27 + 1))[:n]
    return skeleton
