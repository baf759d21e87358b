"""Engine GET /metrics: vLLM's names and labels, fed by a real PD hand-off between in-process engines."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from stack.engine.model import Model
from stack.engine.server import ENGINE, create_app
from tests.unit.engine_serving.conftest import EngineHandle, chat, engine_config, free_port, prefill_leg


@pytest.fixture
def engine(aiohttp_client: Callable, tiny: Model) -> Callable:
    async def start(role: str, **fields) -> EngineHandle:
        app = create_app(engine_config(role, **fields), tiny)
        return EngineHandle(await aiohttp_client(app), app[ENGINE])
    return start


@pytest.fixture(scope="session")
def tiny() -> Model:
    from stack.engine.model import load_model
    return load_model("dummy:tiny", seed=0)


async def scrape(handle: EngineHandle) -> dict[str, float]:
    """GET /metrics as {series: value} (series = name{labels} exactly as rendered)."""
    response = await handle.client.get("/metrics")
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for line in (await response.text()).splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return samples


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    found = [v for s, v in samples.items() if re.fullmatch(re.escape(name) + r"(\{.*\})?", s) and all(w in s for w in want)]
    assert len(found) == 1, f"{name}{labels}: {found} in {sorted(s for s in samples if s.startswith(name))}"
    return found[0]


async def test_a_pd_request_shows_on_both_engines_under_vllm_names(engine) -> None:
    """Prefill counts prompt tokens and KV sent; decode counts tokens, TTFT/ITL, KV received; bytes agree."""
    prefill, decode = await engine("prefill"), await engine("decode")
    body = chat("metrics for both sides", max_tokens=6, temperature=0, ignore_eos=True)
    response = await prefill.client.post("/v1/chat/completions", json=prefill_leg(body, "t-m", f"127.0.0.1:{decode.engine.handoff.consumer.port}"))
    params = (await response.json())["kv_transfer_params"]
    stream = await decode.client.post("/v1/chat/completions", json=body | {"stream": True, "kv_transfer_params": params})
    assert (await stream.text()).endswith("data: [DONE]\n\n")

    p, d = await scrape(prefill), await scrape(decode)
    sent = value(p, "pd_kv_transfer_bytes_total", side="send")
    assert sent > 0 and value(d, "pd_kv_transfer_bytes_total", side="receive") == sent
    assert value(p, "vllm:prompt_tokens_total", model_name="tiny", engine="0") == params["num_tokens"]
    assert value(p, "pd_kv_transfer_seconds_count", side="send") == 1 and value(d, "pd_kv_transfer_seconds_count", side="receive") == 1
    assert value(d, "vllm:generation_tokens_total") == 6  # the first token (from prefill) is emitted by decode too
    assert value(d, "vllm:time_to_first_token_seconds_count") == 1
    assert value(d, "vllm:inter_token_latency_seconds_count") == 5 == value(d, "vllm:time_per_output_token_seconds_count")
    assert value(d, "vllm:request_time_per_output_token_seconds_count") == 1
    assert value(d, "vllm:request_success_total", finished_reason="length") == 1
    assert value(d, "vllm:num_requests_running") == 0 and value(d, "vllm:kv_cache_usage_perc") == 0
    assert value(d, "pd_kv_receive_buffer_bytes", state="used") == 0
    assert value(d, "pd_kv_receive_buffer_bytes", state="size") == decode.engine.handoff.consumer.buffer_size
    assert value(p, "pd_engine_busy_seconds_total") > 0 and value(p, "pd_engine_steps_total") >= 1
    assert not any(s.startswith("pd_kv_receive_buffer") for s in p), "prefill has no receive buffer"


async def test_kv_failures_are_counted_by_side_and_reason(engine) -> None:
    """A push to a closed port counts connect_failed on prefill; a decode leg whose KV never came counts timeout."""
    prefill = await engine("prefill")
    response = await prefill.client.post("/v1/chat/completions", json=prefill_leg(chat("x", max_tokens=2), "t-f", f"127.0.0.1:{free_port()}"))
    assert response.status == 502
    assert value(await scrape(prefill), "pd_kv_transfer_failures_total", side="send", reason="connect_failed") == 1

    decode = await engine("decode", kv={"kv_transfer_timeout_ms": 50, "kv_load_failure_policy": "fail"})
    params = {"do_remote_prefill": True, "transfer_id": "t-never", "num_tokens": 3, "remote_host": "x", "remote_port": 1}
    response = await decode.client.post("/v1/chat/completions", json=chat("x", max_tokens=2, kv_transfer_params=params))
    assert response.status == 504
    assert value(await scrape(decode), "pd_kv_transfer_failures_total", side="receive", reason="timeout") == 1


async def test_a_fresh_engine_serves_zeroed_counters_and_gauges(engine) -> None:
    """Before any request: counters at 0 (so rate() works from the start), gauges present, no histogram series."""
    both = await engine("both")
    samples = await scrape(both)
    assert value(samples, "vllm:prompt_tokens_total") == 0 and value(samples, "vllm:generation_tokens_total") == 0
    assert value(samples, "vllm:num_requests_waiting") == 0
    assert value(samples, "pd_engine_kv_blocks", state="free") == both.engine.scheduler.pool.total_blocks
    assert not any("time_to_first_token" in s for s in samples)
