"""Record what the pinned Claude Code CLI sends on a session's first request, as tests/agents/fixtures/ keeps it.

    .venv/bin/python -m tests.agents.record      # after moving the pin in scripts/claude-code.sh

Runs `claude -p` (README's first route: ANTHROPIC_MODEL names the served model) against a loopback capture server,
then writes the request's shape (claude_code.shape: no secret, no prose, the sizes) with the CLI version.
test_claude_code_shape.py checks that the live CLI still sends this shape.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from tests.agents.capture import Capture
from tests.agents.claude_code import MAX_OUTPUT_TOKENS, cli_version, install, run_claude, shape

FIXTURE = Path(__file__).parent / "fixtures" / "claude_code_first_request.json"
MODEL = "your-model-id"
PROMPT = "Say hello"


def first_request(binary: Path, workdir: Path) -> tuple[dict[str, Any], list[tuple[str, int]], int]:
    """(the shape of the CLI's first request, where the CLI connected, how many requests it made)."""
    with Capture() as capture:
        run = run_claude(binary, PROMPT, capture.url, "sk-capture-not-a-key", workdir, model=MODEL, timeout_s=300)
    assert run.returncode == 0 and capture.requests, f"claude exited {run.returncode}: {run.stderr[-2000:]}"
    first = capture.requests[0]
    return shape(first.method, first.path, first.query, first.headers, first.raw), run.connects, len(capture.requests)


def main() -> None:
    binary = install()
    with tempfile.TemporaryDirectory(prefix="pd-claude-record-") as tmp:
        recorded, _, _ = first_request(binary, Path(tmp))
    fixture = {"cli_version": cli_version(binary), "route": f"ANTHROPIC_MODEL={MODEL}", "prompt": PROMPT,
               "max_output_tokens": MAX_OUTPUT_TOKENS, **recorded}
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {FIXTURE.relative_to(Path.cwd()) if FIXTURE.is_relative_to(Path.cwd()) else FIXTURE}: {fixture['sizes']}")


if __name__ == "__main__":
    main()
