"""The doctor reads every declared event as the services' real log_event writes it, through the declarations."""

from __future__ import annotations

import io

import pytest

from doctor import environment, render
from doctor.checks import run_checks
from doctor.findings import Context
from doctor.parse import parse_lines
from stack.common import events
from stack.common import logging as pd_logging
from tests.unit.doctor.scenarios import Log, every_event


def _every_event_records():
    log = Log()
    every_event(log)
    return parse_lines(log.render("v2"), "every-event")


def test_every_declared_event_is_read_back_field_by_field():
    """Each event, logged by log_event with every declared field, parses to a record whose fields the doctor
    reads back through the Field constants: no line is unknown or off its declaration."""
    records, stats = _every_event_records()
    assert (stats.unreadable, stats.undeclared, stats.records) == (0, 0, len(events.ALL))
    assert [r.event for r in records] == list(events.ALL)
    for record in records:
        event = events.ALL[record.event]
        for field in event.fields.values():
            assert record[field] == field.example, f"{event}.{field.name}"


def test_the_checks_find_what_the_declared_events_say():
    """All the checks run over the every-event log; each event a check depends on yields its finding, its numbers
    read from the declared fields (kv_port 9100 listening = the port pushed to: closed, not a mismatch)."""
    records, stats = _every_event_records()
    ctx = Context.build(records, environment.snapshot("/nonexistent", environ={}), stats)
    findings = {f.id: f for f in run_checks(ctx)}
    assert list(findings) == [
        "auth.router_key_missing",  # auth.key_missing
        "auth.unknown_key",  # auth.rejected (its example reason is no auth reason: told as an unknown key)
        "limit.quota_exhausted", "limit.rate_limited",
        "kv.port_mismatch",  # router.kv_port_mismatch (the router was given a port decode does not use)
        "kv.port_closed",  # kv_producer.connect_failed refused + kv_consumer.listening on that very port
        "kv.unreachable",  # kv_consumer.incomplete
        "kv.buffer_too_small", "kv.model_mismatch", "kv.checksum_mismatch",
        "long_prompt.decode_kv_capacity", "long_prompt.kv_stalled", "long_prompt.abandoned",
        "p2pnccl.bad_ping", "p2pnccl.left",
    ]
    assert "(100204 of 100000 tokens used)" in findings["limit.quota_exhausted"].title
    assert "(81920 bytes > 8000000000 bytes)" in findings["kv.buffer_too_small"].title
    assert "llama-tiny-seed1-77d0b3c1" in findings["kv.model_mismatch"].cause
    assert "socket.create_connection(('decode', 9100)" in findings["kv.unreachable"].fix  # decode's own kv_port


def test_a_check_reading_a_field_its_event_does_not_declare_fails_loudly():
    """record[FIELD] is only for fields the record's event declares: a doctor out of step with events.py fails."""
    records, _ = _every_event_records()
    queued = next(r for r in records if r.event == events.ROUTER_QUEUED)
    assert queued[events.QUEUE_DEPTH] == 3
    with pytest.raises(AssertionError, match="router.queued declares no field KV_PORT"):
        queued[events.KV_PORT]
    assert queued.get(events.KV_PORT) is None  # scans across events ask with get()


def test_lines_off_the_declarations_are_read_counted_and_reported(monkeypatch):
    """A newer service's line with a field this doctor does not know is still read, and the report says so."""
    sink = io.StringIO()
    pd_logging.setup_logging("decode", sink=sink)
    monkeypatch.setattr(pd_logging._Output, "strict", False)  # production: the call logs as given
    pd_logging.log_event(events.KV_CONSUMER_LISTENING, "listening", kv_port=9100, kv_buffer_size=8e9, kv_lease_ms=1,
                         kv_ip="::")
    records, stats = parse_lines(sink.getvalue().splitlines(), "decode.log")
    assert [r.event for r in records] == ["log.fields_mismatch", "kv_consumer.listening"]
    assert stats.undeclared == 1 and stats.undeclared_examples == ["decode.log:2: kv_consumer.listening undeclared kv_ip"]
    assert records[1][events.KV_PORT] == 9100
    summary = {"sources": ["decode.log"], "lines": 2, "records": 2, "undeclared": stats.undeclared}
    text = render.render_text([], render.Style(fancy=False, verbose=False), summary)
    assert text.splitlines()[1] == ("1 lines differ from this doctor's event declarations (another version of the "
                                    "stack?); read anyway")


def test_recorded_stack_logs_match_the_declarations(bundles):
    """Logs really printed by a compose stack (bundles/recorded_*.log) fit today's declarations line by line."""
    for name in ("recorded_healthy.log", "recorded_kv_port.log"):
        _, stats = parse_lines((bundles / name).read_text(encoding="utf-8").splitlines(), name)
        assert stats.undeclared == 0, stats.undeclared_examples

