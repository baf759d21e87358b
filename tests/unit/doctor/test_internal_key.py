"""Our engine refusing the router's internal key: auth.internal_key_mismatch with both sides' lines, its fix in our
engine's terms, and no "a client bypasses the router" for the router's own refused legs."""

from __future__ import annotations

import json
from pathlib import Path

from tests.unit.doctor.helpers import by_id, diagnose
from tests.unit.doctor.test_exit_codes import line


def test_our_decode_refusing_the_routers_key_is_named_with_both_sides(tmp_path: Path):
    router = [line("k1", "router.request_received", "00.000", api="chat", model="m", stream=False),
              line("k1", "router.prefill_done", "00.100", prefill="http://p", prefill_ms=9.0, transfer_id="k1"),
              line("k1", "router.upstream_error", "00.200", backend="http://decode:8000", role="decode", status=401,
                   body='{"error": {"code": "internal_key_required"}}'),
              line("k1", "router.request_done", "00.300", api="chat", key_name="default", status=502,
                   error="internal_key_rejected", prompt_tokens=0, completion_tokens=0, e2e_ms=300.0)]
    decode = json.dumps({"ts": "2026-12-02T03:00:00.200Z", "level": "WARNING", "service": "decode",
                         "event": "internal_auth.rejected", "request_id": "k1", "msg": "refused",
                         "path": "/v1/chat/completions", "peer": "172.18.0.4"})
    (tmp_path / "all.log").write_text("\n".join(router + [decode]) + "\n")
    findings, _ = diagnose(tmp_path / "all.log")
    f = by_id(findings, "auth.internal_key_mismatch")
    assert findings[0] is f and f.severity == "error" and "decode engine" in f.title
    assert {e.service for e in f.evidence} == {"router", "decode"} and f.request_ids == ("k1",)
    assert "give the decode engine the router's PD_INTERNAL_KEY" in f.fix and "VLLM_API_KEY" not in f.fix
    assert not {"engine.bypass_refused", "request.unexplained", "choices.decode_failed"} & {x.id for x in findings}
