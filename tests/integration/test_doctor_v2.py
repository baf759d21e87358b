"""Doctor v2 on a live stack: each class of the issue induced for real, the finding id, its evidence, nothing else.

One stack for the module. Faults that change the stack are undone before the next test: the killed
prefill is started again, and the decode overlay (max_model_len 64 + a published engine port, two
faults in one recreation to keep the time down) is removed at module end.
"""

from __future__ import annotations

import json
import math
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timezone

import anthropic
import docker
import openai
import pytest

from tests.integration.compose_stack import Stack, compose_run, start_stack, unique_project
from tests.integration.doctor_helpers import MODEL, PROMPT, diagnose, finding, new_id, services, wait_backends_up, wait_logged

pytestmark = pytest.mark.integration
SCENARIOS = "tests/integration/scenarios"


@pytest.fixture(scope="module")
def stack(app_image: None) -> Iterator[Stack]:
    started = start_stack(unique_project("pdt-doctor2"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty client home and no proxy/key variable from the machine running the tests."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "NO_PROXY",
                 "no_proxy", "OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN",
                 "OPENAI_API_KEY", "TAOTOKEN_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "home"
    path.mkdir()
    return str(path)


def problems(doc) -> set[str]:
    return {f["id"] for f in doc["findings"] if f["severity"] != "ok"}


def now_iso() -> str:
    """A window start after every earlier line: the daemon's `since` has whole seconds, so start at the next
    whole second and let the clock pass it (bounded: at most one second)."""
    start = math.ceil(time.time())
    while time.time() < start:
        time.sleep(0.05)
    return datetime.fromtimestamp(start, timezone.utc).isoformat()


def _post(url: str, body: dict, key: str | None, rid: str, timeout: float = 60) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", "X-Request-ID": rid}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_quiet_window_is_not_a_doctor_failure(stack: Stack, home):
    """`diagnose --since` a moment ago on an idle healthy stack → exit 0 and `quiet`, not exit 2."""
    code, doc = diagnose(stack, home, "--since", now_iso())
    assert code == 0, doc
    assert [f["id"] for f in doc["findings"]] == ["quiet"]


def test_wrong_model_name_from_an_anthropic_client(stack: Stack, home):
    """The anthropic SDK asks for claude-sonnet-4-5 (Claude Code's kind of name) → model.not_found + alias fix."""
    rid = new_id("claude")
    client = anthropic.Anthropic(base_url=stack.router_url, api_key=stack.api_key, max_retries=0, timeout=60)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=PROMPT,
                               extra_headers={"X-Request-ID": rid})
    wait_logged(stack, "router", "http.bad_request", rid)
    code, doc = diagnose(stack, home, "--request-id", rid)
    assert code == 1
    f = finding(doc, "model.not_found")
    assert "claude-sonnet-4-5" in f["cause"] and 'model_aliases = ["claude-*"]' in f["fix"]
    assert services(f) == {"router"} and rid in f["request_ids"]
    assert problems(doc) == {"model.not_found"}


def test_key_the_sdk_refuses_to_send_never_left_the_client(stack: Stack, home, tmp_path, monkeypatch):
    """A key with a trailing space: httpx refuses the header (`Illegal header value`), the router sees nothing →
    client.header_refused, not "cannot reach the router" and not a 401."""
    dirty = stack.api_key + " "
    monkeypatch.setenv("TAOTOKEN_API_KEY", dirty)
    since = now_iso()
    client = openai.OpenAI(base_url=stack.base_url, api_key=dirty, max_retries=0, timeout=30)
    with pytest.raises(openai.APIConnectionError) as err:
        client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4)
    text = "".join(traceback.format_exception(err.value))
    assert "Illegal header value" in text  # the SDK's real chain: h11 LocalProtocolError → APIConnectionError
    (tmp_path / "client.txt").write_text(text)
    code, doc = diagnose(stack, home, "--since", since, "--client-log", str(tmp_path / "client.txt"))
    assert code == 1
    f = finding(doc, "client.header_refused")
    assert services(f) == {"client"} and "TAOTOKEN_API_KEY" in f["cause"]
    assert problems(doc) == {"client.header_refused"}
    assert stack.api_key not in json.dumps(doc)


