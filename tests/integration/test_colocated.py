"""The colocated stack (one engine, role both) behind the same router: same API, same tokens."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from tests.integration.compose_stack import COLOCATED, Stack, start_stack, unique_project

pytestmark = pytest.mark.integration

PROMPT = [{"role": "user", "content": "Colocated or disaggregated, the tokens must match."}]


@pytest.fixture(scope="module")
def colocated_stack(app_image: None) -> Iterator[Stack]:
    stack = start_stack(unique_project("pdt-coloc"), files=COLOCATED)
    try:
        yield stack
    finally:
        stack.stop()


def _tokens(stack: Stack, **sampling: object) -> list[str]:
    client = openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0)
    stream = client.chat.completions.create(model="your-model-id", messages=PROMPT, stream=True, **sampling)
    return [chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content]


def test_colocated_gives_the_same_tokens_as_disaggregated(pd_stack: Stack, colocated_stack: Stack) -> None:
    """Same prompt and seed: the colocated engine streams exactly the tokens the PD pair streams."""
    sampling = {"max_tokens": 16, "temperature": 0.8, "seed": 1234}
    disaggregated = _tokens(pd_stack, **sampling)
    colocated = _tokens(colocated_stack, **sampling)
    assert len(disaggregated) >= 8
    assert colocated == disaggregated


def test_colocated_router_reports_colocated_mode(colocated_stack: Stack) -> None:
    """The router in the colocated stack sees one engine for both roles and says so in /health."""
    with urllib.request.urlopen(f"{colocated_stack.router_url}/health", timeout=5) as response:
        health = json.load(response)
    assert health["mode"] == "colocated"
    assert {b["url"] for b in health["backends"]} == {"http://engine:8000"}
