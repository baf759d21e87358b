"""The CLI: exit codes 0/1/2, --json on stdout, stdin input, --request-id, --list-checks."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from doctor.cli import main


def run(*argv: str, stdin: str | None = None) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), stdin=io.StringIO(stdin) if stdin is not None else None, stdout=out)
    return code, out.getvalue()


def test_healthy_logs_exit_0(bundles):
    """A healthy bundle → exit 0 and the healthy line."""
    code, out = run("diagnose", "--logs", str(bundles / "healthy_v2ts.log"))
    assert code == 0
    assert "[OK] healthy: 5 requests went router → prefill → KV → decode" in out


def test_findings_exit_1_and_json_on_stdout(bundles):
    """A failing bundle → exit 1; --json prints the documented document with the finding."""
    code, out = run("--json", "diagnose", "--logs", str(bundles / "kv_port_mismatch.log"))
    assert code == 1
    doc = json.loads(out)
    assert [f["id"] for f in doc["findings"]] == ["kv.port_mismatch"]
    assert doc["input"]["requests"] == 2 and doc["input"]["lines"] == 43 and doc["input"]["undeclared"] == 0


def test_warning_exits_0_unless_strict(bundles):
    """A rate-limit-only log warns: exit 0, and 1 with --strict."""
    lines = [line for line in (bundles / "auth_mixed.log").read_text().splitlines()
             if "req-0006" in line or "req-0001" in line]
    assert run("diagnose", "--logs", "-", stdin="\n".join(lines))[0] == 0
    code, out = run("diagnose", "--strict", "--logs", "-", stdin="\n".join(lines))
    assert code == 1 and "[WARN] Rate limited" in out


def test_stdin_with_a_pasted_client_error(bundles):
    """`--logs -` reads stdin: compose output plus a pasted client line are diagnosed together."""
    text = (bundles / "decode_failed.log").read_text() + "KeyError: 'choices'\n"
    code, out = run("diagnose", "-v", "--logs", "-", stdin=text)
    assert code == 1
    assert "Decode failed after a successful prefill" in out
    assert "client  -                        KeyError: 'choices'" in out


def test_request_id_narrows_to_one_request(bundles):
    """--request-id keeps that request only; an unknown id is a usage error (exit 2)."""
    code, out = run("--json", "diagnose", "--logs", str(bundles / "decode_failed.log"), "--request-id",
                    "req-0002-f4bea973")
    assert code == 1
    assert json.loads(out)["findings"][0]["request_ids"] == ["req-0002-f4bea973"]
    assert run("diagnose", "--logs", str(bundles / "decode_failed.log"), "--request-id", "nope")[0] == 2


def test_doctor_cannot_run_exits_2(bundles, tmp_path, capsys):
    """Missing file, empty input, bad --since, bad usage → exit 2 with the reason on stderr."""
    assert run("diagnose", "--logs", str(tmp_path / "missing.log"))[0] == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "empty.log").write_text("\x00\x01garbage\n")
    assert run("diagnose", "--logs", str(tmp_path / "empty.log"))[0] == 2
    assert "no log lines found" in capsys.readouterr().err
    assert run("diagnose", "--logs", str(tmp_path / "empty.log"), "--since", "yesterday")[0] == 2
    assert run("frobnicate")[0] == 2
    assert run("diagnose", "--logs", str(bundles / "healthy_v1.log"), "--check", "nosuch")[0] == 2
    code, out = run("--json", "diagnose", "--logs", str(tmp_path / "missing.log"))
    assert code == 2 and json.loads(out)["status"] == "doctor_failed"


def test_since_filters_old_lines(bundles):
    """--since an ISO time after the bundle → a quiet window (exit 0, `quiet`); before it → diagnosed."""
    path = str(bundles / "healthy_v1.log")
    code, out = run("diagnose", "--logs", path, "--since", "2026-11-29T21:00:00Z")
    assert code == 0 and "quiet: no completed request in the window" in out
    assert run("diagnose", "--logs", path, "--since", "2026-11-29T20:00:00Z")[0] == 0


def test_list_checks():
    """--list-checks names every diagnosis."""
    code, out = run("diagnose", "--list-checks")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()] == ["client_view", "model", "route", "client_request", "internal_key", "tool_calling", "engine_config", "lifecycle", "backends", "bypass", "config", "auth", "local_proxy", "oauth", "choices", "kv_transfer", "long_prompt", "upstream", "nixl_lease_wait", "nixl_transport", "p2pnccl", "slowness", "engine_paths"]


def test_folder_of_per_service_files(bundles):
    """A folder with router.log, prefill.log, decode.log (raw JSON) is read as one bundle."""
    code, out = run("diagnose", "--logs", str(bundles / "healthy_split"))
    assert code == 0 and "5 requests went router" in out


def test_python_dash_m_entry_point(bundles):
    """`python -m doctor` runs as a program and prints ASCII when piped."""
    done = subprocess.run([sys.executable, "-m", "doctor", "diagnose", "--logs", str(bundles / "stream_cut.log")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stdout.splitlines()[1] == "[FAIL] 1 stream(s) broke mid-way: decode's stream ended without data: [DONE]"


def test_check_selects_diagnoses(bundles):
    """--check kv_transfer runs only that diagnosis: the auth problems of the bundle are not reported."""
    path = str(bundles / "auth_mixed.log")
    assert run("diagnose", "--logs", path)[0] == 1
    code, out = run("diagnose", "--logs", path, "--check", "kv_transfer")
    assert code == 0 and "[OK] healthy" in out
