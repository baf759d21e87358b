"""Reports: flutter-doctor-style text, and JSON with a stable schema.

Text: one line per finding — `[✓]` ok, `[!]` warning, `[✗]` error (plain `[OK]`, `[WARN]`, `[FAIL]`
when stdout is not a terminal, NO_COLOR is set or --no-color is given); with -v each finding adds
its cause, evidence lines (service, timestamp, the line) and the fix. Then a summary line.

JSON (`--json`, schema_version 1; fields are only ever added, never renamed or removed):

    {
      "schema_version": 1,
      "command": "diagnose" | "check" | "verify",
      "status": "healthy" | "problems",          # problems: at least one warning or error
      "problems": 2,                               # warnings + errors
      "counts": {"ok": 0, "warning": 1, "error": 1},
      "input": {"sources": ["logs/router.log", …], "lines": 1200, "records": 1180, "unreadable": 3,
                "ignored": 17, "undeclared": 0, "requests": 40, "complete": 38},
      "findings": [
        {"id": "kv.port_mismatch", "severity": "error", "title": "…", "cause": "…", "fix": "…",
         "request_ids": ["3f9c…"],
         "evidence": [{"service": "prefill", "ts": "2026-11-29T20:31:55.123Z", "line": "{…}"}]}
      ]
    }

Exit codes: 0 no error (warnings too, unless --strict); 1 at least one error (or warning with
--strict); 2 the doctor could not run (printed as {"schema_version": 1, "status": "doctor_failed",
"error": "…"} in JSON mode).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Iterable, TextIO

from doctor.findings import Finding

SCHEMA_VERSION = 1
UNICODE = {"ok": "[✓]", "warning": "[!]", "error": "[✗]"}
ASCII = {"ok": "[OK]", "warning": "[WARN]", "error": "[FAIL]"}
COLORS = {"ok": "\x1b[32m", "warning": "\x1b[33m", "error": "\x1b[31m"}
RESET = "\x1b[0m"
LINE_MAX = 220  # evidence lines are cut in text mode; JSON keeps them whole


@dataclass(frozen=True)
class Style:
    fancy: bool  # unicode marks and colours
    verbose: bool

    @classmethod
    def detect(cls, stream: TextIO, verbose: bool, no_color: bool) -> Style:
        fancy = not no_color and not os.environ.get("NO_COLOR") and hasattr(stream, "isatty") and stream.isatty()
        return cls(fancy, verbose)


def exit_code(findings: Iterable[Finding], strict: bool = False) -> int:
    severities = {f.severity for f in findings}
    return 1 if "error" in severities or (strict and "warning" in severities) else 0


def _mark(severity: str, style: Style) -> str:
    if not style.fancy:
        return ASCII[severity]
    return f"{COLORS[severity]}{UNICODE[severity]}{RESET}"


def _cut(text: str) -> str:
    return text if len(text) <= LINE_MAX else text[: LINE_MAX - 1] + "…"


def render_text(findings: list[Finding], style: Style, input_summary: dict, command: str = "diagnose") -> str:
    bullet = "•" if style.fancy else "-"
    out: list[str] = []
    sources = input_summary.get("sources") or []
    if command == "diagnose":
        out.append(f"Read {input_summary.get('lines', 0)} lines from {len(sources)} source(s): "
                   f"{input_summary.get('records', 0)} events, {input_summary.get('requests', 0)} requests "
                   f"({input_summary.get('complete', 0)} complete), {input_summary.get('unreadable', 0)} "
                   "unreadable lines skipped")
        if input_summary.get("undeclared"):
            out.append(f"{input_summary['undeclared']} lines differ from this doctor's event declarations (another "
                       "version of the stack?); read anyway")
    for f in findings:
        out.append(f"{_mark(f.severity, style)} {f.title}")
        if not style.verbose or f.severity == "ok" and not f.request_ids:
            continue
        out.append(f"    {bullet} cause: {f.cause}")
        for ev in f.evidence:
            out.append(f"    {bullet} {ev.service:<7} {ev.ts or '-':<24} {_cut(ev.line)}")
        if f.request_ids:
            shown = ", ".join(f.request_ids[:5]) + (f" (+{len(f.request_ids) - 5} more)" if len(f.request_ids) > 5 else "")
            out.append(f"    {bullet} requests: {shown}")
        if f.severity != "ok":
            fix_lines = f.fix.splitlines() or [""]
            out.append(f"    ! fix: {fix_lines[0]}")
            out.extend(f"           {line}" for line in fix_lines[1:])
    problems = [f for f in findings if f.severity != "ok"]
    if problems:
        errors = sum(f.severity == "error" for f in problems)
        out.append("")
        out.append(f"Doctor found {len(problems)} issue(s): {errors} error(s), {len(problems) - errors} warning(s)."
                   + ("" if style.verbose else " Run with -v for cause, evidence and fix."))
    else:
        out.append("")
        out.append("No issues found!")
    return "\n".join(out) + "\n"


def to_json(findings: list[Finding], input_summary: dict, command: str = "diagnose") -> dict:
    counts = {s: sum(f.severity == s for f in findings) for s in ("ok", "warning", "error")}
    problems = counts["warning"] + counts["error"]
    return {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "status": "problems" if problems else "healthy",
        "problems": problems,
        "counts": counts,
        "input": input_summary,
        "findings": [
            {
                "id": f.id, "severity": f.severity, "title": f.title, "cause": f.cause, "fix": f.fix,
                "request_ids": list(f.request_ids),
                "evidence": [{"service": e.service, "ts": e.ts, "line": e.line} for e in f.evidence],
            }
            for f in findings
        ],
    }


def render_json(findings: list[Finding], input_summary: dict, command: str = "diagnose") -> str:
    return json.dumps(to_json(findings, input_summary, command), ensure_ascii=False, indent=2) + "\n"


def render_failure(message: str, as_json: bool, stdout: TextIO | None = None) -> None:
    """The doctor could not run (exit 2): the reason on stderr, and a JSON document on stdout with --json."""
    if as_json:
        (stdout or sys.stdout).write(json.dumps({"schema_version": SCHEMA_VERSION, "status": "doctor_failed",
                                                 "error": message}) + "\n")
    sys.stderr.write(f"doctor: {message}\n")
