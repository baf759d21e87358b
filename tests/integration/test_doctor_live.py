"""The doctor against the shared running stack: healthy, verify, check, wrong key, dead proxy, OAuth configs.

Each cause is induced for real (official SDK clients against the router of a compose stack) and the
doctor must name it with evidence lines from the right service. Faults that change the stack itself
(unset key, KV port, buffer, network, models, decode failure) are in test_doctor_faults.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import anthropic
import openai
import pytest

from tests.integration.compose_stack import Stack, free_port
from tests.integration.doctor_helpers import (MODEL, PROMPT, diagnose, doctor, finding, new_id, services,
                                              wait_logged)

pytestmark = pytest.mark.integration


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty client home and no proxy/key variable from the machine running the tests."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "NO_PROXY",
                 "no_proxy", "OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN",
                 "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "home"
    path.mkdir()
    return path


def _stream(stack: Stack, rid: str, key: str | None = None) -> str:
    client = openai.OpenAI(base_url=stack.base_url, api_key=key or stack.api_key, max_retries=0, timeout=60)
    stream = client.chat.completions.create(model=MODEL, messages=PROMPT, stream=True, max_tokens=8,
                                            stream_options={"include_usage": True},
                                            extra_headers={"X-Request-ID": rid})
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_healthy_request_gives_no_finding(pd_stack: Stack, home):
    """One streamed PD request, diagnosed alone → only the healthy line, with its request id."""
    rid = new_id("healthy")
    _stream(pd_stack, rid)
    wait_logged(pd_stack, "router", "router.request_done", rid)
    code, doc = diagnose(pd_stack, str(home), "--request-id", rid)
    assert code == 0
    assert [f["id"] for f in doc["findings"]] == ["healthy"]
    assert doc["findings"][0]["title"] == "healthy: 1 requests went router → prefill → KV → decode"


def test_verify_proves_prefill_kv_decode(pd_stack: Stack, home, monkeypatch):
    """`verify` sends a streamed request and finds kv_producer (prefill) and kv_consumer (decode) lines for it."""
    monkeypatch.setenv("TAOTOKEN_API_KEY", pd_stack.api_key)
    code, doc = doctor("verify", "--project", pd_stack.project, "--router-url", pd_stack.router_url,
                       "--home", str(home), "--model", MODEL)
    assert code == 0, doc
    verified = finding(doc, "verify")
    assert "router → prefill → KV" in verified["title"]
    assert {"prefill", "decode"} <= services(verified)
    assert any("kv_producer.sent" in e["line"] for e in verified["evidence"])


def test_check_probes_a_healthy_stack(pd_stack: Stack, home, monkeypatch):
    """`check`: compose v2, containers healthy, key in the router, KV port reachable, end-to-end stream."""
    monkeypatch.setenv("TAOTOKEN_API_KEY", pd_stack.api_key)
    code, doc = doctor("check", "--project", pd_stack.project, "--router-url", pd_stack.router_url,
                       "--home", str(home))
    by_id = {f["id"]: f for f in doc["findings"]}
    assert code == 0, [f for f in doc["findings"] if f["severity"] != "ok"]
    for fid in ("docker.compose", "container.router", "container.decode", "key.router", "router.reachable",
                "health.decode", "kv.reachable", "verify"):
        assert by_id[fid]["severity"] == "ok", by_id[fid]


def test_wrong_key_is_an_unknown_key(pd_stack: Stack, home, tmp_path):
    """A key the router does not hold → auth.unknown_key with the router's auth.rejected line."""
    rid = new_id("wrongkey")
    with pytest.raises(openai.AuthenticationError) as err:
        _stream(pd_stack, rid, key="sk-not-the-router-key")
    client_log = tmp_path / "client.txt"
    client_log.write_text(f"openai.AuthenticationError: {err.value}\n")
    wait_logged(pd_stack, "router", "auth.rejected", rid)
    code, doc = diagnose(pd_stack, str(home), "--request-id", rid, "--client-log", str(client_log))
    assert code == 1
    f = finding(doc, "auth.unknown_key")
    assert rid in f["request_ids"]
    assert any(e["service"] == "router" and '"auth.rejected"' in e["line"] for e in f["evidence"])
    assert "sk-not-the-router-key" not in json.dumps(doc)


CLIENT = """
import openai, sys
client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0, timeout=10)
client.chat.completions.create(model="your-model-id", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
"""


# A client written like many tools: it asks for usage in the stream, then reads choices[0] of every chunk.
NAIVE_STREAM = """
import openai, sys
client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0, timeout=60)
stream = client.chat.completions.create(model="your-model-id", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                        stream=True, stream_options={"include_usage": True}, extra_headers={"X-Request-ID": sys.argv[3]})
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="")
"""


