"""The doctor against a stack broken on purpose: every fault really induced, the doctor names the cause.

One stack of its own (the shared one must stay healthy); each test recreates the service it breaks
with an overlay from tests/integration/scenarios/*.yaml (or cuts a network), sends real
requests, runs `python -m doctor diagnose` on the project's container logs, and restores the service.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import docker
import openai
import pytest

from tests.integration.compose_stack import Stack, compose_run, start_stack, unique_project
from tests.integration.doctor_helpers import (MODEL, PROMPT, diagnose, finding, new_id, services, wait_backends_up,
                                              wait_logged)

pytestmark = pytest.mark.integration
SCENARIOS = "tests/integration/scenarios"


@pytest.fixture(scope="module")
def stack(app_image: None) -> Iterator[Stack]:
    """A disaggregated stack (dummy:tiny) that these tests may break and repair."""
    started = start_stack(unique_project("pdt-doctor"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def home(tmp_path):
    path = tmp_path / "home"
    path.mkdir()
    return str(path)


@contextmanager
def scenario(stack: Stack, name: str, *services_: str) -> Iterator[None]:
    """Recreate `services_` with the overlay `name`, then put them back as compose.yaml has them."""
    overlay = f"{SCENARIOS}/{name}.yaml"
    compose_run((*stack.files, overlay), stack.env_file, ["up", "-d", "--wait", "--no-deps", *services_])
    wait_backends_up(stack)
    try:
        yield
    finally:
        compose_run(stack.files, stack.env_file, ["up", "-d", "--wait", "--no-deps", *services_])
        wait_backends_up(stack)


def _chat(stack: Stack, rid: str, content: str = PROMPT[0]["content"], max_tokens: int = 8) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0, timeout=60)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                            stream=True, max_tokens=max_tokens, extra_headers={"X-Request-ID": rid})
    for _ in stream:
        pass


def _chat_fails(stack: Stack, rid: str, **kw) -> None:
    with pytest.raises(openai.APIError):
        _chat(stack, rid, **kw)


def test_unset_key_variable(stack: Stack, home):
    """The router started with TAOTOKEN_API_KEY empty → auth.router_key_missing from the router's own lines."""
    rid = new_id("nokey")
    with scenario(stack, "doctor_no_key", "router"):
        with pytest.raises(openai.AuthenticationError):
            _chat(stack, rid)
        wait_logged(stack, "router", "auth.rejected", rid)
        code, doc = diagnose(stack, home, "--since", "2m")
    assert code == 1
    f = finding(doc, "auth.router_key_missing")
    assert "TAOTOKEN_API_KEY" in f["title"] and "docker compose exec router" in f["fix"]
    assert services(f) == {"router"}
    assert any('"auth.key_missing"' in e["line"] for e in f["evidence"])
    assert stack.api_key not in json.dumps(doc)


def test_decode_fails_after_a_successful_prefill(stack: Stack, home, tmp_path):
    """decode refuses (KV pool of 32 tokens) after prefill pushed the KV → choices.decode_failed, router + decode.
    The prompt (~15 tokens) fits the pool, so decode takes the KV; prompt + max_tokens cannot."""
    rid = new_id("decodefail")
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 24}
    request = urllib.request.Request(f"{stack.base_url}/chat/completions", data=json.dumps(body).encode(), headers={
        "Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json", "X-Request-ID": rid})
    with scenario(stack, "doctor_decode_fail", "decode"):
        # The article's client: read choices from whatever came back.
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=60)
        answer = json.loads(err.value.read())
        with pytest.raises(KeyError) as key_error:
            answer["choices"]
        (tmp_path / "client.txt").write_text(f"KeyError: {key_error.value}\n")
        wait_logged(stack, "router", "router.request_done", rid)
        code, doc = diagnose(stack, home, "--request-id", rid, "--client-log", str(tmp_path / "client.txt"))
    assert code == 1
    f = finding(doc, "choices.decode_failed")
    assert rid in f["request_ids"]
    assert any('"router.prefill_done"' in e["line"] for e in f["evidence"])
    assert {"client", "router"} <= services(f)


def test_kv_port_changed_in_decode_config_only_is_learned_by_the_router(stack: Stack):
    """decode/config.json says kv_port 9200 and nothing else changes: the router learns the port from decode's
    /health, so prefill pushes to decode:9200 and the request streams (no second place to edit)."""
    rid = new_id("kvmoved")
    with scenario(stack, "kv_port_moved", "decode"):
        _chat(stack, rid)
        sent = stack.wait_for_event("prefill", "kv_producer.sent", rid)
    assert sent and sent[0]["decode_kv_addr"].endswith(":9200")


