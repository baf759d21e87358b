"""vLLM's /tokenize and /detokenize through the router, GET /v1/models/{id}, prompt_tokens_details, lone surrogates."""

from __future__ import annotations

import json

import openai
import pytest

from aiohttp.test_utils import TestClient, TestServer

from stack.router import config as router_config
from stack.router.app import create_app
from tests.unit.gateway.backend import BACKEND_MODEL
from tests.unit.gateway.conftest import ALL_FLAGS, KEY, KEY_ENV, MODEL, settings_text


@pytest.fixture
async def gw(gateway):
    return await gateway(capabilities=ALL_FLAGS)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


async def test_tokenize_and_detokenize_are_forwarded_and_authenticated(gw) -> None:
    response = await gw.router.post("/tokenize", json={"model": MODEL, "prompt": "hello"}, headers=auth())
    body = await response.json()
    assert response.status == 200 and body["count"] == 36 and body["max_model_len"] == 4096
    assert gw.backend.tokenized[-1] == {"model": BACKEND_MODEL, "prompt": "hello"}  # the backend's model name
    chat = await gw.router.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=auth())
    assert chat.status == 200 and gw.backend.tokenized[-1]["model"] == BACKEND_MODEL
    back = await gw.router.post("/detokenize", json={"model": MODEL, "tokens": [1, 2]}, headers=auth())
    assert back.status == 200 and (await back.json()) == {"prompt": "t1 t2"}
    anonymous = await gw.router.post("/tokenize", json={"prompt": "hello"})
    assert anonymous.status == 401 and "error" in await anonymous.json()
    unknown = await gw.router.post("/tokenize", json={"model": "nope", "prompt": "x"}, headers=auth())
    assert unknown.status == 404 and (await unknown.json())["error"]["code"] == "model_not_found"


async def test_public_tokenizer_answers_without_a_key_and_nothing_else_does(gw, tmp_path) -> None:
    """[server] public_tokenizer: `vllm bench serve` aligns prompts through /tokenize and /detokenize without a key
    (vllm/benchmarks/serve.py _align_prompts_to_server_tokenizer); generation still needs one."""
    path = tmp_path / "public.toml"
    path.write_text(settings_text(tmp_path, gw.backend.url, gw.backend.url).replace("port = 0\n", "port = 0\npublic_tokenizer = true\n", 1))
    app = create_app(router_config.load(path, env={}), env={KEY_ENV: KEY})
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        tokenized = await client.post("/tokenize", json={"model": MODEL, "prompt": "hello", "add_special_tokens": False})
        assert tokenized.status == 200 and (await tokenized.json())["count"] == 36
        back = await client.post("/detokenize", json={"model": MODEL, "tokens": [1, 2]})
        assert back.status == 200 and (await back.json()) == {"prompt": "t1 t2"}
        chat = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status == 401


async def test_model_card_by_id(gw) -> None:
    card = await gw.oai.models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "pd-deploy"
    with pytest.raises(openai.NotFoundError):
        await gw.oai.models.retrieve("gpt-unknown")


async def test_prompt_tokens_details_pass_through(gw) -> None:
    answer = await gw.oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert answer.usage.prompt_tokens_details.cached_tokens == 4


@pytest.mark.parametrize("path, body, field, shape", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "cut \ud800 emoji"}], "max_tokens": 5},
     "messages[0].content", "openai"),
    ("/v1/completions", {"prompt": "x\udfff", "max_tokens": 5}, "prompt", "openai"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud83d"}]}]},
     "messages[0].content[0].text", "anthropic"),
    ("/v1/responses", {"input": [{"role": "user", "content": "\ud800"}]}, "input[0].content", "openai"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "description": "bad \udc00"}}]}, "tools[0].function.description", "openai"),
])
async def test_a_lone_surrogate_is_a_400_naming_the_field(gw, path, body, field, shape) -> None:
    """JSON "\\ud800" (a JavaScript client that cut an emoji in half) never reaches an engine: 400 in the API's shape."""
    raw = json.dumps({"model": MODEL, **body})  # json.dumps writes the lone surrogate as its \\u escape
    response = await gw.router.post(path, data=raw, headers={**auth(), "Content-Type": "application/json"})
    error = await response.json()
    assert response.status == 400, error
    if shape == "openai":
        assert error["error"]["param"] == field and "lone UTF-16 surrogate" in error["error"]["message"]
    else:
        assert error["type"] == "error" and f"'{field}'" in error["error"]["message"]
    assert gw.backend.seen == []
