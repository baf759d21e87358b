"""Rendering: flutter-style text (ASCII when not a terminal) compared as text, and the JSON schema."""

from __future__ import annotations

import io
import json

from doctor.findings import Evidence, Finding
from doctor.render import Style, exit_code, render_json, render_text, to_json

FINDINGS = [
    Finding("kv.port_mismatch", "error", "kv_port mismatch: prefill pushes KV to decode:9100 but decode listens on 9200",
            "Prefill is refused.", "set kv_port 9200 everywhere\nthen restart",
            (Evidence("prefill", "2026-11-29T20:31:01.038Z", '{"event": "kv_producer.connect_failed"}'),
             Evidence("decode", "2026-11-29T20:30:57.000Z", '{"event": "kv_consumer.listening"}')), ("r1", "r2")),
    Finding("limit.rate_limited", "warning", "Rate limited 1 time(s)", "Too fast.", "slow down"),
]
SUMMARY = {"sources": ["a.log"], "lines": 10, "records": 9, "unreadable": 1, "ignored": 0, "requests": 2,
           "complete": 0}


def test_ascii_report_without_details():
    """Not a terminal: [FAIL]/[WARN] marks, titles only, and a summary line pointing at -v."""
    text = render_text(FINDINGS, Style(fancy=False, verbose=False), SUMMARY)
    assert text == (
        "Read 10 lines from 1 source(s): 9 events, 2 requests (0 complete), 1 unreadable lines skipped\n"
        "[FAIL] kv_port mismatch: prefill pushes KV to decode:9100 but decode listens on 9200\n"
        "[WARN] Rate limited 1 time(s)\n"
        "\n"
        "Doctor found 2 issue(s): 1 error(s), 1 warning(s). Run with -v for cause, evidence and fix.\n")


def test_ascii_report_verbose_has_cause_evidence_fix():
    """-v adds cause, evidence (service, ts, line) in hop order, request ids and the fix."""
    text = render_text(FINDINGS[:1], Style(fancy=False, verbose=True), SUMMARY)
    assert text.splitlines()[1:9] == [
        "[FAIL] kv_port mismatch: prefill pushes KV to decode:9100 but decode listens on 9200",
        "    - cause: Prefill is refused.",
        '    - prefill 2026-11-29T20:31:01.038Z {"event": "kv_producer.connect_failed"}',
        '    - decode  2026-11-29T20:30:57.000Z {"event": "kv_consumer.listening"}',
        "    - requests: r1, r2",
        "    ! fix: set kv_port 9200 everywhere",
        "           then restart",
        "",
    ]


def test_healthy_report():
    """Only an ok finding → [OK] line and 'No issues found!'."""
    ok = [Finding("healthy", "ok", "healthy: 3 requests went router → prefill → KV → decode", "", "")]
    text = render_text(ok, Style(fancy=False, verbose=False), SUMMARY)
    assert text.endswith("[OK] healthy: 3 requests went router → prefill → KV → decode\n\nNo issues found!\n")


def test_unicode_marks_only_on_a_terminal(monkeypatch):
    """A TTY without NO_COLOR gets ✓ ! ✗; NO_COLOR or --no-color falls back to ASCII."""
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert Style.detect(Tty(), False, no_color=False).fancy
    assert not Style.detect(Tty(), False, no_color=True).fancy
    assert not Style.detect(io.StringIO(), False, no_color=False).fancy
    monkeypatch.setenv("NO_COLOR", "1")
    assert not Style.detect(Tty(), False, no_color=False).fancy
    text = render_text(FINDINGS, Style(fancy=True, verbose=False), SUMMARY)
    assert "[✗]" in text and "[!]" in text


def test_json_schema_is_stable():
    """The documented keys, in their documented shapes (schema_version 1)."""
    doc = json.loads(render_json(FINDINGS, SUMMARY))
    assert list(doc) == ["schema_version", "command", "status", "problems", "counts", "input", "findings"]
    assert doc["schema_version"] == 1 and doc["status"] == "problems" and doc["problems"] == 2
    assert doc["counts"] == {"ok": 0, "warning": 1, "error": 1}
    assert list(doc["findings"][0]) == ["id", "severity", "title", "cause", "fix", "request_ids", "evidence"]
    assert doc["findings"][0]["evidence"][0] == {"service": "prefill", "ts": "2026-11-29T20:31:01.038Z",
                                                 "line": '{"event": "kv_producer.connect_failed"}'}
    assert to_json([], SUMMARY)["status"] == "healthy"


def test_exit_code_follows_the_worst_severity():
    """Errors → 1; warnings → 0 unless strict; nothing → 0."""
    assert exit_code(FINDINGS) == 1
    assert exit_code(FINDINGS[1:]) == 0
    assert exit_code(FINDINGS[1:], strict=True) == 1
    assert exit_code([]) == 0
