"""Timelines: joined by request id (and transfer id), ordered by hop despite clock skew."""

from __future__ import annotations

from doctor.parse import parse_lines
from doctor.timeline import build_timelines
from stack.common import events
from tests.unit.doctor.scenarios import Log


def _timelines(bundles, name: str):
    records, _ = parse_lines((bundles / name).read_text(encoding="utf-8").splitlines(), name)
    return build_timelines(records)


def test_skewed_decode_clock_does_not_reorder_hops(bundles):
    """Decode's clock is 3 s behind, yet every timeline reads router → prefill → decode."""
    timelines, _ = _timelines(bundles, "healthy_v2ts.log")
    assert len(timelines) == 5
    for t in timelines.values():
        services = [r.service for r in t.records]
        assert services == sorted(services, key=["router", "prefill", "decode"].index)
        decode_ts = min(r.ts for r in t.records if r.service == "decode")
        router_ts = min(r.ts for r in t.records if r.service == "router")
        assert decode_ts < router_ts  # the skew is really in the bundle
        assert t.complete and t.stopped_at is None
        assert t.reached == ("router", "prefill", "kv", "decode", "done")


def test_kv_lines_outside_a_request_join_by_transfer_id(bundles):
    """decode's buffer_full line carries no request id but lands in its request through transfer_id."""
    timelines, background = _timelines(bundles, "kv_buffer_full.log")
    failed = [t for t in timelines.values() if t.first("kv_consumer.buffer_full")]
    assert len(failed) == 2
    assert all(r.event != "kv_consumer.buffer_full" for r in background)


def test_request_that_failed_at_decode_stops_there(bundles):
    """A decode 504 after a refused KV push stops at decode and is not complete."""
    timelines, background = _timelines(bundles, "kv_port_mismatch.log")
    assert {t.stopped_at for t in timelines.values()} == {"decode"}
    assert not any(t.complete for t in timelines.values())
    assert any(r.event == "kv_consumer.listening" for r in background)


def test_authenticated_listing_calls_are_not_requests():
    """GET /v1/models with a valid key (auth.accepted + access line, as a live stack logs it) is no stopped request."""
    log = Log()
    log.ev("router", events.AUTH_ACCEPTED, "key 'default' accepted", "40637df7", key_name="default", header="authorization")
    log.ev("router", events.HTTP_ACCESS, "GET /v1/models 200", "40637df7", method="GET", path="/v1/models", status=200,
           duration_ms=0.4)
    records, _ = parse_lines(log.render("raw"), "router.log")
    timelines, background = build_timelines(records)
    assert timelines == {} and len(background) == 2
