"""Each log-based diagnosis on its recorded bundle: the right cause, evidence from the right services."""

from __future__ import annotations

import pytest

from stack.common import events
from tests.unit.doctor.helpers import by_id, diagnose
from tests.unit.doctor.scenarios import Log, startup


def services(finding) -> set[str]:
    return {e.service for e in finding.evidence}


@pytest.mark.parametrize("bundle", ["healthy_v2ts.log", "healthy_v1.log", "healthy_split"])
def test_healthy_stack_gives_no_finding_and_says_so(bundles, bundle):
    """A working stack (any compose format, skewed clock, garbage lines) yields only the healthy summary."""
    findings, ctx = diagnose(bundles / bundle)
    assert [f.id for f in findings] == ["healthy"]
    assert findings[0].title == "healthy: 5 requests went router → prefill → KV → decode"
    assert findings[0].severity == "ok"


def test_router_started_without_key(bundles):
    """auth.key_missing at start + no_keys_configured rejections → the env var was not injected."""
    findings, _ = diagnose(bundles / "router_key_missing.log")
    f = by_id(findings, "auth.router_key_missing")
    assert f.severity == "error"
    assert "TAOTOKEN_API_KEY" in f.title
    assert "docker compose exec router" in f.fix and ".env" in f.fix
    assert services(f) == {"router"}
    assert len(f.request_ids) == 3
    assert [x.id for x in findings] == ["auth.router_key_missing"]


def test_each_401_reason_and_quota_told_from_rate_limit(bundles):
    """Missing header, whitespace and unknown key are separate findings; quota is an error, rate a warning."""
    findings, _ = diagnose(bundles / "auth_mixed.log")
    ids = {f.id: f for f in findings}
    assert set(ids) == {"auth.no_header", "auth.key_whitespace", "auth.unknown_key", "limit.quota_exhausted",
                        "limit.rate_limited"}
    assert len(ids["auth.unknown_key"].request_ids) == 2
    assert "x-api-key ×1" in ids["auth.unknown_key"].cause
    assert ids["limit.quota_exhausted"].severity == "error"
    assert "100204 of 100000" in ids["limit.quota_exhausted"].title
    assert ids["limit.rate_limited"].severity == "warning"
    assert "limit.quota_exhausted" in ids["limit.quota_exhausted"].evidence[0].line


def test_pasted_401_without_router_rejection_is_not_from_the_router(bundles):
    """A client 401 while the router rejected nothing → the request went to another server."""
    findings, _ = diagnose(bundles / "healthy_v2ts.log", client=(bundles / "client_openai_401.txt",))
    f = by_id(findings, "auth.not_from_router")
    assert "client" in services(f)


def test_decode_failed_after_successful_prefill(bundles):
    """router.prefill_done then decode 500 → evidence from the router and from decode, with the client's KeyError."""
    findings, _ = diagnose(bundles / "decode_failed.log", client=(bundles / "client_keyerror.txt",))
    f = by_id(findings, "choices.decode_failed")
    assert services(f) == {"client", "router", "decode"}
    assert any('"router.prefill_done"' in e.line for e in f.evidence)
    assert any('"http.error"' in e.line and e.service == "decode" for e in f.evidence)
    assert "sampling produced NaN logits" in f.cause
    assert len(f.request_ids) == 2
    assert "request.stopped" not in {x.id for x in findings}


def test_keyerror_on_an_error_body_names_the_status(bundles):
    """A KeyError: 'choices' next to 401s → an error body reached the client; the statuses are named."""
    findings, _ = diagnose(bundles / "auth_mixed.log", client=(bundles / "client_keyerror.txt",))
    f = by_id(findings, "choices.error_body")
    assert "401 ×4" in f.title and "429 ×2" in f.title


def test_stream_cut_mid_way_has_no_done(bundles):
    """router.decode_failed mid_stream=true → a stream without [DONE]."""
    findings, _ = diagnose(bundles / "stream_cut.log")
    f = by_id(findings, "choices.stream_without_done")
    assert services(f) == {"router", "decode"}
    assert any(e.service == "decode" and "http.error" in e.line for e in f.evidence)


def test_index_error_on_usage_chunk(bundles):
    """IndexError with a stream that ended with a usage chunk → the client must skip empty choices."""
    findings, _ = diagnose(bundles / "usage_chunk.log", client=(bundles / "client_index_error.txt",))
    f = by_id(findings, "choices.empty_choices_chunk")
    assert f.severity == "warning"
    assert "if not chunk.choices: continue" in f.fix


