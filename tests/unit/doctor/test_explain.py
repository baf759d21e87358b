"""`doctor explain REQUEST_ID`: per-hop durations as text, and the same hops as a PNG / SVG picture."""

from __future__ import annotations

import io
import json

from doctor.cli import main
from tests.unit.doctor.scenarios import request_id

HOPS = ("router queue", "prefill compute", "KV push", "decode first token", "stream")


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), stdout=out), out.getvalue()


def test_explain_text_has_every_hop_with_its_duration(bundles, tmp_path):
    """A healthy PD request: five hops with ms durations from their own fields, the total, the lines, exit 0."""
    code, out = run("explain", request_id(2), "--logs", str(bundles / "healthy_v2ts.log"), "--out",
                    str(tmp_path / "x.png"))
    assert code == 0
    assert "prefill compute          40.0 ms" in out  # prefill's engine.prefill_done prefill_ms (50 tokens × 0.8)
    assert "total                   116.0 ms" in out
    for hop in HOPS:
        assert hop in out
    assert "slowest hop: stream" in out


def test_explain_png_is_written(bundles, tmp_path):
    """The default picture is a PNG file."""
    path = tmp_path / "one.png"
    code, out = run("explain", request_id(3), "--logs", str(bundles / "healthy_v1.log"), "--out", str(path))
    assert code == 0 and f"picture: {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_explain_svg_names_the_hops_and_json_gives_them(bundles, tmp_path):
    """The SVG carries each hop's label; --json lists hops with lane, start and duration."""
    path = tmp_path / "one.svg"
    code, out = run("--json", "explain", request_id(1), "--logs", str(bundles / "healthy_v2ts.log"), "--out", str(path))
    doc = json.loads(out)
    assert code == 0 and [h["name"] for h in doc["hops"]] == list(HOPS)
    assert {h["lane"] for h in doc["hops"]} == {"router", "prefill", "kv", "decode"}
    svg = path.read_text()
    for hop in HOPS:
        assert hop in svg


def test_explain_a_failed_request_exits_1_and_an_unknown_id_2(bundles, tmp_path):
    """A request that stopped shows the hops it reached (exit 1); an id not in the logs is exit 2."""
    log = str(bundles / "kv_port_mismatch.log")
    code, out = run("explain", request_id(1), "--logs", log, "--no-picture")
    assert code == 1 and "did not complete" in out and "prefill compute" in out
    assert run("explain", "nope", "--logs", log, "--no-picture")[0] == 2


def _router_line(rid: str, event: str, ts: str, **fields) -> str:
    return json.dumps({"ts": f"2026-12-02T03:00:{ts}Z", "level": "INFO", "service": "router", "event": event,
                       "request_id": rid, "msg": event, **fields})


def test_the_router_queue_comes_from_queue_ms_and_from_older_routers_received_line(tmp_path):
    """The router logs one line before a request's legs, router.scheduled, whose queue_ms is the router-queue hop;
    an older router's log (router.request_received, then a router.scheduled without queue_ms) still gives the hop."""
    pair = dict(prefill="http://p", decode="http://d", policy="load_aware", mode="disaggregated", attempt=1)
    tail = [("router.prefill_done", "01.100", dict(prefill="http://p", prefill_ms=90.0, transfer_id="t")),
            ("router.request_done", "01.300", dict(api="chat", key_name="default", status=200, error=None,
                                                   prompt_tokens=9, completion_tokens=1, e2e_ms=312.5))]
    logs = {"now": [("router.scheduled", "01.000", dict(pair, api="chat", model="m", stream=False, queue_ms=12.5))],
            "older": [("router.request_received", "00.990", dict(api="chat", model="m", stream=False)),
                      ("router.scheduled", "01.000", pair)]}
    for rid, lines in logs.items():
        path = tmp_path / f"{rid}.log"
        path.write_text("".join(_router_line(rid, e, ts, **f) + "\n" for e, ts, f in lines + tail))
        code, out = run("--json", "explain", rid, "--logs", str(path), "--no-picture")
        queue = next(h for h in json.loads(out)["hops"] if h["name"] == "router queue")
        assert (rid, queue["start_ms"], queue["duration_ms"]) == (rid, 0.0, 12.5 if rid == "now" else 10.0), out
