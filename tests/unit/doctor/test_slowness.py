"""Slow is a diagnosis for our engine too: the router's TTFT over the SLO, explained by decode's engine.request_queued
(waits for KV blocks) — never `healthy`."""

from __future__ import annotations

import json
from pathlib import Path

from tests.unit.doctor.helpers import by_id, diagnose
from tests.unit.doctor.test_exit_codes import line


def slow_request(rid: str, ttft_ms: float) -> list[str]:
    return [line(rid, "router.request_received", "01.000", api="chat", model="m", stream=True),
            line(rid, "router.scheduled", "01.001", prefill="http://p", decode="http://d", policy="load_aware",
                 mode="disaggregated", attempt=1),
            line(rid, "router.prefill_done", "01.100", prefill="http://p", prefill_ms=90.0, transfer_id=rid),
            line(rid, "router.kv_handoff", "01.101", decode="http://d", transfer_id=rid,
                 kv_transfer_params=["remote_engine_id"]),
            line(rid, "router.decode_first_token", "01.200", decode="http://d", ttft_ms=ttft_ms),
            line(rid, "router.request_done", "09.300", api="chat", key_name="default", status=200, error=None,
                 prompt_tokens=500, completion_tokens=20, e2e_ms=ttft_ms + 500.0)]


def test_kv_waits_on_our_decode_explain_a_broken_ttft_slo(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("PD_SLO_TTFT_MS", raising=False)
    queued = [json.dumps({"ts": "2026-12-02T03:00:01.150Z", "level": "INFO", "service": "decode",
                          "event": "engine.request_queued", "request_id": f"s{n}", "msg": "waiting for KV blocks",
                          "blocks_needed": 40, "blocks_free": 3}) for n in range(3)]
    (tmp_path / "all.log").write_text("\n".join(sum((slow_request(f"s{n}", 6000.0) for n in range(3)), []) + queued))
    findings, _ = diagnose(tmp_path / "all.log")
    f = by_id(findings, "slow.decode_kv_capacity")
    assert "P99 TTFT 6.0 s > SLO 2 s" in f.title and "3 waits for KV blocks" in f.title
    assert {e.service for e in f.evidence} == {"decode"} and "engine.request_queued" in f.evidence[0].line
    assert "kv_cache_bytes in decode/config.json" in f.fix and "./pd scale decode=N" in f.fix
    assert "healthy" not in {x.id for x in findings}