def test_kv_port_mismatch(bundles):
    """connect refused to decode:9100 while decode listens on 9200 → kv_port mismatch, both ports named."""
    findings, _ = diagnose(bundles / "kv_port_mismatch.log")
    f = by_id(findings, "kv.port_mismatch")
    assert "decode:9100" in f.title and "9200" in f.title
    assert {"prefill", "decode", "router"} <= services(f)
    assert any("kv_consumer.listening" in e.line for e in f.evidence)
    assert "KV_TRANSFER_PORT=9200 in .env" in f.fix and "decode/config.json" in f.fix
    assert [x.id for x in findings] == ["kv.port_mismatch"]  # the decode timeouts are folded in


def test_kv_port_unreachable_is_a_network_problem(bundles):
    """connect timed out → unreachable (network), not a port mismatch."""
    findings, _ = diagnose(bundles / "kv_unreachable.log")
    f = by_id(findings, "kv.unreachable")
    assert "socket.create_connection(('decode', 9100)" in f.fix
    assert "kv.port_mismatch" not in {x.id for x in findings}


def test_kv_buffer_too_small_only_for_long_prompts(bundles):
    """buffer_full names both numbers and the failed prompt sizes vs the largest that succeeded."""
    findings, _ = diagnose(bundles / "kv_buffer_full.log")
    f = by_id(findings, "kv.buffer_too_small")
    assert "8192000 bytes > 262144 bytes" in f.title
    assert "Failed prompts: 1800, 4000 tokens" in f.cause
    assert "largest that went through: 100 tokens" in f.cause
    assert services(f) == {"prefill", "decode"}
    assert "kv_buffer_size" in f.fix and "7e7" in f.fix


def test_decode_timeout_without_a_push(bundles):
    """kv_consumer.timeout with no kv_producer.sent for the transfer → prefill never sent."""
    findings, _ = diagnose(bundles / "kv_timeout.log")
    f = by_id(findings, "kv.timeout_never_sent")
    assert "decode" in services(f)
    assert "5000 ms" in f.title


def test_model_version_mismatch(bundles):
    """A fingerprint mismatch names both model versions."""
    findings, _ = diagnose(bundles / "kv_model_mismatch.log")
    f = by_id(findings, "kv.model_mismatch")
    assert "llama-tiny-seed1-77d0b3c1" in f.cause and "llama-tiny-seed0-4c1f9a2e" in f.cause
    assert {"prefill", "decode"} <= services(f)


def test_router_not_running(bundles):
    """Only engine lines and a client connection error → the router is not running."""
    findings, _ = diagnose(bundles / "router_down.log", client=(bundles / "client_codex_disconnect.txt",))
    f = by_id(findings, "router.not_running")
    assert "client" in services(f)
    assert "docker compose up -d router" in f.fix


def test_client_error_not_in_router_log(bundles):
    """CC Switch 'local proxy failed' while the router saw only other requests → cannot reach the router."""
    findings, _ = diagnose(bundles / "healthy_v1.log", client=(bundles / "client_ccswitch.txt",))
    f = by_id(findings, "client.cannot_reach_router")
    assert "CC Switch" in f.cause
    assert {"client", "router"} == services(f)


def test_oauth_expired_pasted(bundles):
    """'OAuth token has expired' → the client uses its own OAuth login, fix names the router and the env var."""
    findings, _ = diagnose(bundles / "healthy_v1.log", client=(bundles / "client_oauth_expired.txt",))
    f = by_id(findings, "oauth.token_expired")
    assert "http://localhost:8080" in f.fix and "TAOTOKEN_API_KEY" in f.fix


def test_recorded_healthy_stack(bundles):
    """Logs really printed by a compose stack (3 streamed requests, health probes) → healthy, probes not counted."""
    findings, ctx = diagnose(bundles / "recorded_healthy.log")
    assert [f.title for f in findings] == ["healthy: 3 requests went router → prefill → KV → decode"]
    assert len(ctx.timelines) == 3


def test_recorded_kv_port_mismatch(bundles):
    """Logs really printed after decode was recreated with kv_port 9200 → kv.port_mismatch and nothing else."""
    findings, _ = diagnose(bundles / "recorded_kv_port.log")
    assert [f.id for f in findings] == ["kv.port_mismatch"]
    f = findings[0]
    assert f.request_ids == ("rec-kvport-0",)
    assert {"router", "prefill", "decode"} == services(f)


def test_kv_cut_mid_payload_without_any_port_in_the_logs_says_the_port_is_unknown(tmp_path):
    """Transfers cut mid-payload and no line naming decode's KV port → no guessed port: the fix asks decode for it."""
    log = Log()
    log.ev("decode", events.KV_CONSUMER_INCOMPLETE, "KV connection from 172.18.0.3:41822 closed after 4096 of 81920 "
           "payload bytes", "req-cut", transfer_id="kv-cut", received=4096, bytes=81920, peer="172.18.0.3:41822")
    log.write(tmp_path / "decode.log", "v2")
    findings, _ = diagnose(tmp_path / "decode.log")
    f = by_id(findings, "kv.unreachable")
    assert "decode's KV port is not in these logs" in f.fix and "/health" in f.fix
    assert "9100" not in f.fix


