"""The engine's config.json: the article's schema is accepted, mistakes stop start-up with one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from stack.common.config import ConfigError
from stack.common.health_probe import SERVING, probe
from stack.engine import gemm
from stack.engine.__main__ import main
from stack.engine.config import ignored_fields, load_config

from .conftest import REPO, EngineProcess

ARTICLE_PREFILL = {
    "model": "your-model-id", "role": "prefill", "tensor_parallel_size": 4, "pipeline_parallel_size": 1,
    "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.85,
    "kv_transfer_config": {"kv_connector": "P2pNcclConnector", "kv_role": "kv_producer", "kv_port": 9100, "kv_buffer_size": "8e9"},
}


def run_engine(tmp_path: Path, config: dict | str, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return subprocess.run([sys.executable, "-m", "stack.engine", "--config", str(path), "--port", "0", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def test_the_articles_prefill_config_parses(tmp_path: Path) -> None:
    """The article's prefill config.json loads verbatim; "8e9" is a number of bytes."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(ARTICLE_PREFILL))
    config, _ = load_config(path)
    assert config.role == "prefill" and config.kv_role == "kv_producer"
    assert config.kv_transfer_config.buffer_bytes == 8_000_000_000
    assert config.max_num_batched_tokens == 8192 and not config.is_kv_consumer


