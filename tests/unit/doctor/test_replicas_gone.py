"""A discover pool's last replica gone (stack/router/replicas.py): the doctor names the 503s and that it left the pool."""

from __future__ import annotations

from pathlib import Path

from stack.common import events
from tests.unit.doctor.helpers import by_id, diagnose
from tests.unit.doctor.scenarios import DECODE, Log, backend_gone, startup


def test_a_decode_that_left_its_discover_pool_is_named(tmp_path: Path) -> None:
    """The decode container stopped: it no longer resolves under dns://decode:8000 (discovery.left), requests get 503
    no_decode_backend; the finding says it left the pool and carries that line as evidence."""
    log = Log()
    startup(log)
    log.ev("router", events.DISCOVERY_LEFT, f"decode replica {DECODE} no longer under dns://decode:8000; 0 request(s) in flight finish there",
           role="decode", backend=DECODE, discover="dns://decode:8000", replicas=0, in_flight_requests=0)
    backend_gone(log, 1, role="decode", first=False)
    path = tmp_path / "decode_left.log"
    log.write(path, "v2")
    findings, _ = diagnose(path)
    f = by_id(findings, "backend.decode_down")
    assert "1 replica(s) left the pool (no longer found under dns://decode:8000, 0 left)" in f.cause
    assert any(f'"event": "{events.DISCOVERY_LEFT}"' in e.line for e in f.evidence)
