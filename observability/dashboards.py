"""The Grafana dashboards, defined once here and written as provisioning JSON (observability/grafana/dashboards/).

    python -m observability.dashboards          # rewrite the JSON files (a unit test checks they are current)

Three dashboards: `pd-overview` (what clients get: latency quantiles, goodput, requests by status, KV
transfer, P and D utilisation), `pd-engines` (per role: queue, KV cache, tokens, step time; the
`role` variable picks prefill, decode, the colocated engine or all) and `pd-keys` (per-key usage, quota, in flight).
Every panel's PromQL runs unchanged against Prometheus (the integration test does exactly that), with
`$role` as a regex over job names. Datasource: uid `prometheus` (grafana/provisioning/datasources).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
OUT = Path(__file__).parent / "grafana" / "dashboards"


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # Grafana unit id: s, percentunit, reqps, Bps, short …
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""


OVERVIEW = (
    Panel("TTFT P50 / P99", "s", (("pd:ttft_seconds:p50", "P50"), ("pd:ttft_seconds:p99", "P99")),
          "Router-measured time to first token (streamed requests; PD: prefill leg + KV hand-off + first decode step)."),
    Panel("ITL P50 / P99", "s", (("pd:itl_seconds:p50", "P50"), ("pd:itl_seconds:p99", "P99"),
                                 ("max(pd_router_slo_tpot_seconds)", "TPOT SLO")),
          "Gaps between relayed token chunks; the SLO line is PD_SLO_TPOT_MS."),
    Panel("E2E latency P50 / P99", "s", (("pd:e2e_seconds:p50", "P50"), ("pd:e2e_seconds:p99", "P99"))),
    Panel("Requests by status", "reqps", (("pd:requests:rate1m", "{{status}}"),), "Client requests per second by HTTP status."),
    Panel("Goodput", "reqps", (("pd:goodput:rate1m", "meeting SLOs"), ("pd:streamed:rate1m", "all streamed")),
          "Streamed requests per second meeting both the TTFT and TPOT SLOs (PD_SLO_TTFT_MS, PD_SLO_TPOT_MS)."),
    Panel("Queue wait (TTFT − prefill)", "s", (("pd:queue_wait_seconds:mean", "TTFT − prefill (mean)"),
                                               ("pd:prefill_seconds:mean", "prefill leg (mean)")),
          "Dynamo's gap: what TTFT spends outside the prefill computation (queues, KV hand-off)."),
    Panel("KV transfer GB/s", "GBs", (("pd:kv_transfer_gbps", "{{side}} (while transferring)"),),
          "Bytes per transfer second, as the engines' kv_producer.sent logs show; the article's hidden PD bottleneck."),
    Panel("KV bytes moved / s", "Bps", (("pd:kv_transfer_bytes:rate1m", "{{side}}"),)),
    Panel("KV transfer failures / s", "short", (("sum by (side, reason) (rate(pd_kv_transfer_failures_total[1m])) or vector(0)", "{{side}} {{reason}}"),),
          "Failed transfers by side and reason; 0 when healthy."),
    Panel("P and D utilisation", "percentunit", (("pd:role_utilisation", "{{job}}"),),
          "Fraction of wall time each role's step loop spends computing (mean over replicas)."),
    Panel("Backends up", "short", (("sum by (role) (pd_router_backend_up)", "{{role}} up"),), "Backends the router's health probe sees SERVING."),
)

ENGINES = (
    Panel("Requests running / waiting", "short", (("sum by (job) (vllm:num_requests_running{job=~\"$role\"})", "{{job}} running"),
                                                  ("sum by (job) (vllm:num_requests_waiting{job=~\"$role\"})", "{{job}} waiting"))),
    Panel("KV cache usage", "percentunit", (("vllm:kv_cache_usage_perc{job=~\"$role\"}", "{{job}} {{instance}}"),)),
    Panel("Prompt tokens / s", "short", (("sum by (job) (rate(vllm:prompt_tokens_total{job=~\"$role\"}[1m]))", "{{job}}"),)),
    Panel("Generation tokens / s", "short", (("sum by (job) (rate(vllm:generation_tokens_total{job=~\"$role\"}[1m]))", "{{job}}"),)),
    Panel("Engine TTFT P99", "s", (("histogram_quantile(0.99, sum by (job, le) (rate(vllm:time_to_first_token_seconds_bucket{job=~\"$role\"}[1m])))", "{{job}}"),)),
    Panel("Engine ITL P99", "s", (("histogram_quantile(0.99, sum by (job, le) (rate(vllm:inter_token_latency_seconds_bucket{job=~\"$role\"}[1m])))", "{{job}}"),)),
    Panel("Engine queue time P99", "s", (("histogram_quantile(0.99, sum by (job, le) (rate(vllm:request_queue_time_seconds_bucket{job=~\"$role\"}[1m])))", "{{job}}"),)),
    Panel("Step loop utilisation", "percentunit", (("pd:engine_utilisation{job=~\"$role\"}", "{{job}} {{instance}}"),)),
    Panel("Tokens per step", "short", (("sum by (job) (rate(vllm:iteration_tokens_total_sum{job=~\"$role\"}[1m])) / sum by (job) (rate(vllm:iteration_tokens_total_count{job=~\"$role\"}[1m]))", "{{job}}"),)),
    Panel("KV receive buffer (decode)", "bytes", (("pd_kv_receive_buffer_bytes{job=~\"$role\"}", "{{instance}} {{state}}"),)),
    Panel("KV transfer P99", "s", (("pd:kv_transfer_seconds:p99", "{{side}}"),)),
    Panel("Requests finished by reason", "short", (("sum by (job, finished_reason) (increase(vllm:request_success_total{job=~\"$role\"}[5m]))", "{{job}} {{finished_reason}}"),)),
)

KEYS = (
    Panel("Tokens used per key", "short", (("sum by (key_name) (pd_router_key_tokens_used)", "{{key_name}}"),), "From the usage db: survives restarts."),
    Panel("Quota used", "percentunit", (("sum by (key_name) (pd_router_key_tokens_used) / on (key_name) max by (key_name) (pd_router_key_token_quota) or on () vector(0)", "{{key_name}}"),),
          "Share of each key's token_quota used (keys with a quota); 0 when none has one."),
    Panel("Requests per key / min", "short", (("sum by (key_name) (delta(pd_router_key_requests[1m]))", "{{key_name}}"),)),
    Panel("In flight per key", "short", (("pd_router_key_in_flight", "{{key_name}}"),)),
    Panel("Rejected requests by status", "reqps", (("sum by (status) (rate(pd_router_requests_total{status=~\"4..|5..\"}[1m])) or vector(0)", "{{status}}"),),
          "401 key, 429 limits and quota, 5xx backends; 0 when none."),
)

DASHBOARDS = {
    "pd-overview": ("PD overview", OVERVIEW),
    "pd-engines": ("PD engines by role", ENGINES),
    "pd-keys": ("PD keys and usage", KEYS),
}


def dashboard(uid: str, title: str, panels: tuple[Panel, ...]) -> dict:
    """One Grafana dashboard (schema 39): a 2-column grid of time series panels."""
    body = []
    for i, panel in enumerate(panels):
        body.append({
            "id": i + 1, "type": "timeseries", "title": panel.title, "description": panel.description,
            "datasource": DATASOURCE,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(panel.targets)],
        })
    templating = []
    if any("$role" in e for p in panels for e, _ in p.targets):
        templating.append({"name": "role", "label": "Role", "type": "custom", "query": "prefill,decode,engine",
                           "multi": True, "includeAll": True, "allValue": "prefill|decode|engine",
                           "current": {"text": "All", "value": "$__all"}})
    return {"uid": uid, "title": title, "tags": ["pd-deploy"], "schemaVersion": 39, "version": 1, "editable": True,
            "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "timezone": "browser",
            "templating": {"list": templating}, "annotations": {"list": []}, "panels": body}


def render_all() -> dict[str, str]:
    """File name → JSON text of every dashboard."""
    return {f"{uid}.json": json.dumps(dashboard(uid, title, panels), indent=2, ensure_ascii=False) + "\n"
            for uid, (title, panels) in DASHBOARDS.items()}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
