"""`doctor diagnose` exits non-zero whenever a request failed for a reason the stack caused, and never exits 0 on a
window where every request failed — even when each failure alone looks like the client's (a 4xx)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from doctor.cli import main


def line(rid: str, event: str, ts: str, **fields) -> str:
    return json.dumps({"ts": f"2026-12-02T03:00:{ts}Z", "level": "INFO", "service": "router", "event": event,
                       "request_id": rid, "msg": event, **fields})


def request(rid: str, status: int, prefilled: bool = False) -> list[str]:
    lines = [line(rid, "router.request_received", "00.000", api="chat", model="m", stream=False)]
    if prefilled:
        lines += [line(rid, "router.prefill_done", "00.100", prefill="http://p", prefill_ms=90.0, transfer_id=rid),
                  line(rid, "router.upstream_error", "00.200", backend="http://d", role="decode", status=status,
                       body='{"error": "refused"}')]
    lines.append(line(rid, "router.request_done", "00.300", api="chat", key_name="default", status=status,
                      error="refused", prompt_tokens=0, completion_tokens=0, e2e_ms=300.0))
    return lines


def diagnose(tmp_path: Path, lines: list[str]) -> tuple[int, list[dict]]:
    log = tmp_path / "router.log"
    log.write_text("\n".join(lines) + "\n")
    out = io.StringIO()
    code = main(["diagnose", "--json", "--home", str(tmp_path / "no-home"), "--logs", str(log)], stdout=out)
    return code, json.loads(out.getvalue())["findings"]


def test_a_window_where_every_request_failed_never_exits_0(tmp_path):
    """Two requests, both a router 4xx no diagnosis knows: request.unexplained is an error, exit 1."""
    code, findings = diagnose(tmp_path, request("a1", 422) + request("a2", 422))
    unexplained = next(f for f in findings if f["id"] == "request.unexplained")
    assert unexplained["severity"] == "error" and code == 1


def test_decode_refusing_what_prefill_accepted_is_the_stacks_failure(tmp_path):
    """A 4xx decode answered after prefill accepted the request, beside a 4xx of the client's own: exit 1."""
    code, findings = diagnose(tmp_path, request("b1", 400, prefilled=True) + request("b2", 422)
                              + complete("b3"))
    assert code == 1
    assert {f["severity"] for f in findings if "b1" in f["request_ids"]} == {"error"}
    assert {f["severity"] for f in findings if "b2" in f["request_ids"]} == {"warning"}  # the client's own 4xx


def complete(rid: str, ttft_ms: float = 200.0) -> list[str]:
    """A request that went router → prefill → KV (a vLLM hand-off) → decode and was answered."""
    return [line(rid, "router.request_received", "01.000", api="chat", model="m", stream=False),
            line(rid, "router.scheduled", "01.001", prefill="http://p", decode="http://d", policy="load_aware",
                 mode="disaggregated", attempt=1),
            line(rid, "router.prefill_done", "01.100", prefill="http://p", prefill_ms=90.0, transfer_id=rid),
            line(rid, "router.kv_handoff", "01.101", decode="http://d", transfer_id=rid,
                 kv_transfer_params=["remote_engine_id"]),
            line(rid, "router.decode_first_token", "01.200", decode="http://d", ttft_ms=ttft_ms),
            line(rid, "router.request_done", "01.300", api="chat", key_name="default", status=200, error=None,
                 prompt_tokens=500, completion_tokens=20, e2e_ms=ttft_ms + 500.0)]
