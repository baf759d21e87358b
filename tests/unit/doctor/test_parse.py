"""Parsing: compose prefixes (v1/v2, with/without --timestamps), garbage lines, client error lines."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from doctor.parse import classify_client_line, parse_lines, service_from_name
from stack.common import events
from tests.unit.doctor.scenarios import Log


def _sent_line() -> str:
    """A kv_producer.sent line as prefill logs it, at 2026-11-29T20:31:55.123Z."""
    log = Log(skew={})
    log.now = datetime(2026, 11, 29, 20, 31, 55, 123000, tzinfo=timezone.utc)
    log.ev("prefill", events.KV_PRODUCER_SENT, "pushed", "r1", transfer_id="t1", decode_kv_addr="decode:9100",
           num_tokens=1, bytes=2048, transfer_ms=0.1, gbps=20.5)
    return log.render("raw")[0]


JSON = _sent_line()


@pytest.mark.parametrize("line", [
    JSON,
    f"prefill-1  | {JSON}",
    f"prefill-1  | 2026-11-29T20:31:55.123456789Z {JSON}",
    f"pd_prefill_1 | {JSON}",
    f"pd_prefill_1   | 2026-11-29T20:31:55.123456789Z {JSON}",
    f"\x1b[36mprefill-1  |\x1b[0m {JSON}",
])
def test_every_compose_format_gives_the_same_record(line):
    """Raw JSON, v2 and v1 prefixes, --timestamps and colour codes all parse to the same record."""
    records, stats = parse_lines([line], "t")
    assert stats.unreadable == 0
    [record] = records
    assert (record.service, record.event, record.request_id, record.ts) == \
           ("prefill", "kv_producer.sent", "r1", "2026-11-29T20:31:55.123Z")
    assert record[events.BYTES] == 2048
    assert stats.undeclared == 0
    assert record.line == JSON


@pytest.mark.parametrize("name,service", [
    ("router-1", "router"), ("pd_router_1", "router"), ("pd-test-decode-1", "decode"),
    ("my_proj_prefill_2", "prefill"), ("engine-1", "engine"), ("other-1", "other"),
])
def test_service_from_container_name(name, service):
    """Compose v1 and v2 container names map back to the service."""
    assert service_from_name(name) == service


def test_garbage_is_counted_and_skipped():
    """Binary noise and truncated JSON are unreadable; tracebacks from a service are ignored; none is fatal."""
    lines = [JSON, "\x00\x17\x9b\x02binary", '{"ts": "2026-11-29T20:31', "decode-1 | Traceback (most recent call last):",
             "", JSON]
    records, stats = parse_lines(lines, "t")
    assert len(records) == 2
    assert stats.unreadable == 2
    assert stats.ignored == 1
    assert stats.lines == 5  # the blank line is not counted


def test_healthy_bundle_reads_every_event_and_counts_garbage(bundles):
    """The v2 bundle with garbage: every JSON line is a record, the 2 corrupt lines are counted."""
    text = (bundles / "healthy_v2ts.log").read_text(encoding="utf-8").splitlines()
    records, stats = parse_lines(text, "healthy")
    assert stats.unreadable == 2
    assert {r.service for r in records} == {"router", "prefill", "decode"}
    assert stats.records + stats.unreadable + stats.ignored == stats.lines


@pytest.mark.parametrize("line,kind", [
    ("openai.AuthenticationError: Error code: 401 - {'error': {'message': 'Invalid API key', "
     "'code': 'invalid_api_key'}}", "auth_401"),
    ('API Error: 401 {"type":"error","error":{"type":"authentication_error","message":"OAuth token has expired. '
     'Please obtain a new token or refresh your existing token."}} · Please run /login', "oauth_expired"),
    ('{"error": "invalid_grant", "error_description": "Refresh token not found or invalid"}', "invalid_grant"),
    ("KeyError: 'choices'", "choices_keyerror"),
    ("Error reading choices[0].message.content", "choices_read"),
    ("IndexError: list index out of range", "choices_index"),
    ("stream disconnected before completion: error sending request for url (http://127.0.0.1:8080/v1/responses)",
     "stream_disconnected"),
    ("stream disconnected before completion: stream closed before response.completed", "stream_incomplete"),
    ("502 Bad Gateway: CC Switch local proxy failed", "local_proxy_failed"),
    ("Failed to connect to api.anthropic.com: ECONNREFUSED", "connect_failed"),
    ("openai.APIConnectionError: Connection error.", "connect_failed"),
    ("ERROR: Missing environment variable: `GW_API_KEY`.", "env_key_missing"),
    ("Could not resolve authentication method. Expected either apiKey or authToken to be set.", "auth_unresolved"),
    ("Auth conflict: Both a token (ANTHROPIC_AUTH_TOKEN) and an API key (ANTHROPIC_API_KEY) are set.",
     "auth_conflict"),
    ("ImportError: Using SOCKS proxy, but the 'socksio' package is not installed.", "socks_missing"),
])
def test_client_error_strings_are_recognised(line, kind):
    """Each client error string from the gateway notes maps to its kind."""
    found = classify_client_line(line)
    assert found is not None and found[0] == kind


def test_client_401_line_keeps_status_and_is_a_client_record():
    """A pasted SDK 401 becomes a client record with its HTTP status."""
    records, _ = parse_lines(["openai.AuthenticationError: Error code: 401 - {'error': {}}"], "stdin")
    [record] = records
    assert (record.service, record.event, record.data["status"]) == ("client", "client.auth_401", 401)
