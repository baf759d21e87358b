"""Diagnoses from the client side: proxy variables, base URLs, Claude Code and Codex configs (tmp home)."""

from __future__ import annotations

import json

import pytest

from tests.unit.doctor.helpers import by_id, diagnose

SECRET = "sk-pd-0123456789abcdef"


def write(home, rel: str, text: str) -> None:
    path = home / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def ids(findings) -> set[str]:
    return {f.id for f in findings}


def no_secret(findings) -> None:
    for f in findings:
        assert SECRET not in f.title + f.cause + f.fix


def test_proxy_without_no_proxy_with_a_failing_client(bundles, tmp_path):
    """HTTPS_PROXY set, NO_PROXY missing, client connection error → an error naming the variables."""
    env = {"HTTPS_PROXY": "http://user:pw@127.0.0.1:7897", "https_proxy": "http://127.0.0.1:7899"}
    findings, _ = diagnose(bundles / "healthy_v1.log", client=(bundles / "client_codex_disconnect.txt",), home=tmp_path, environ=env)
    f = by_id(findings, "proxy.env_without_no_proxy")
    assert f.severity == "error"
    assert "HTTPS_PROXY=http://127.0.0.1:7897" in f.cause and "pw" not in f.cause
    assert "HTTPS_PROXY≠https_proxy" in f.cause
    assert f.fix.startswith("export NO_PROXY=localhost,127.0.0.1,::1")
    assert "client.cannot_reach_router" in ids(findings)


@pytest.mark.parametrize("no_proxy", ["localhost,127.0.0.1", "*", ".local, localhost"])
def test_no_proxy_covering_the_router_is_fine(bundles, tmp_path, no_proxy):
    """NO_PROXY with the router host (or *) → no proxy finding."""
    env = {"HTTP_PROXY": "http://127.0.0.1:3128", "NO_PROXY": no_proxy}
    findings, _ = diagnose(bundles / "healthy_v1.log", home=tmp_path, environ=env)
    assert ids(findings) == {"healthy"}


def test_proxy_in_claude_settings_env_block(bundles, tmp_path):
    """A proxy in ~/.claude/settings.json's env block counts too (a warning without a client error)."""
    write(tmp_path, ".claude/settings.json", json.dumps({"env": {"HTTPS_PROXY": "http://10.0.0.1:8888",
                                                                  "ANTHROPIC_BASE_URL": "http://localhost:8080",
                                                                  "ANTHROPIC_AUTH_TOKEN": SECRET}}))
    findings, _ = diagnose(bundles / "healthy_v1.log", home=tmp_path)
    f = by_id(findings, "proxy.env_without_no_proxy")
    assert f.severity == "warning" and "settings.json" in f.title
    no_secret(findings)


@pytest.mark.parametrize("env,fid", [
    ({"OPENAI_BASE_URL": "http://localhost:8000/v1"}, "client.base_url_engine"),
    ({"OPENAI_BASE_URL": "http://decode:8000/v1"}, "client.base_url_engine"),
    ({"OPENAI_BASE_URL": "http://localhost:8080"}, "client.base_url_no_v1"),
    ({"ANTHROPIC_BASE_URL": "http://localhost:8080/v1", "ANTHROPIC_AUTH_TOKEN": SECRET}, "client.base_url_extra_v1"),
])
def test_base_url_mistakes(bundles, tmp_path, env, fid):
    """Engine port instead of the router, /v1 missing (OpenAI) or present (Claude Code) → named, with the right URL."""
    findings, _ = diagnose(bundles / "healthy_v1.log", home=tmp_path, environ=env)
    f = by_id(findings, fid)
    assert "http://localhost:8080" in f.fix
    no_secret(findings)


def test_right_base_urls_are_fine(bundles, tmp_path):
    """OPENAI_BASE_URL with /v1 and ANTHROPIC_BASE_URL without it, both on the router → healthy."""
    env = {"OPENAI_BASE_URL": "http://127.0.0.1:8080/v1", "ANTHROPIC_BASE_URL": "http://localhost:8080",
           "ANTHROPIC_AUTH_TOKEN": SECRET}
    findings, _ = diagnose(bundles / "healthy_v1.log", home=tmp_path, environ=env)
    assert ids(findings) == {"healthy"}


