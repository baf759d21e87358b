"""observability.panels: the key panels rendered to a PNG from query_range data; clear errors without data."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from observability import panels


def fake_query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    """Two series per query with plausible shapes (a sine on a base), like Prometheus' matrix result."""
    out = []
    for i, label in enumerate(("a", "b")):
        values = [[start + k * step, str(0.05 * (i + 1) * (1.5 + math.sin(k / 5)))] for k in range(int((end - start) / step))]
        values[3][1] = "NaN"  # quantiles of empty windows come back as NaN: skipped
        out.append({"metric": {"status": "200", "side": "send", "job": "decode", "le": label, "x": label}, "values": values})
    return out


def test_renders_every_key_panel_into_a_non_trivial_png(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Six panels with data give a PNG of real size; the legend templating fills {{label}}."""
    monkeypatch.setattr(panels, "query_range", fake_query_range)
    out = tmp_path / "p.png"
    assert panels.main(["--prometheus", "http://prom.invalid", "--minutes", "5", "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000
    assert panels.legend_for("{{side}} (while transferring)", {"side": "send"}) == "send (while transferring)"


def test_no_data_is_an_error_not_an_empty_picture(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Prometheus answers but has no series: exit 1 and say to send requests first; no file written."""
    monkeypatch.setattr(panels, "query_range", lambda *a: [])
    out = tmp_path / "p.png"
    assert panels.main(["--prometheus", "http://prom.invalid", "--out", str(out)]) == 1
    assert "send some requests first" in capsys.readouterr().err and not out.exists()


def test_unreachable_prometheus_names_the_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing listens: exit 1 with the URL and the hint to start the overlay."""
    assert panels.main(["--prometheus", "http://127.0.0.1:9", "--out", str(tmp_path / "p.png")]) == 1
    err = capsys.readouterr().err
    assert "http://127.0.0.1:9" in err and "--observability" in err
