"""vLLM's plain-text lines → records (doctor/engine_lines.py): the lines as vLLM 0.32.0 prints them."""

from __future__ import annotations

from doctor import engine_lines
from doctor.parse import parse_lines

STATS = ("(APIServer pid=7) INFO 12-02 03:25:10 [loggers.py:335] Engine 000: Avg prompt throughput: 0.0 tokens/s, "
         "Avg generation throughput: 9.6 tokens/s, Running: 1 reqs, Waiting: 11 reqs, KV fetch: 10 waiting to start, "
         "1 in progress, 0 completed waiting, CPU KV cache usage: 97.5%, Prefix cache hit rate: 0.0%")
ARGS = ("(APIServer pid=7) INFO 12-02 03:10:57 [api_utils.py:286] non-default args: {'model': '/m', 'max_model_len': 512, "
        "'api_key': ['sk-engine-secret'], 'kv_transfer_config': KVTransferConfig(kv_connector='NixlConnector', "
        "kv_role='kv_consumer')}")


def test_stats_line_gives_queue_and_kv_waits():
    _, event, _, data = engine_lines.parse(STATS, "decode")
    assert event == "vllm.stats"
    assert (data["running"], data["waiting"], data["kv_fetch_waiting"], data["kv_usage_pct"]) == (1, 11, 10, 97.5)


def test_args_are_read_and_an_api_key_never_reaches_a_record():
    records, _ = parse_lines([ARGS], "decode.log", "decode")
    assert records[0].event == "vllm.args" and records[0].data["args"] == {"model": "/m", "max_model_len": 512,
                                                                          "kv_transfer_config": None}
    assert "sk-engine-secret" not in records[0].line and "sk-engine-secret" not in records[0].msg


def test_vllm_ids_join_the_routers_request_and_the_year_comes_from_the_router():
    router = '{"ts": "2026-12-02T03:25:09.1Z", "service": "router", "event": "router.request_received", ' \
             '"request_id": "ab12cd34", "msg": "", "client_request_id": "rec-1"}'
    line = ("(APIServer pid=7) ERROR 12-02 03:25:10 [serving.py:1] Error in chat completion for "
            "chatcmpl-rec-1-0a1b2c3d: boom")
    records = parse_lines([router], "router.log", "router")[0] + parse_lines([line], "decode.log", "decode")[0]
    engine_lines.fix_years(records)
    engine_lines.join_requests(records)
    assert records[1].request_id == "ab12cd34" and records[1].ts == "2026-12-02T03:25:10"
