"""doctor/checks/long_prompt.py: each long-prompt failure, from the lines the services really log, to its finding."""

from __future__ import annotations

import io
import json
from pathlib import Path

from stack.common import events
from stack.common.logging import log_event, request_context, setup_logging
from tests.unit.doctor.helpers import by_id, diagnose


def _log(tmp_path: Path, lines: list[tuple[str, str, events.Event, str, dict]]) -> Path:
    """Write (service, request id, event, message, fields) through the real log_event, compose-prefixed, to a file."""
    out = []
    for service, rid, event, msg, fields in lines:
        sink = io.StringIO()
        setup_logging(service, sink=sink)
        with request_context(rid):
            log_event(event, msg, event.level, **fields)
        out += [f"{service}-1  | {line}" for line in sink.getvalue().splitlines()]
    setup_logging("test")
    path = tmp_path / "compose.log"
    path.write_text("\n".join(out) + "\n")
    return path


def test_context_exceeded_names_both_token_counts(tmp_path: Path) -> None:
    """A 400 context_length_exceeded becomes long_prompt.context_exceeded with the engine's count and window."""
    msg = "This model's maximum context length is 65536 tokens. However, your prompt has 89892 tokens, which leaves no room"
    path = _log(tmp_path, [("router", "r1", events.HTTP_BAD_REQUEST, msg, {"status": 400, "type": "invalid_request_error",
                                                                            "code": "context_length_exceeded"})])
    found = by_id(diagnose(path)[0], "long_prompt.context_exceeded")
    assert "89892" in found.cause and "65536" in found.cause and found.request_ids == ("r1",)


def test_one_refusal_logged_by_the_engine_and_the_router_counts_once(tmp_path: Path) -> None:
    """The prefill and the router both log the 400 of one request: the finding says 1 request, not 2."""
    msg = "This model's maximum context length is 65536 tokens. However, your prompt has 70005 tokens, which leaves no room"
    fields = {"status": 400, "type": "invalid_request_error", "code": "context_length_exceeded"}
    path = _log(tmp_path, [("prefill", "r1", events.HTTP_BAD_REQUEST, msg, fields), ("router", "r1", events.HTTP_BAD_REQUEST, msg, fields)])
    found = by_id(diagnose(path)[0], "long_prompt.context_exceeded")
    assert found.title.startswith("1 request(s) refused") and found.request_ids == ("r1",)


def test_decode_pool_too_small_and_stalled_push_and_abandoned_work(tmp_path: Path) -> None:
    """Pool refusal, a push cut off after kv_lease_ms of silence, and abandoned work: one finding each, with the fix."""
    path = _log(tmp_path, [
        ("decode", "p1", events.KV_CONSUMER_POOL_TOO_SMALL, "too small", {"transfer_id": "t1", "num_tokens": 60000,
                                                                          "pool_tokens": 30000, "kv_cache_bytes": 500000000, "peer": "p:1"}),
        ("decode", "p2", events.KV_CONSUMER_STALLED, "stalled", {"transfer_id": "t2", "idle_ms": 30001, "kv_lease_ms": 30000,
                                                                 "received": 10, "bytes": 100, "peer": "p:1"}),
        ("prefill", "p3", events.ENGINE_REQUEST_ABANDONED, "gone", {"prompt_tokens": 30002, "pd_leg": "prefill", "waited_ms": 60000.0}),
        ("prefill", "p3", events.ENGINE_PREFILL_STOPPED, "stopped", {"prompt_tokens": 30002, "computed_tokens": 0, "layers_done": 3}),
    ])
    findings, _ = diagnose(path)
    capacity = by_id(findings, "long_prompt.decode_kv_capacity")
    assert "60000" in capacity.title and "30000" in capacity.title and "kv_cache_bytes" in capacity.fix
    assert "kv_lease_ms" in by_id(findings, "long_prompt.kv_stalled").fix
    abandoned = by_id(findings, "long_prompt.abandoned")
    assert "30002" in abandoned.title and "1 stopped mid-forward" in abandoned.cause and abandoned.request_ids == ("p3",)
    assert len(abandoned.evidence) == 2