def test_client_indexing_the_usage_chunk_is_told_to_skip_empty_choices(pd_stack: Stack, home, tmp_path):
    """The article's `list index out of range`, for real: the usage chunk (choices: []) the client asked for crashes
    a client that indexes choices[0]; the doctor pairs its traceback with the router's usage_chunk line."""
    rid = new_id("choices")
    done = subprocess.run([sys.executable, "-c", NAIVE_STREAM, pd_stack.base_url, pd_stack.api_key, rid],
                          capture_output=True, text=True, timeout=120)  # bound: a hang guard, not a speed check
    assert done.returncode != 0 and "IndexError: list index out of range" in done.stderr
    client_log = tmp_path / "client.txt"
    client_log.write_text(done.stderr)
    wait_logged(pd_stack, "router", "router.usage_chunk", rid)
    code, doc = diagnose(pd_stack, str(home), "--request-id", rid, "--client-log", str(client_log))
    f = finding(doc, "choices.empty_choices_chunk")
    assert code == 0 and f["severity"] == "warning"  # a client-side fix: a warning, not a stack failure (--strict: 1)
    assert rid in f["request_ids"] and "if not chunk.choices: continue" in f["fix"]
    assert {"client", "router"} <= services(f)
    assert any('"router.usage_chunk"' in e["line"] and '"client_asked": true' in e["line"] for e in f["evidence"])
    assert "choices.usage_chunk_unasked" not in {x["id"] for x in doc["findings"]}  # the router sent it because asked


def test_proxy_variable_pointing_at_a_dead_port(pd_stack: Stack, home, tmp_path, monkeypatch):
    """HTTP_PROXY at a dead port, no NO_PROXY: the real SDK fails to connect; the doctor names the variable."""
    dead = f"http://127.0.0.1:{free_port()}"
    env = {"PATH": "/usr/bin:/bin", "HTTP_PROXY": dead, "HOME": str(home)}
    done = subprocess.run([sys.executable, "-c", CLIENT, pd_stack.base_url, pd_stack.api_key], env=env,
                          capture_output=True, text=True, timeout=60)  # bound: a hang guard, not a speed check
    assert done.returncode != 0 and "APIConnectionError" in done.stderr
    client_log = tmp_path / "client.txt"
    client_log.write_text(done.stderr)
    monkeypatch.setenv("HTTP_PROXY", dead)
    code, doc = diagnose(pd_stack, str(home), "--client-log", str(client_log), "--since", "30s")
    assert code == 1
    proxy = finding(doc, "proxy.env_without_no_proxy")
    assert proxy["severity"] == "error" and f"HTTP_PROXY={dead}" in proxy["cause"]
    assert "NO_PROXY=127.0.0.1" in proxy["fix"]
    assert "client" in services(finding(doc, "client.cannot_reach_router"))


def test_oauth_client_configs(pd_stack: Stack, home):
    """Claude Code on the router without a key (+ an OAuth login) and Codex on ChatGPT login / wire_api chat."""
    (home / ".claude").mkdir()
    (home / ".claude" / "settings.json").write_text(json.dumps({"env": {"ANTHROPIC_BASE_URL": pd_stack.router_url}}))
    (home / ".claude" / ".credentials.json").write_text('{"claudeAiOauth": {"accessToken": "sk-ant-oat01-x"}}')
    (home / ".codex").mkdir()
    (home / ".codex" / "auth.json").write_text(json.dumps({"tokens": {"access_token": "eyJ", "refresh_token": "r"}}))
    (home / ".codex" / "config.toml").write_text(
        f'model_provider = "pd"\n[model_providers.pd]\nname = "pd"\nbase_url = "{pd_stack.router_url}/v1"\n'
        'requires_openai_auth = true\nwire_api = "chat"\n')
    # What Claude Code does with only an OAuth login: it sends the OAuth token as a bearer.
    rid = new_id("oauth")
    client = anthropic.Anthropic(base_url=pd_stack.router_url, auth_token="sk-ant-oat01-expired", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.create(model=MODEL, max_tokens=8, messages=PROMPT, extra_headers={"X-Request-ID": rid})
    wait_logged(pd_stack, "router", "auth.rejected", rid)
    code, doc = diagnose(pd_stack, str(home), "--request-id", rid)
    assert code == 1
    claude = finding(doc, "oauth.claude_no_key")
    assert ".credentials.json" in claude["cause"] and pd_stack.router_url in claude["fix"]
    assert finding(doc, "oauth.codex_wire_api")["severity"] == "error"
    assert finding(doc, "oauth.codex_chatgpt_login")["severity"] == "error"
    assert rid in finding(doc, "auth.unknown_key")["request_ids"]