def test_kv_port_mismatch(stack: Stack, home):
    """The router is told KV_TRANSFER_PORT=9100 while decode listens on 9200: the router pushes to decode's own
    port (the request works) and the doctor warns kv.port_mismatch naming both ports and where each came from."""
    rid = new_id("kvport")
    with scenario(stack, "doctor_kv_port", "decode", "router"):
        _chat(stack, rid)
        sent = stack.wait_for_event("prefill", "kv_producer.sent", rid)
        code, doc = diagnose(stack, home, "--since", "2m", "--strict")
    assert sent and sent[0]["decode_kv_addr"].endswith(":9200")
    assert code == 1  # a warning: exit 1 only under --strict
    f = finding(doc, "kv.port_mismatch")
    assert f["severity"] == "warning"
    assert "9100" in f["title"] and "9200" in f["title"] and "KV_TRANSFER_PORT" in f["title"]
    assert {"router", "decode"} <= services(f)


def test_tiny_kv_buffer_with_a_long_prompt(stack: Stack, home):
    """kv_buffer_size 100000 (~195 tokens of dummy:tiny's KV): a short prompt passes, a ~300-token prompt is refused
    → kv.buffer_too_small."""
    short, long_ = new_id("kvshort"), new_id("kvlong")
    with scenario(stack, "doctor_kv_buffer", "decode"):
        _chat(stack, short, content="hi")
        _chat_fails(stack, long_, content="prefill and decode " * 100)
        wait_logged(stack, "router", "router.request_done", long_)
        code, doc = diagnose(stack, home, "--since", "2m")
    assert code == 1
    f = finding(doc, "kv.buffer_too_small")
    assert "100000 bytes" in f["title"]
    assert long_ in f["request_ids"] and short not in f["request_ids"]
    assert "Failed prompts:" in f["cause"] and "largest that went through" in f["cause"]
    assert "decode" in services(f)


def test_mismatched_models(stack: Stack, home):
    """prefill on seed 1, decode on seed 0: the router never pairs them (their /health fingerprints differ), so decode
    answers alone (router.model_version_split) and no KV crosses versions → kv.model_mismatch naming the split."""
    rid = new_id("model")
    with scenario(stack, "doctor_model", "prefill"):
        _chat(stack, rid)
        wait_logged(stack, "router", "router.model_version_split", rid)
        code, doc = diagnose(stack, home, "--since", "2m")
    assert code == 1
    f = finding(doc, "kv.model_mismatch")
    assert {"prefill", "decode"} & services(f) and "router" in services(f)
    assert "ran on decode alone" in f["cause"]
    assert not stack.wait_for_event("decode", "kv_consumer.fingerprint_mismatch", timeout_s=0)


def test_router_not_running(stack: Stack, home, tmp_path):
    """The router stopped: the SDK cannot connect; the doctor sees the router container is not running."""
    compose_run(stack.files, stack.env_file, ["stop", "router"])
    try:
        with pytest.raises(openai.APIConnectionError) as err:
            _chat(stack, new_id("down"))
        (tmp_path / "client.txt").write_text(f"openai.APIConnectionError: {err.value}\n")
        code, doc = diagnose(stack, home, "--since", "1m", "--client-log", str(tmp_path / "client.txt"))
    finally:
        compose_run(stack.files, stack.env_file, ["up", "-d", "--wait", "--no-deps", "router"])
        wait_backends_up(stack)
    assert code == 1
    f = finding(doc, "router.not_running")
    assert stack.project in f["title"] and "client" in services(f)


def test_cut_kv_network(stack: Stack, home):
    """decode disconnected from the KV network → prefill cannot reach decode's KV port: kv.unreachable."""
    rid = new_id("kvcut")
    network = docker.from_env().networks.get(stack.network("kv"))
    decode = stack.container("decode")
    network.disconnect(decode)
    try:
        _chat_fails(stack, rid)
        wait_logged(stack, "prefill", "kv_producer.connect_failed", rid)
        code, doc = diagnose(stack, home, "--since", "2m")
    finally:
        network.connect(decode, aliases=["decode"])
    assert code == 1
    f = finding(doc, "kv.unreachable")
    assert "prefill" in services(f) and rid in f["request_ids"]
    assert "kv.port_mismatch" not in {x["id"] for x in doc["findings"]}
