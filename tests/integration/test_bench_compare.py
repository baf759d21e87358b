"""`python -m stack.bench compare` end to end: both compose stacks in turn, table and chart written."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_compare_brings_up_both_stacks_and_writes_report(app_image: None, tmp_path) -> None:
    """A short compare run: colocated then disaggregated come up, serve 6 requests each, go down; report written."""
    prefix = f"pdtest-bench-{secrets.token_hex(3)}"
    argv = [sys.executable, "-m", "stack.bench", "compare", "--num-prompts", "6", "--request-rate", "3",
            "--synthetic-input-mean", "200", "--synthetic-output-mean", "16", "--goodput", "tpot:60000",
            "--warmup", "1", "--checkpoint", "dummy:tiny", "--project-prefix", prefix, "--out", str(tmp_path), "--disable-tqdm"]
    env = {**os.environ, "TAOTOKEN_API_KEY": "sk-bench-" + secrets.token_hex(8)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = (tmp_path / "compare.md").read_text()
    assert "| Metric | colocated | disaggregated | disaggregated / colocated |" in table
    completed = next(line for line in table.splitlines() if line.startswith("| Completed"))
    assert completed.startswith("| Completed | 6 | 6 |")
    assert (tmp_path / "compare.png").read_bytes().startswith(PNG_MAGIC)
    # Both projects were taken down again.
    ps = subprocess.run(["docker", "ps", "-a", "--filter", f"name={prefix}", "--format", "{{.Names}}"],
                        capture_output=True, text=True, timeout=30)
    assert ps.stdout.strip() == ""
