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
