"""The doctor on the faults PD users of vLLM hit, from bundles a real vLLM 0.32.0 CPU prefill/decode pair over NIXL
printed behind the real router (tests/vllm/record_bundles.py; tests/unit/doctor/bundles/README.md says how).

Each test: the finding id, evidence lines from the hop that failed, the failed requests joined (the router's ids and
the clients' X-Request-IDs), a fix valid for vLLM (its flags and environment, never our JSON lines), and the exit code.
"""

from __future__ import annotations

from pathlib import Path

from doctor.checks import GENERIC
from doctor.checks import run_checks
from doctor.cli import build_parser, load_context, main
from tests.unit.doctor.helpers import by_id, diagnose

BUNDLES = Path(__file__).parent / "bundles"


def client_ids(bundle: str, prefix: str) -> set[str]:
    lines = (BUNDLES / bundle / "client.txt").read_text().splitlines()
    return {line.split()[0].removeprefix("request_id=") for line in lines
            if line.startswith(f"request_id={prefix}") and " ok, " not in line}


def exit_code(bundle: str) -> int:
    return main(["diagnose", "--logs", str(BUNDLES / bundle)], stdout=open("/dev/null", "w"))


def assert_vllm_fix(fix: str) -> None:
    assert '"level"' not in fix and "jq" not in fix, fix  # vLLM's lines are plain text


def test_engine_key_mismatch_is_named_with_both_sides():
    """Engines with VLLM_API_KEY ≠ the router's PD_INTERNAL_KEY: the router's 401 from prefill and prefill's own 401
    access lines; the clients got 502 (not 400) and nothing blames the client's base URL."""
    findings, _ = diagnose(BUNDLES / "vllm_key_mismatch")
    f = by_id(findings, "auth.internal_key_mismatch")
    assert findings[0] is f and f.severity == "error"
    assert {"router", "prefill", "client"} <= {e.service for e in f.evidence}
    assert any('"POST /v1/chat/completions HTTP/1.1" 401' in e.line for e in f.evidence if e.service == "prefill")
    assert client_ids("vllm_key_mismatch", "rec-key") <= set(f.request_ids)
    assert "VLLM_API_KEY" in f.fix and "PD_INTERNAL_KEY" in f.fix
    assert_vllm_fix(f.fix)
    assert not {"auth.not_from_router", "request.unexplained"} & {x.id for x in findings}
    assert exit_code("vllm_key_mismatch") == 1


def test_decode_max_len_is_read_from_vllms_start_up_lines():
    """Decode --max-model-len 512 vs prefill 2048: both engines' `non-default args` lines, the router's relay of
    decode's refusal, the two long requests (the short one passed)."""
    findings, ctx = diagnose(BUNDLES / "vllm_max_len")
    f = by_id(findings, "config.max_model_len_mismatch")
    assert findings[0] is f and f.severity == "error"
    assert "prefill 2048, decode 512" in f.title and "2 request(s) failed" in f.title
    decode_lines = [e.line for e in f.evidence if e.service == "decode"]
    assert any("'max_model_len': 512" in line for line in decode_lines)
    assert any("maximum context length is 512" in e.line for e in f.evidence if e.service == "router")
    assert set(f.request_ids) >= client_ids("vllm_max_len", "rec-len-long") and "rec-len-short" not in f.request_ids
    assert "--max-model-len 2048" in f.fix
    assert_vllm_fix(f.fix)
    assert not GENERIC & {x.id for x in findings}
    assert exit_code("vllm_max_len") == 1


def test_decode_restart_is_named_with_when_it_was_down():
    """Decode stopped under three streams and started again: one finding with both start-up banners, "was down from
    T1 to T2", the three cut streams joined; no "no decode backend is up" while decode serves again."""
    findings, ctx = diagnose(BUNDLES / "vllm_decode_restart")
    f = by_id(findings, "engine.restarted")
    assert findings[0] is f and f.severity == "error"
    assert "was down from 2026-12-02T03:16:46 to 2026-12-02T03:19:30" in f.title and "3 request(s) failed" in f.title
    banners = [e for e in f.evidence if e.service == "decode" and "version 0.32.0" in e.line]
    assert len(banners) == 2
    assert any("[shutdown]" in e.line for e in f.evidence if e.service == "decode")
    assert any('"router.decode_failed"' in e.line for e in f.evidence if e.service == "router")
    assert client_ids("vllm_decode_restart", "rec-restart-cut") <= set(f.request_ids)
    assert not {i for i in f.request_ids if "before" in i or "after" in i}
    assert "docker compose" not in f.fix and "vllm serve" in f.fix  # recorded from processes, not compose
    assert_vllm_fix(f.fix)
    assert not GENERIC & {x.id for x in findings} and "backend.decode_down" not in {x.id for x in findings}
    assert exit_code("vllm_decode_restart") == 1


def test_a_restart_is_named_for_a_request_it_cut_and_not_for_one_after_it():
    """--request-id narrows to one request: a stream the restart cut is told engine.restarted; a request served after
    decode was back is not (the restart is in the logs but is not that request's cause)."""
    ctx, _ = load_context(build_parser().parse_args(["diagnose", "--logs", str(BUNDLES / "vllm_decode_restart")]))
    cut, after = ctx.narrow("rec-restart-cut-0"), ctx.narrow("rec-restart-after-0")
    assert cut is not None and after is not None
    assert "rec-restart-cut-0" in by_id(run_checks(cut), "engine.restarted").request_ids
    assert "engine.restarted" not in {f.id for f in run_checks(after)}


