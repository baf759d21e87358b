"""Slow is a diagnosis for our engine too: the router's TTFT over the SLO, explained by decode's engine.request_queued
(waits for KV blocks) — never `healthy`."""

from __future__ import annotations

import json
from pathlib import Path

from tests.unit.doctor.helpers import by_id, diagnose
from tests.unit.doctor.test_exit_codes import complete


def test_kv_waits_on_our_decode_explain_a_broken_ttft_slo(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("PD_SLO_TTFT_MS", raising=False)
    queued = [json.dumps({"ts": "2026-12-02T03:00:01.150Z", "level": "INFO", "service": "decode",
                          "event": "engine.request_queued", "request_id": f"s{n}", "msg": "waiting for KV blocks",
                          "blocks_needed": 40, "blocks_free": 3}) for n in range(3)]
    (tmp_path / "all.log").write_text("\n".join(sum((complete(f"s{n}", ttft_ms=6000.0) for n in range(3)), []) + queued))
    findings, _ = diagnose(tmp_path / "all.log")
    f = by_id(findings, "slow.decode_kv_capacity")
    assert "P99 TTFT 6.0 s > SLO 2 s" in f.title and "3 waits for KV blocks" in f.title
    assert {e.service for e in f.evidence} == {"decode"} and "engine.request_queued" in f.evidence[0].line
    assert "kv_cache_bytes in decode/config.json" in f.fix and "./pd scale decode=N" in f.fix
    assert "healthy" not in {x.id for x in findings}
