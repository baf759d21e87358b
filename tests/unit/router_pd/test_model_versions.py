"""A rolling model update never pairs a prefill and a decode of different model versions (issue 14): the router
pairs engines whose GET /health fingerprints agree, and while no prefill runs a decode's version the decode serves
the request alone. Real engines; the "new version" is another seed of the dummy weights (another fingerprint)."""

from __future__ import annotations

import json

from stack.common import events
from tests.unit.router_pd.conftest import EngineProcess, wait_for_state, typed

CHAT = {"model": "your-model-id", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


async def test_prefills_of_another_version_are_never_paired_and_decode_serves_alone_meanwhile(tmp_path, pd, logs, request):
    """Prefill v1 and v2 beside decode v1: every prefill leg goes to v1. With v1 gone, decode v1 answers by itself
    (router.model_version_split), and prefill v2 never pushes KV it could not use."""
    old, new, decode = (EngineProcess(role, tmp_path) for role in ("prefill", "prefill", "decode"))
    for engine in (old, new, decode):
        request.addfinalizer(engine.stop)  # all three, also when an assertion fails: none may outlive the test
    config = json.loads(new.config_path.read_text())
    new.config_path.write_text(json.dumps({**config, "seed": 1}))  # the next model version
    for engine in (old, new, decode):
        engine.start()
    for engine in (old, new, decode):
        await engine.ready()
    client = await pd([old, new], [decode])
    fingerprints = client.monitor.fingerprints
    assert fingerprints[old.url] == fingerprints[decode.url] != fingerprints[new.url]
    assert client.health_snapshot()["pools"]["prefill"]["models"] == {fingerprints[old.url]: 1, fingerprints[new.url]: 1}
    for i in range(4):
        await client.complete(f"paired-{i}", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert len(old.events(events.ENGINE_REQUEST_RECEIVED)) == 4 and new.events(events.ENGINE_REQUEST_RECEIVED) == []

    old.stop()
    await wait_for_state(client, old.url, "down")
    answer = await client.complete("split", "chat", "/v1/chat/completions", *typed(dict(CHAT)))
    assert answer["choices"][0]["finish_reason"] in ("length", "stop")
    [split] = logs.events(events.ROUTER_VERSION_SPLIT)
    assert (split["decode"], split["fingerprint"], split["request_id"]) == (decode.url, fingerprints[decode.url], "split")
    assert new.events(events.ENGINE_REQUEST_RECEIVED) == [], "a prefill of another model version got a request"
