"""Real vLLM / NIXL / UCX / SGLang / Mooncake / NCCL failure strings (cited upstream lines) → their findings."""

from __future__ import annotations

from pathlib import Path

from doctor.checks import upstream
from doctor.signatures import SIGNATURES, match
from tests.unit.doctor.helpers import by_id, diagnose

FIXTURE = Path(__file__).parent / "bundles" / "upstream_signatures.log"


def _lines() -> list[tuple[str, str]]:
    """(source comment, log line) pairs of the fixture."""
    out, source = [], ""
    for line in FIXTURE.read_text().splitlines():
        if line.startswith("# "):
            source = line[2:]
        elif line.strip():
            out.append((source, line))
    return out


def test_at_least_15_failure_signatures_each_with_cause_fix_and_citation():
    """The issue's minimum: ≥ 15 failure strings, each with cause, fix and a source."""
    failures = [s for s in SIGNATURES if not (s.proof or s.fact)]
    assert len(failures) >= 15
    for s in SIGNATURES:
        assert s.cause and s.fix and s.source and "/" in s.source, s.id


def test_every_signature_has_one_cited_fixture_line_and_matches_only_itself():
    """Each fixture line (with its source comment) is recognised as exactly its signature; every signature is covered."""
    matched = []
    for source, line in _lines():
        sig = match(line.split("| ", 1)[1])
        assert sig is not None, line
        assert source, f"no citation for {line}"
        matched.append(sig.id)
    assert sorted(matched) == sorted(s.id for s in SIGNATURES)


def test_the_upstream_bundle_gives_one_finding_per_failure_and_no_false_healthy(tmp_path):
    """Diagnosing the fixture: every failure signature is a finding with its line as evidence; no healthy."""
    findings, ctx = diagnose(FIXTURE)
    ids = {f.id for f in findings}
    assert {s.id for s in SIGNATURES if not (s.proof or s.fact)} <= ids
    assert "healthy" not in ids
    f = by_id(findings, "nixl.block_size_mismatch")
    assert f.severity == "error" and "block size 16" in f.evidence[0].line and f.evidence[0].service == "decode"
    assert "vllm-project/vllm#42895" in f.cause
    assert len(upstream.proofs(ctx)) == 1


def test_json_log_event_message_is_matched_and_healthy_lines_are_not():
    """A `log` event carrying a vLLM string counts; our own JSON events never match a signature."""
    assert match("Got kv_transfer_params, but no KVConnector found. Disabling KVTransfer for this request.")
    assert match('{"event": "kv_producer.sent", "msg": "pushed 40 tokens of KV to decode:9100"}') is None
