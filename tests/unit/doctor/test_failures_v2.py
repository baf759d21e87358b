"""Doctor v2: no false "healthy", a backend gone, wrong model, engine bypass, config mismatch, the client's view."""

from __future__ import annotations

from tests.unit.doctor.helpers import by_id, diagnose


def services(finding) -> set[str]:
    return {e.service for e in finding.evidence}


def ids(findings) -> set[str]:
    return {f.id for f in findings}


def test_killed_prefill_is_named_not_healthy(bundles):
    """503 no_prefill_backend + the router's backend.health down → backend.prefill_down; never healthy."""
    findings, _ = diagnose(bundles / "prefill_killed.log")
    f = by_id(findings, "backend.prefill_down")
    assert f.severity == "error" and "2 request(s) got 503" in f.title
    assert "docker compose up -d prefill" in f.fix
    assert services(f) >= {"router"} and len(f.request_ids) == 2
    assert ids(findings) == {"backend.prefill_down"}


def test_claude_model_name_gets_the_alias_fix(bundles):
    """404 model_not_found for claude-* → model.not_found with model_aliases = ["claude-*"] in router/settings.toml."""
    findings, _ = diagnose(bundles / "model_claude.log")
    f = by_id(findings, "model.not_found")
    assert "claude-sonnet-4-5" in f.cause and "'your-model-id'" in f.cause
    assert 'model_aliases = ["claude-*"]' in f.fix and "router/settings.toml" in f.fix
    assert ids(findings) == {"model.not_found"}


def test_a_base_url_with_v1_twice_or_without_it_is_named_with_its_fix(bundles):
    """404s for /v1/v1/messages and /v1/api/hello (ANTHROPIC_BASE_URL ending in /v1) and /chat/completions
    (OPENAI_BASE_URL without /v1) are errors naming the variable to fix; a route the router lacks is a warning; none is
    left unexplained."""
    findings, _ = diagnose(bundles / "base_url.log")
    twice = by_id(findings, "route.base_url_v1_twice")
    assert twice.severity == "error" and "POST /v1/v1/messages ×2" in twice.title and len(twice.request_ids) == 3
    assert "HEAD /v1/api/hello ×1" in twice.title  # Claude Code's probe under the same base URL
    assert "ANTHROPIC_BASE_URL=http://<router>:8080 (no /v1)" in twice.fix
    short = by_id(findings, "route.base_url_no_v1")
    assert short.severity == "error" and "POST /chat/completions ×1" in short.title
    assert "OPENAI_BASE_URL=http://<router>:8080/v1" in short.fix
    other = by_id(findings, "route.not_found")
    assert other.severity == "warning" and "GET /v1/embeddings ×1" in other.title and "/v1/messages" in other.cause
    assert ids(findings) == {"route.base_url_v1_twice", "route.base_url_no_v1", "route.not_found"}


def test_requests_straight_to_an_engine_are_a_bypass(bundles):
    """Engine lines without any router line and no PD leg → engine.bypassed_router, evidence from decode."""
    findings, _ = diagnose(bundles / "engine_direct.log")
    f = by_id(findings, "engine.bypassed_router")
    assert f.request_ids == ("direct-0001", "direct-0002")
    assert services(f) == {"decode"}
    assert ids(findings) == {"engine.bypassed_router"}


def test_decode_max_model_len_names_key_values_files_and_warning_line(bundles):
    """Prefill ok then decode refuses (WARNING) → config.max_model_len_mismatch: key, both values, both files."""
    findings, _ = diagnose(bundles / "max_model_len.log")
    f = by_id(findings, "config.max_model_len_mismatch")
    assert "decode 64 (decode/config.json)" in f.title and "prefill/config.json" in f.title
    assert "not set" in f.title  # the shipped prefill/config.json leaves it to the model
    assert services(f) == {"router", "prefill", "decode"}
    assert [e.service for e in f.evidence] == sorted((e.service for e in f.evidence),
                                                     key=["client", "router", "prefill", "decode"].index)
    assert ids(findings) == {"config.max_model_len_mismatch"}