def test_claude_pointing_at_router_without_key_uses_oauth(bundles, tmp_path):
    """settings.json base URL = router, no token/key, .credentials.json present → OAuth against the router."""
    write(tmp_path, ".claude/settings.json", json.dumps({"env": {"ANTHROPIC_BASE_URL": "http://localhost:8080"}}))
    write(tmp_path, ".claude/.credentials.json", "{}")
    findings, _ = diagnose(bundles / "healthy_v1.log", home=tmp_path)
    f = by_id(findings, "oauth.claude_no_key")
    assert ".credentials.json" in f.cause
    assert '"apiKeyHelper": "printenv TAOTOKEN_API_KEY"' in f.fix and "http://localhost:8080" in f.fix


def test_claude_both_credentials_set(bundles, tmp_path):
    """Both set, different keys, nothing failed → client.auth_conflict warning naming who sends which; values never shown."""
    env = {"ANTHROPIC_AUTH_TOKEN": SECRET, "ANTHROPIC_API_KEY": SECRET + "x"}
    findings, _ = diagnose(bundles / "healthy_v1.log", home=tmp_path, environ=env)
    f = by_id(findings, "client.auth_conflict")
    assert f.severity == "warning"
    assert "anthropic SDK sends ANTHROPIC_API_KEY" in f.cause and "Claude Code sends ANTHROPIC_AUTH_TOKEN" in f.cause
    assert "oauth.claude_auth_conflict" not in {x.id for x in findings}
    no_secret(findings)


def test_claude_both_credentials_same_key_is_only_a_warning(bundles, tmp_path):
    """Both set to the same key: a warning that one of them will drift (oauth.claude_auth_conflict)."""
    env = {"ANTHROPIC_AUTH_TOKEN": SECRET, "ANTHROPIC_API_KEY": SECRET}
    findings, _ = diagnose(bundles / "healthy_v1.log", home=tmp_path, environ=env)
    assert by_id(findings, "oauth.claude_auth_conflict").severity == "warning"


def test_codex_chatgpt_login_without_router_provider(bundles, tmp_path):
    """~/.codex/auth.json in ChatGPT mode and no provider → requests go to chatgpt.com; the config to write."""
    write(tmp_path, ".codex/auth.json", json.dumps({"tokens": {"access_token": "eyJ", "refresh_token": "r"}}))
    findings, _ = diagnose(bundles / "healthy_v1.log", home=tmp_path)
    f = by_id(findings, "oauth.codex_chatgpt_login")
    assert 'base_url = "http://localhost:8080/v1"' in f.fix and 'wire_api = "responses"' in f.fix
    assert 'env_key = "TAOTOKEN_API_KEY"' in f.fix


def test_codex_provider_mistakes(bundles, tmp_path):
    """base_url without /v1, env_key unset, wire_api = chat → three findings."""
    write(tmp_path, ".codex/config.toml", 'model_provider = "pd"\n[model_providers.pd]\nname = "pd"\n'
          'base_url = "http://localhost:8080"\nenv_key = "PD_KEY"\nwire_api = "chat"\n')
    findings, _ = diagnose(bundles / "healthy_v1.log", home=tmp_path)
    assert {"oauth.codex_base_url", "oauth.codex_env_key_unset", "oauth.codex_wire_api"} <= ids(findings)
    assert "PD_KEY" in by_id(findings, "oauth.codex_env_key_unset").title


def test_codex_provider_right(bundles, tmp_path):
    """A provider on the router with /v1, a set env_key and wire_api responses → healthy."""
    write(tmp_path, ".codex/config.toml", 'model_provider = "pd"\n[model_providers.pd]\nname = "pd"\n'
          'base_url = "http://localhost:8080/v1"\nenv_key = "PD_KEY"\nwire_api = "responses"\n')
    findings, _ = diagnose(bundles / "healthy_v1.log", home=tmp_path, environ={"PD_KEY": SECRET, "CODEX_HOME": "x"})
    assert ids(findings) == {"healthy"}


def test_dirty_key_variable(bundles, tmp_path):
    """A key variable with a trailing newline or quotes is flagged by name only."""
    findings, _ = diagnose(bundles / "healthy_v1.log", home=tmp_path, environ={"OPENAI_API_KEY": f'"{SECRET}"\n'})
    f = by_id(findings, "auth.key_not_clean")
    assert "OPENAI_API_KEY" in f.title
    no_secret(findings)