def test_a_push_cut_because_its_caller_left_blames_the_caller_not_the_network(tmp_path):
    """The router killed under agent-sized streams: the prefill's leg is abandoned, it stops the prefill and its KV
    push, and decode (its clock 3 s behind here) logs the transfer cut mid-payload. That is long_prompt.abandoned, not
    a network problem: no kv.unreachable. The same cut of a request nobody abandoned still is one."""
    log = Log()
    startup(log)
    log.ev("prefill", events.ENGINE_REQUEST_ABANDONED, "caller closed the connection after 4071.0 ms: cancelling",
           "req-left", prompt_tokens=5445, pd_leg="prefill", waited_ms=4071.0)
    log.ev("decode", events.KV_CONSUMER_INCOMPLETE, "KV connection from 172.20.0.3:47108 closed after 33454080 of "
           "89210880 payload bytes", "req-left", transfer_id="kv-left", received=33454080, bytes=89210880,
           peer="172.20.0.3:47108")
    log.write(tmp_path / "left.log", "v2")
    findings, _ = diagnose(tmp_path / "left.log")
    assert [f.id for f in findings] == ["long_prompt.abandoned"]
    log.ev("decode", events.KV_CONSUMER_INCOMPLETE, "KV connection from 172.20.0.3:47110 closed after 4096 of 81920 "
           "payload bytes", "req-cut", transfer_id="kv-cut", received=4096, bytes=81920, peer="172.20.0.3:47110")
    log.write(tmp_path / "both.log", "v2")
    findings, _ = diagnose(tmp_path / "both.log")
    assert by_id(findings, "kv.unreachable").request_ids == ("req-cut",)


@pytest.mark.parametrize("bundle", ["auth_mixed.log", "decode_failed.log", "kv_buffer_full.log", "kv_model_mismatch.log",
                                    "kv_port_mismatch.log", "kv_timeout.log", "kv_unreachable.log", "stream_cut.log"])
def test_fixes_name_the_config_files_where_they_live(bundles, bundle):
    """Fix texts point at prefill/, decode/ and router/ at the top of the checkout, not at files inside stack/."""
    findings, _ = diagnose(bundles / bundle)
    assert not [f.id for f in findings if "stack/" in f.fix or "stack/" in f.cause]


def test_kv_port_the_router_was_given_but_decode_does_not_use(tmp_path):
    """router.kv_port_mismatch (the router pushes to decode's reported port, requests work) → a warning naming
    both ports and where each came from, with the router's and decode's lines as evidence; no refused-port error."""
    from tests.unit.doctor.scenarios import request

    log = Log()
    startup(log, kv_port=9200)
    log.ev("router", events.ROUTER_KV_PORT_MISMATCH, "decode http://decode:8000 reports kv_port 9200, not 9100",
           backend="http://decode:8000", kv_addr="decode:9200", reported_port=9200,
           reported_by="GET http://decode:8000/health", configured_port=9100, configured_by="KV_TRANSFER_PORT")
    request(log, 1, kv_addr="decode:9200")
    log.write(tmp_path / "stack.log", "v2")
    findings, _ = diagnose(tmp_path / "stack.log")
    f = by_id(findings, "kv.port_mismatch")
    assert f.severity == "warning"
    assert "9100 (KV_TRANSFER_PORT)" in f.title and "decode listens on 9200" in f.title
    assert {"router", "decode"} <= services(f)
    assert "KV_TRANSFER_PORT in .env" in f.fix and "decode/config.json" in f.fix
    assert [x.id for x in findings if x.severity == "error"] == []


def test_a_caller_refused_by_an_engine_is_a_router_bypass(tmp_path):
    """internal_auth.rejected on decode (a client called the engine directly; it answers only the router's key)
    → engine.bypass_refused, a warning naming the caller's address, with decode's line as evidence."""
    from tests.unit.doctor.scenarios import request

    log = Log()
    startup(log)
    request(log, 1)
    log.ev("decode", events.INTERNAL_AUTH_REJECTED, "refused POST /v1/completions: not the router's PD_INTERNAL_KEY",
           "direct-1", path="/v1/completions", peer="172.18.0.1")
    log.write(tmp_path / "stack.log", "v2")
    findings, _ = diagnose(tmp_path / "stack.log")
    f = by_id(findings, "engine.bypass_refused")
    assert f.severity == "warning" and f.request_ids == ("direct-1",)
    assert "from 172.18.0.1" in f.title and services(f) == {"decode"}
    assert "/v1" in f.fix and "172.18.0.1" in f.fix
    assert [x.id for x in findings if x.severity == "error"] == []