def test_max_tokens_past_a_shared_window_is_the_clients_not_a_mismatch(bundles):
    """The same refusal when both windows are 512 (the router answered the client's 400): the request asked too much,
    long_prompt.context_exceeded; no config mismatch, no decode failure blamed on the engines."""
    findings, _ = diagnose(bundles / "max_tokens_past_window.log")
    f = by_id(findings, "long_prompt.context_exceeded")
    assert "512-token window" in f.cause and "540 tokens" in f.cause
    assert ids(findings) == {"long_prompt.context_exceeded"}


def test_a_failure_nobody_knows_is_unexplained_not_healthy(bundles):
    """A 500 no diagnosis recognises → request.unexplained with its status and lines; no healthy."""
    findings, _ = diagnose(bundles / "unexplained.log")
    f = by_id(findings, "request.unexplained")
    assert f.severity == "error" and "500 ×1" in f.title
    assert any("ZeroDivisionError" in e.line for e in f.evidence)
    assert "healthy" not in ids(findings)


def test_healthy_says_how_many_did_not_complete(bundles):
    """Healthy still counts the requests that completed (and only then)."""
    findings, _ = diagnose(bundles / "healthy_v1.log")
    assert findings[0].title == "healthy: 5 requests went router → prefill → KV → decode"


def test_header_refused_never_left_the_client(bundles, tmp_path):
    """`Illegal header value` + `Connection error.` → client.header_refused; not 'cannot reach', not a 401."""
    env = {"TAOTOKEN_API_KEY": "sk-pd-3f9c1a2b "}
    findings, _ = diagnose(bundles / "healthy_v1.log", client=(bundles / "client_header_refused.txt",),
                           home=tmp_path, environ=env)
    f = by_id(findings, "client.header_refused")
    assert "never left the client" in f.title and "TAOTOKEN_API_KEY" in f.cause
    assert services(f) == {"client"}
    assert ids(findings) == {"client.header_refused"}
    assert "sk-pd-3f9c1a2b" not in f.cause + f.fix + f.title


def test_auth_conflict_explains_the_401_instead_of_old_key(bundles, tmp_path):
    """Both Anthropic variables, differing, and 401 unknown key → client.auth_conflict (error) names the SDK's pick."""
    env = {"ANTHROPIC_AUTH_TOKEN": "sk-router", "ANTHROPIC_API_KEY": "sk-old", "TAOTOKEN_API_KEY": "sk-router"}
    findings, _ = diagnose(bundles / "auth_mixed.log", home=tmp_path, environ=env)
    f = by_id(findings, "client.auth_conflict")
    assert f.severity == "error" and "Only ANTHROPIC_AUTH_TOKEN equals $TAOTOKEN_API_KEY" in f.cause
    assert f.fix == "unset ANTHROPIC_API_KEY (keep ANTHROPIC_AUTH_TOKEN)"
    assert "auth.unknown_key" not in ids(findings)
    assert len(f.request_ids) == 2


def test_base_url_on_a_published_engine_port_is_an_engine_url(bundles, tmp_path):
    """Live facts: decode publishes host port 18001 → OPENAI_BASE_URL on :18001 is client.base_url_engine."""
    from doctor import environment
    from doctor.checks import run_checks
    from doctor.findings import Context
    from doctor.sources import load_files

    loaded = load_files([str(bundles / "healthy_v1.log")])
    env = environment.snapshot(tmp_path, environ={"OPENAI_BASE_URL": "http://localhost:18001/v1"})
    docker = {"project": "pd", "services": {"decode": "running", "router": "running"},
              "published": {"decode": ["127.0.0.1:18001->8000/tcp"]}}
    findings = run_checks(Context.build(loaded.records, env, loaded.stats, docker))
    assert by_id(findings, "client.base_url_engine").severity == "error"


def test_keys_in_client_output_are_redacted(bundles, tmp_path):
    """The refused header carries the key: evidence shows `Bearer <redacted>`, never the key."""
    findings, _ = diagnose(bundles / "healthy_v1.log", client=(bundles / "client_header_refused.txt",))
    f = by_id(findings, "client.header_refused")
    assert any("Bearer <redacted>" in e.line for e in f.evidence)
    assert "sk-pd-3f9c1a2b" not in repr(findings)