def test_different_tokenizer_on_decode_is_named_although_every_answer_was_200():
    """Decode --tokenizer another BPE over the same weights: each 200 was continued from KV of other tokens. The
    doctor reads both tokenizers from the engines' start-up lines and names every request decode continued."""
    findings, ctx = diagnose(BUNDLES / "vllm_tokenizer")
    f = by_id(findings, "config.tokenizer_mismatch")
    assert findings[0] is f and f.severity == "error" and "3 answered from the wrong tokens" in f.title
    assert "other-tokenizer" in f.title
    assert any("other-tokenizer" in e.line for e in f.evidence if e.service == "decode")
    assert any("tokenizer=" in e.line for e in f.evidence if e.service == "prefill")
    assert len(ctx.timelines) == 3 and set(f.request_ids) >= set(ctx.timelines)
    assert "--tokenizer" in f.fix
    assert_vllm_fix(f.fix)
    assert "healthy" not in {x.id for x in findings}
    assert exit_code("vllm_tokenizer") == 1


def test_too_little_decode_kv_is_a_slowness_diagnosis_not_healthy():
    """Decode with KV for about two of twelve concurrent ~1,100-token requests: all 200, but TTFT's P99 breaks the SLO;
    the doctor names decode's KV waits from vLLM's stats line and its KV capacity line, and never says healthy."""
    findings, ctx = diagnose(BUNDLES / "vllm_small_kv")
    f = by_id(findings, "slow.decode_kv_capacity")
    assert [x.id for x in findings] == ["slow.decode_kv_capacity"] and f.severity == "warning"
    assert "P99 TTFT" in f.title and "> SLO 2 s" in f.title and "7 KV fetches not started" in f.title
    assert "KV holds 2,304 tokens, about 2 request(s)" in f.cause and "(prefill's: " in f.cause
    lines = [e.line for e in f.evidence if e.service == "decode"]
    assert any("KV cache size: 2,304 tokens" in line for line in lines)
    assert any("Waiting: 7 reqs, KV fetch: 7 waiting to start" in line for line in lines)
    assert set(f.request_ids) >= set(ctx.timelines) and len(ctx.timelines) == 13
    assert "VLLM_CPU_KVCACHE_SPACE" in f.fix and "./pd scale decode=N" in f.fix and "doctor advise" in f.fix
    assert_vllm_fix(f.fix)
    assert exit_code("vllm_small_kv") == 0  # slow is a warning: nothing failed


def test_a_dead_engine_core_is_named_with_vllms_own_lines():
    """Decode's EngineCore killed: vLLM's "engine core exited unexpectedly" and EngineDeadError lines, the three requests
    that failed after it (500 relayed, connect refused, 503) in one finding; no generic "decode is down" beside it."""
    findings, _ = diagnose(BUNDLES / "vllm_engine_dead")
    f = by_id(findings, "engine.fatal")
    assert [x.id for x in findings] == ["engine.fatal"] and f.severity == "error"
    assert "did not come back" in f.title and "3 request(s) failed" in f.title
    decode = [e.line for e in f.evidence if e.service == "decode"]
    assert any("engine core exited unexpectedly" in line for line in decode)
    assert any("EngineDeadError: EngineCore encountered an issue" in line for line in decode)
    assert client_ids("vllm_engine_dead", "rec-dead") <= set(f.request_ids) | {"rec-dead-2"}
    assert len(set(f.request_ids) - client_ids("vllm_engine_dead", "rec-dead")) == 3
    assert "EngineDeadError" in f.fix and "vllm serve" in f.fix
    assert_vllm_fix(f.fix)
    assert exit_code("vllm_engine_dead") == 1


def test_engines_without_tool_calling_are_named_and_the_client_is_not_blamed():
    """vLLM started without --enable-auto-tool-choice / --tool-call-parser: the two requests that carried tools (one
    streamed) were refused, plain chat and tool_choice "none" were served. One finding names the engine flags and the
    overlays' VLLM_TOOL_CALL_PARSER, with vLLM's own body and its 400 access line; what the client got names the field
    (tool_choice) and the deployment, not a bad request of its own."""
    findings, _ = diagnose(BUNDLES / "vllm_no_tool_parser")
    f = by_id(findings, "vllm.tool_calling_off")
    assert [x.id for x in findings] == ["vllm.tool_calling_off"] and f.severity == "error"
    assert "2 request(s) carrying tools were refused" in f.title
    assert client_ids("vllm_no_tool_parser", "rec-tools") == {"rec-tools-0", "rec-tools-1"} <= set(f.request_ids)
    assert any('"POST /v1/chat/completions HTTP/1.1" 400' in e.line for e in f.evidence if e.service == "prefill")
    assert any("tool choice requires --enable-auto-tool-choice" in e.line for e in f.evidence if e.service == "router")
    assert "--enable-auto-tool-choice --tool-call-parser" in f.fix and "VLLM_TOOL_CALL_PARSER" in f.fix
    assert_vllm_fix(f.fix)
    client = (BUNDLES / "vllm_no_tool_parser" / "client.txt").read_text()
    assert client.count("Unsupported parameter: 'tool_choice'") == 2 and "runs without tool calling" in client
    assert exit_code("vllm_no_tool_parser") == 1