@pytest.mark.parametrize(
    ("change", "key", "problem"),
    [
        ({"max_num_batch_tokens": 10}, "max_num_batch_tokens", "unknown key"),
        ({"kv_transfer_config": {"kv_port": "91x0"}}, "kv_transfer_config.kv_port", "expected an integer"),
        ({"role": "router"}, "role", "must be one of"),
        ({"kv_transfer_config": {"kv_buffer_size": "lots"}}, "kv_transfer_config.kv_buffer_size", "expected a number"),
        ({"kv_transfer_config": {"kv_role": "kv_consumer"}}, "kv_transfer_config.kv_role", "does not fit role 'prefill'"),
        ({"checkpoint": "dummy:huge"}, "checkpoint", "unknown dummy size"),
        ({"checkpoint": "dummy:tiny", "max_model_len": 4096}, "max_model_len", "exceeds the model's max_seq_len 512"),
    ],
    ids=["unknown-key", "wrong-type", "bad-literal", "bad-size", "role-conflict", "bad-checkpoint", "context-too-long"],
)
def test_config_mistake_is_one_line_naming_file_key_problem_exit_2(tmp_path: Path, capsys, change: dict, key: str, problem: str) -> None:
    """A wrong config makes main() return 2 with one stderr line, file: key: problem, and one config.invalid event."""
    config = {**ARTICLE_PREFILL, **change}
    if "kv_transfer_config" in change:
        config["kv_transfer_config"] = {**ARTICLE_PREFILL["kv_transfer_config"], **change["kv_transfer_config"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code = main(["--config", str(path)])

    out, err = capsys.readouterr()
    assert code == 2
    assert err.splitlines() == [err.strip()] and err.startswith(f"error: {path}: {key}: ") and problem in err
    logged = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [line["event"] for line in logged] == ["config.invalid"] and logged[0]["key"] == key


def test_engine_process_exits_2_without_traceback(tmp_path: Path) -> None:
    """The real process: an unknown key exits with code 2 and a single stderr line, no traceback."""
    result = run_engine(tmp_path, {**ARTICLE_PREFILL, "max_num_batch_tokens": 10})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1
    assert lines[0].startswith(f"error: {tmp_path / 'config.json'}: max_num_batch_tokens: unknown key")
    assert "Traceback" not in result.stderr


def test_invalid_json_names_the_line(tmp_path: Path, capsys) -> None:
    """A syntax error in config.json is reported with its line, exit code 2."""
    path = tmp_path / "config.json"
    path.write_text('{\n  "role": "decode",\n}')
    assert main(["--config", str(path)]) == 2
    assert "invalid JSON at line 3" in capsys.readouterr().err


def test_override_goes_through_the_same_validation(tmp_path: Path, capsys) -> None:
    """A bad --kv-port override fails like a bad file value."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"role": "decode", "checkpoint": "dummy:tiny"}))
    assert main(["--config", str(path), "--kv-port", "70000"]) == 2
    assert "kv_transfer_config.kv_port: must be a TCP port" in capsys.readouterr().err


def test_kv_transfer_port_moves_a_consumers_listener_only(tmp_path: Path) -> None:
    """KV_TRANSFER_PORT sets decode's kv_port (an explicit --kv-port still wins); a producer ignores it and its kv_port."""
    decode, prefill = tmp_path / "decode.json", tmp_path / "prefill.json"
    decode.write_text(json.dumps({"role": "decode", "kv_transfer_config": {"kv_port": 9100}}))
    prefill.write_text(json.dumps(ARTICLE_PREFILL))
    env = {"KV_TRANSFER_PORT": " 9200 "}

    assert load_config(decode, env=env)[0].kv_transfer_config.kv_port == 9200
    assert load_config(decode, {"kv_transfer_config.kv_port": 0}, env=env)[0].kv_transfer_config.kv_port == 0
    assert load_config(decode, env={"KV_TRANSFER_PORT": ""})[0].kv_transfer_config.kv_port == 9100  # empty: unset
    config, raw = load_config(prefill, env={"KV_TRANSFER_PORT": "not even a number"})
    assert config.kv_transfer_config.kv_port == 9100
    assert ("kv_transfer_config.kv_port", 9100, "only a KV consumer listens; this is a kv_producer") in ignored_fields(config, raw)


def test_prefix_caching_env_overrides_the_file(tmp_path: Path) -> None:
    """PD_PREFIX_CACHING=0|1 flips prefix_caching (the benchmark's arms); anything else names the variable."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"role": "both", "prefix_caching": True, "kv_dtype": "float16"}))
    assert load_config(path, env={})[0].prefix_caching is True
    assert load_config(path, env={"PD_PREFIX_CACHING": "0"})[0].prefix_caching is False
    assert load_config(path, env={"PD_PREFIX_CACHING": "1"})[0].kv_dtype == "float16"
    with pytest.raises(ConfigError, match="PD_PREFIX_CACHING: must be 0 or 1, got 'yes'"):
        load_config(path, env={"PD_PREFIX_CACHING": "yes"})
    path.write_text(json.dumps({"kv_dtype": "bfloat16"}))
    with pytest.raises(ConfigError, match="kv_dtype"):
        load_config(path, env={})


@pytest.mark.parametrize(("key", "variable", "default", "other", "choices", "bad"), [
    ("attention", "PD_ATTENTION", "numba", "numpy", "numba or numpy", "flash"),  # the compiled kernel | attention.py
    ("gemm", "PD_GEMM", "auto", "numpy", "auto, mkl, numba or numpy", "cublas"),  # MKL on Intel CPUs | OpenBLAS
])
def test_engine_arms_default_and_their_variable_switches_them(tmp_path: Path, key: str, variable: str, default: str,
                                                              other: str, choices: str, bad: str) -> None:
    """attention / gemm take their default unless the file or their variable says otherwise (the env wins); other
    values name their source."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"role": "decode"}))
    assert getattr(load_config(path, env={})[0], key) == default
    assert getattr(load_config(path, env={variable: other})[0], key) == other
    path.write_text(json.dumps({"role": "decode", key: other}))
    assert getattr(load_config(path, env={})[0], key) == other
    assert getattr(load_config(path, env={variable: default})[0], key) == default
    with pytest.raises(ConfigError, match=f"{variable}: must be {choices}, got '{bad}'"):
        load_config(path, env={variable: bad})
    path.write_text(json.dumps({key: bad}))
    with pytest.raises(ConfigError, match=key):
        load_config(path, env={})


@pytest.mark.parametrize("value", ["91x0", "70000", "-1"])
def test_bad_kv_transfer_port_is_one_line_naming_the_variable(tmp_path: Path, capsys, monkeypatch, value: str) -> None:
    """A KV_TRANSFER_PORT that is not a port stops a decode engine: exit 2, `environment: KV_TRANSFER_PORT: …`."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"role": "decode", "checkpoint": "dummy:tiny"}))
    monkeypatch.setenv("KV_TRANSFER_PORT", value)
    assert main(["--config", str(path)]) == 2

    out, err = capsys.readouterr()
    assert err.strip() == f"error: environment: KV_TRANSFER_PORT: must be a TCP port (0-65535; 0 picks a free one), got {value!r}"
    logged = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(line["event"], line["key"]) for line in logged] == [("config.invalid", "KV_TRANSFER_PORT")]


def test_shipped_configs_start_and_report_ignored_fields(tmp_path: Path) -> None:
    """decode/config.json starts (tiny checkpoint, KV_TRANSFER_PORT=0: a free KV port), logs each CPU-meaningless
    key once, and /health reports the port it listens on."""
    engine = EngineProcess(tmp_path, "decode", json.loads((REPO / "decode" / "config.json").read_text()),
                           ("--checkpoint", "dummy:tiny"), env={"KV_TRANSFER_PORT": "0"})
    try:
        engine.wait_ready()
        ignored = {line["key"] for line in engine.events("config.ignored")}
        assert ignored == {"tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization", "kv_transfer_config.kv_connector"}
        assert engine.events("service.starting")[0]["checkpoint"] == "dummy:tiny"
        kv_port = engine.kv_port()
        assert kv_port not in (0, 9100)
        assert probe(f"127.0.0.1:{engine.health_port}") == SERVING  # gRPC health after warm-up
        with urllib.request.urlopen(f"{engine.url}/health", timeout=5) as response:
            assert json.load(response)["kv_port"] == kv_port
    finally:
        engine.stop()


@pytest.mark.parametrize(("arm", "matmuls", "expected"), [
    ("numba", "", "mkl" if gemm.cpu_vendor() == gemm.INTEL else "numba"),  # the default, auto
    ("numba", "mkl", "mkl"),
    ("numpy", "numba", "numba"),
    ("numpy", "numpy", "numpy"),
])
def test_the_warm_up_readies_the_attention_and_says_what_the_matmuls_run_on(tmp_path: Path, arm: str, matmuls: str,
                                                                             expected: str) -> None:
    """One engine.attention line, before service.ready: the kernel compiled (or loaded from numba's cache) by the
    warm-up, not by the first request, on oneTBB's threads (the tbb wheel is a dependency: a launch on workqueue's
    costs ~30x); or numpy, as PD_ATTENTION=numpy configures, even when the weight matmuls compile the kernels. And
    one engine.gemm line naming the CPU's vendor: by default mkl on an Intel CPU and numba on others; mkl on any CPU
    with PD_GEMM=mkl (MKL is a runtime dependency, so it must load: no mkl_missing warning); numba or numpy as
    PD_GEMM says."""
    engine = EngineProcess(tmp_path, "both", {"model": "tiny", "role": "both", "checkpoint": "dummy:tiny"},
                           env={"PD_ATTENTION": arm, "PD_GEMM": matmuls})
    try:
        engine.wait_ready()
        events = [line["event"] for line in engine.lines]
        for event in ("engine.attention", "engine.gemm"):
            assert events.count(event) == 1 and events.index(event) < events.index("service.ready")
        line = engine.events("engine.attention")[0]
        assert line["attention"] == arm
        if arm == "numba":
            assert line["kernel_ms"] > 0 and isinstance(line["kernel_cached"], bool) and line["threading_layer"] == "tbb"
        else:
            assert line["reason"] == "configured"
        line = engine.events("engine.gemm")[0]
        assert (line["level"], line["gemm"], line["cpu_vendor"]) == ("INFO", expected, gemm.cpu_vendor())
    finally:
        engine.stop()


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_shipped_config_files_are_valid(role: str) -> None:
    """Every shipped config.json passes validation with the role its folder names."""
    try:
        config, _ = load_config(REPO / role / "config.json", env={})
    except ConfigError as exc:
        pytest.fail(str(exc))
    assert config.role == {"colocated": "both"}.get(role, role)