def test_auth_variable_conflict_is_connected_to_its_401(stack: Stack, home, monkeypatch):
    """ANTHROPIC_AUTH_TOKEN = the router key, ANTHROPIC_API_KEY = an old one: the anthropic SDK sends the API key
    (its documented precedence) → 401 → client.auth_conflict naming the variable sent, no separate 'old key'."""
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", stack.api_key)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-old-key-from-last-year")
    monkeypatch.setenv("TAOTOKEN_API_KEY", stack.api_key)
    rid = new_id("conflict")
    client = anthropic.Anthropic(base_url=stack.router_url, max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.create(model=MODEL, max_tokens=8, messages=PROMPT, extra_headers={"X-Request-ID": rid})
    wait_logged(stack, "router", "auth.rejected", rid)
    code, doc = diagnose(stack, home, "--request-id", rid)
    assert code == 1
    f = finding(doc, "client.auth_conflict")
    assert f["severity"] == "error" and rid in f["request_ids"]
    assert "Only ANTHROPIC_AUTH_TOKEN equals" in f["cause"] and f["fix"].startswith("unset ANTHROPIC_API_KEY")
    assert services(f) == {"router"}
    assert problems(doc) == {"client.auth_conflict"}


def _router_saw_down(stack: Stack, role: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s  # the router's health round (bounded: a hang guard)
    while time.monotonic() < deadline:
        # Marked down by a probe, or gone from the pool first: a stopped container no longer resolves under the
        # discover name (stack/router/replicas.py), whichever the router saw first.
        if any(e.get("role") == role and (e.get("event") == "backend.health" and e.get("state") == "down"
                                          or e.get("event") == "discovery.left") for e in stack.events("router")):
            return
        time.sleep(0.5)
    raise AssertionError(f"the router never marked {role} down within {timeout_s} s")


def test_killed_prefill_is_not_healthy(stack: Stack, home):
    """prefill SIGKILLed (as an OOM kill would): requests get 503 no_prefill_backend → backend.prefill_down,
    naming the exited container, with the router's lines; then prefill is started again."""
    since = now_iso()
    stack.container("prefill").kill()
    try:
        _router_saw_down(stack, "prefill")
        rids = [new_id("noprefill") for _ in range(2)]
        for rid in rids:
            status, _ = _post(f"{stack.base_url}/chat/completions", {"model": MODEL, "messages": PROMPT, "max_tokens": 4},
                              stack.api_key, rid)
            assert status == 503
        wait_logged(stack, "router", "router.request_done", rids[-1])
        code, doc = diagnose(stack, home, "--since", since)
    finally:
        compose_run(stack.files, stack.env_file, ["up", "-d", "--wait", "--no-deps", "prefill"])
        wait_backends_up(stack)
    assert code == 1
    f = finding(doc, "backend.prefill_down")
    assert set(rids) <= set(f["request_ids"]) and "router" in services(f)
    assert "exit code 137" in f["cause"]
    assert "healthy" not in {x["id"] for x in doc["findings"]}
    assert problems(doc) == {"backend.prefill_down"}


@pytest.fixture(scope="module")
def decode_v2(stack: Stack) -> Iterator[str]:
    """decode recreated with max_model_len 64 and its engine port published; → decode's URL on the host."""
    overlay = f"{SCENARIOS}/doctor_decode_v2.yaml"
    compose_run((*stack.files, overlay), stack.env_file, ["up", "-d", "--wait", "--no-deps", "decode"])
    wait_backends_up(stack)
    try:
        ports = docker.from_env().containers.get(stack.container("decode").id).attrs["NetworkSettings"]["Ports"]
        yield f"http://127.0.0.1:{ports['8000/tcp'][0]['HostPort']}"
    finally:
        compose_run(stack.files, stack.env_file, ["up", "-d", "--wait", "--no-deps", "decode"])
        wait_backends_up(stack)


def test_pd_config_mismatch_names_key_values_and_files(stack: Stack, home, decode_v2):
    """decode max_model_len 64 < prefill's 512: prefill serves, decode refuses (WARNING) → config.max_model_len_mismatch
    with both values and both files, evidence from router, prefill and decode; no choices.decode_failed."""
    rid = new_id("maxlen")
    status, _ = _post(f"{stack.base_url}/chat/completions", {"model": MODEL, "messages": PROMPT, "max_tokens": 60},
                      stack.api_key, rid)
    assert status >= 400
    wait_logged(stack, "router", "router.request_done", rid)
    code, doc = diagnose(stack, home, "--request-id", rid)
    assert code == 1
    f = finding(doc, "config.max_model_len_mismatch")
    assert "decode 64" in f["title"] and "doctor_decode_v2/config.json" in f["title"]
    assert "prefill/config.json" in f["title"]
    assert services(f) == {"router", "prefill", "decode"}
    assert problems(doc) == {"config.max_model_len_mismatch"}


def test_published_engine_port_is_a_router_bypass(stack: Stack, home, decode_v2):
    """A client calls decode's published port directly: decode refuses it (401, it answers only the router's
    internal key) → engine.bypass_refused naming the caller's address and the published port."""
    rid = new_id("bypass")
    status, body = _post(f"{decode_v2}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4}, None, rid)
    assert status == 401 and body["error"]["code"] == "internal_key_required", body
    wait_logged(stack, "decode", "internal_auth.rejected", rid)
    code, doc = diagnose(stack, home, "--request-id", rid, "--strict")
    assert code == 1  # a warning: the stack protected itself, the client is misconfigured
    f = finding(doc, "engine.bypass_refused")
    assert f["severity"] == "warning" and f["request_ids"] == [rid] and services(f) == {"decode"}
    assert "decode publishes 127.0.0.1:" in f["cause"] and "refused (401) from " in f["title"]
    # The overlay's other fault is real and still there: the mounted configs disagree on max_model_len (a
    # warning, since this request did not hit it). Nothing else may be reported.
    assert problems(doc) == {"engine.bypass_refused", "config.pd_mismatch"}
    mismatch = finding(doc, "config.pd_mismatch")
    assert mismatch["severity"] == "warning" and "max_model_len: prefill None, decode 64" in mismatch["cause"]


def test_explain_a_live_request(stack: Stack, tmp_path):
    """`explain` on a real streamed PD request: every hop with a duration in the text, and the PNG written."""
    import io

    from doctor.cli import main

    rid = new_id("explain")
    client = openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0, timeout=60)
    for _ in client.chat.completions.create(model=MODEL, messages=PROMPT, stream=True, max_tokens=8,
                                            extra_headers={"X-Request-ID": rid}):
        pass
    wait_logged(stack, "router", "router.request_done", rid)
    wait_logged(stack, "decode", "engine.request_finished", rid)
    out, png = io.StringIO(), tmp_path / "explain.png"
    code = main(["explain", rid, "--project", stack.project, "--out", str(png)], stdout=out)
    text = out.getvalue()
    assert code == 0, text
    for hop in ("router queue", "prefill compute", "KV push", "decode first token", "stream", "total"):
        assert f"  {hop} " in text, text
    assert png.read_bytes()[:4] == b"\x89PNG"
