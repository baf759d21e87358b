"""Router metrics added for the PD views: SLOs from the environment, TPOT and goodput per stream, per-key gauges."""

from __future__ import annotations

import pytest

from stack.common.config import ConfigError
from stack.router.config import KeyLimits
from stack.router.auth import Caller
from stack.router.limits import Limiter
from stack.router.metrics import SLO, Metrics
from stack.router.usage import UsageStore


def test_slo_from_env_reads_milliseconds_and_keeps_defaults() -> None:
    """PD_SLO_TTFT_MS / PD_SLO_TPOT_MS become seconds; unset ones keep the defaults."""
    assert SLO.from_env({"PD_SLO_TTFT_MS": "500"}) == SLO(ttft_s=0.5, tpot_s=SLO().tpot_s)
    assert SLO.from_env({}) == SLO()


@pytest.mark.parametrize("value", ["fast", "0", "-3", "nan"])
def test_slo_from_env_refuses_a_bad_value_naming_the_variable(value: str) -> None:
    """A non-number or non-positive SLO is a ConfigError naming the variable and the value (the router's one-line stop)."""
    with pytest.raises(ConfigError, match=f"environment: PD_SLO_TPOT_MS: must be .*'{value}'"):
        SLO.from_env({"PD_SLO_TPOT_MS": value})


def test_observe_stream_counts_goodput_against_both_slos() -> None:
    """A stream meets the SLOs only if TTFT and TPOT are both within them; TPOT = decode time / (chunks - 1)."""
    m = Metrics(SLO(ttft_s=1.0, tpot_s=0.1))
    m.observe_stream(0.5, 0.9, 10)  # TPOT 0.1: met
    m.observe_stream(1.5, 0.1, 10)  # TTFT over
    m.observe_stream(0.5, 2.0, 11)  # TPOT 0.2 over
    m.observe_stream(0.5, 0.0, 1)  # one chunk: no TPOT, TTFT met
    assert m.slo_requests.value(slo="met") == 2 and m.slo_requests.value(slo="missed") == 2
    assert m.tpot.count() == 3
    body, _ = m.render()
    assert "pd_router_slo_ttft_seconds 1\n" in body and "pd_router_slo_tpot_seconds 0.1\n" in body


def test_key_gauges_read_usage_quota_and_in_flight_at_scrape_time() -> None:
    """Per key: requests and tokens from the usage store, quota only where set, in-flight from the limiter."""
    usage = UsageStore(":memory:")
    usage.add("alice", 30, 12)
    callers = [Caller("alice", KeyLimits(token_quota=100)), Caller("bob", KeyLimits())]
    m = Metrics(SLO())
    m.add_key_gauges(lambda: callers, usage, Limiter(usage))
    body, _ = m.render()
    assert 'pd_router_key_tokens_used{key_name="alice",kind="prompt"} 30\n' in body
    assert 'pd_router_key_tokens_used{key_name="alice",kind="completion"} 12\n' in body
    assert 'pd_router_key_requests{key_name="bob"} 0\n' in body
    assert 'pd_router_key_token_quota{key_name="alice"} 100\n' in body
    assert 'pd_router_key_token_quota{key_name="bob"}' not in body
    assert 'pd_router_key_in_flight{key_name="alice"} 0\n' in body
