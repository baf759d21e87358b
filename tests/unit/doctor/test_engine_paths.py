"""Our engines on a slow path are a diagnosis: MKL forced on a CPU that is not Intel's, MKL wanted and missing, numba
missing. The lines are the engine's own, logged by its code (gemm.py's warm-up line, its load-time warning); a path
the operator chose (numpy, or auto's pick) is not a finding."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import pytest

from stack.common import events
from stack.common.logging import log_event, setup_logging
from stack.engine import gemm
from stack.engine.model import load_model
from tests.unit.doctor.helpers import by_id, diagnose

PATHS = {"engine.gemm_mkl_generic", "engine.gemm_mkl_missing", "engine.attention_numpy"}


@pytest.fixture(scope="module")
def weights():
    return load_model("dummy:tiny", matmuls="numpy").weights


def engine_log(tmp_path: Path, service: str, run: Callable[[], None]) -> Path:
    """What `run` logs as the engine `service`, as a log file."""
    sink = io.StringIO()
    setup_logging(service, sink=sink)
    try:
        run()
    finally:
        setup_logging("doctor-test")
    path = tmp_path / f"{service}.log"
    path.write_text(sink.getvalue())
    return path


def warm_up(weights, wanted: str) -> Callable[[], None]:
    """The engine's load and warm-up as far as the matmuls go: pick them, then log the engine.gemm line."""
    return lambda: gemm.log_matmuls(gemm.weight_matmul(weights, wanted, 2))


def test_mkl_forced_on_an_amd_cpu_names_the_generic_path_and_the_fix(tmp_path: Path, weights, monkeypatch):
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: "AuthenticAMD")
    findings, _ = diagnose(engine_log(tmp_path, "decode", warm_up(weights, "mkl")))
    f = by_id(findings, "engine.gemm_mkl_generic")
    assert f.severity == "warning" and "decode engine's" in f.title and "CPU of vendor AuthenticAMD" in f.title
    assert "PD_GEMM" in f.fix and "auto" in f.fix
    assert '"gemm": "mkl"' in f.evidence[0].line and '"cpu_vendor": "AuthenticAMD"' in f.evidence[0].line


@pytest.mark.parametrize(("vendor", "wanted"), [("AuthenticAMD", "auto"), ("GenuineIntel", "auto"),
                                                ("GenuineIntel", "mkl"), ("AuthenticAMD", "numpy")])
def test_what_auto_picks_or_the_operator_chose_is_no_finding(tmp_path: Path, weights, monkeypatch, vendor: str,
                                                             wanted: str):
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: vendor)
    findings, ctx = diagnose(engine_log(tmp_path, "decode", warm_up(weights, wanted)))
    assert len(ctx.by_event(events.ENGINE_GEMM)) == 1
    assert not PATHS & {f.id for f in findings}


def test_mkl_wanted_and_missing_on_both_engines_is_one_finding(tmp_path: Path, weights, monkeypatch):
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(gemm, "load_mkl", lambda threads: None)
    logs = [engine_log(tmp_path, role, warm_up(weights, "auto")) for role in ("prefill", "decode")]
    findings, _ = diagnose(*logs)
    f = by_id(findings, "engine.gemm_mkl_missing")
    assert "decode and prefill engines'" in f.title and "reinstall" in f.fix
    assert {e.service for e in f.evidence} == {"prefill", "decode"}
    assert "engine.gemm_mkl_generic" not in {x.id for x in findings}


def test_numba_missing_names_the_numpy_attention(tmp_path: Path):
    # batched_decode.compiled() logs this when `import numba` fails; its answer is cached per process, so the line is
    # logged here as it does.
    log = engine_log(tmp_path, "engine", lambda: log_event(
        events.ENGINE_ATTENTION, "numba cannot be imported (No module named 'numba'): decode attention runs on numpy",
        "WARNING", attention="numpy", reason="numba_missing"))
    findings, _ = diagnose(log)
    f = by_id(findings, "engine.attention_numpy")
    assert "numba did not import" in f.title and "No module named 'numba'" in f.evidence[0].line
