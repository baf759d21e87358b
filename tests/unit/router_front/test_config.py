"""settings.toml: the article's schema loads, env overrides apply, keys in files and bad values stop start-up in one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stack.common.config import ConfigError
from stack.router import config as router_config
from stack.router.app import create_app

REPO = Path(__file__).resolve().parents[3]
SHIPPED = REPO / "router" / "settings.toml"


def _settings(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "settings.toml"
    path.write_text(text)
    return path


def test_shipped_settings_load_with_compose_endpoints() -> None:
    """The shipped settings.toml is the article's schema pointed at the compose services: every replica of each."""
    config = router_config.load(SHIPPED, env={})
    assert config.server.port == 8080 and config.taotoken.api_key_env == "TAOTOKEN_API_KEY"
    assert config.taotoken.model_id == "your-model-id"
    assert config.prefill.discover == "dns://prefill:8000" and config.decode.discover == "dns://decode:8000"
    assert config.prefill.urls == config.decode.urls == ()
    assert config.scheduler.policy == "cache_aware" and config.scheduler.guard.abs_threshold == 64 and config.scheduler.kv_connector == "pd-push"
    # No KV port anywhere: the router learns it from decode's GET /health.
    assert config.decode.kv_addrs == () and config.kv_transfer_port == 0


def test_env_overrides_endpoints_and_kv_port() -> None:
    """PREFILL_ENDPOINT and DECODE_ENDPOINT (comma-separated for xPyD) override the file; KV_TRANSFER_PORT is kept
    apart, as the port to check decode's report against, and changes no address."""
    env = {"PREFILL_ENDPOINT": "http://10.0.0.11:8000", "DECODE_ENDPOINT": "http://10.0.0.12:8000,http://10.0.0.13:8000",
           "KV_TRANSFER_PORT": "9200"}
    config = router_config.load(SHIPPED, env=env)
    assert config.prefill.urls == ("http://10.0.0.11:8000",)
    assert config.decode.urls == ("http://10.0.0.12:8000", "http://10.0.0.13:8000")
    assert config.kv_transfer_port == 9200 and config.decode.kv_addrs == ()
    with pytest.raises(ConfigError, match="environment: KV_TRANSFER_PORT: must be a port number 1..65535, got '91x0'"):
        router_config.load(SHIPPED, env={"KV_TRANSFER_PORT": "91x0"})


def test_kv_connector_from_file_or_env_and_validated() -> None:
    """[scheduler] kv_connector picks the hand-off; KV_CONNECTOR (the GPU overlays) overrides it; other values are refused."""
    assert router_config.load(SHIPPED, env={"KV_CONNECTOR": "nixl"}).scheduler.kv_connector == "nixl"
    with pytest.raises(ConfigError, match="environment: KV_CONNECTOR: must be one of pd-push, nixl, p2pnccl, got 'nccl'"):
        router_config.load(SHIPPED, env={"KV_CONNECTOR": "nccl"})


@pytest.mark.parametrize(("text", "env", "message"), [
    ('[scheduler]\nkv_connector = "push"\n', {}, "settings.toml: scheduler.kv_connector: must be one of 'pd-push', 'nixl', 'p2pnccl'"),
    ('[scheduler]\nkv_connector = "p2pnccl"\n', {}, "settings.toml: scheduler.kv_connector: is 'p2pnccl', but p2pnccl.registry_port"),
    ("[p2pnccl]\nregistry_port = 30001\n", {}, "settings.toml: p2pnccl.registry_port: is set, but scheduler.kv_connector is 'pd-push'"),
    ("", {"P2PNCCL_REGISTRY_PORT": "30001", "KV_CONNECTOR": "nixl"}, "p2pnccl.registry_port: is set, but scheduler.kv_connector is 'nixl'"),
])
def test_kv_connector_and_registry_must_agree(tmp_path: Path, text: str, env: dict[str, str], message: str) -> None:
    """P2pNccl needs the registry and the registry needs P2pNccl: either alone stops start-up naming file and key."""
    path = _settings(tmp_path, text + '[prefill]\nendpoint = "http://p:8000"\n[decode]\nendpoint = "http://d:8000"\n')
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        router_config.load(path, env=env)


def test_half_shared_endpoints_are_refused_at_load(tmp_path: Path) -> None:
    """Prefill and decode pools that share some engines but not all stop start-up at config load, naming the file."""
    path = _settings(tmp_path, '[prefill]\nendpoints = ["http://a:1", "http://b:1"]\n[decode]\nendpoint = "http://a:1"\n')
    with pytest.raises(ConfigError, match=r"settings.toml: prefill.endpoints: .*identical \(colocated\) or disjoint"):
        router_config.load(path, env={})


def test_backend_health_check_env_switches_both_pools_to_http() -> None:
    """BACKEND_HEALTH_CHECK=http (the GPU overlay's vLLM engines) probes GET /health; another value is refused."""
    fixed = {"PREFILL_ENDPOINT": "http://prefill:8000", "DECODE_ENDPOINT": "http://decode:8000"}
    config = router_config.load(SHIPPED, env={**fixed, "BACKEND_HEALTH_CHECK": "http"})
    assert config.prefill.health_addr(0) == "http://prefill:8000/health"
    assert config.decode.health_check == "http" and config.decode.health_addr(0) == "http://decode:8000/health"
    assert router_config.load(SHIPPED, env=fixed).decode.health_addr(0) == "decode:50051"
    # Discovered replicas (the shipped default) are probed the same way: replicas.py builds their addresses.
    assert router_config.load(SHIPPED, env={"BACKEND_HEALTH_CHECK": "http"}).decode.health_check == "http"
    with pytest.raises(ConfigError, match="BACKEND_HEALTH_CHECK: must be grpc or http, got 'rest'"):
        router_config.load(SHIPPED, env={"BACKEND_HEALTH_CHECK": "rest"})


def test_p2pnccl_registry_port_from_env_needs_no_endpoints(tmp_path: Path) -> None:
    """P2PNCCL_REGISTRY_PORT (the P2pNccl overlay, with kv_connector p2pnccl) turns the registry on, and then no endpoint is required;
    without it a settings file without endpoints is refused; a bad port names the variable."""
    path = _settings(tmp_path, '[taotoken]\nmodel_id = "m"\n[scheduler]\nkv_connector = "p2pnccl"\n')
    assert router_config.load(path, env={"P2PNCCL_REGISTRY_PORT": "30001"}).p2pnccl.registry_port == 30001
    path = _settings(tmp_path, '[taotoken]\nmodel_id = "m"\n')
    assert router_config.load(path, env={"P2PNCCL_REGISTRY_PORT": "30001", "KV_CONNECTOR": "p2pnccl"}).p2pnccl.registry_port == 30001
    with pytest.raises(ConfigError, match="prefill.endpoint: no endpoint"):
        router_config.load(path, env={})
    with pytest.raises(ConfigError, match="P2PNCCL_REGISTRY_PORT: must be a port number"):
        router_config.load(path, env={"P2PNCCL_REGISTRY_PORT": "zmq"})
    assert router_config.load(SHIPPED, env={}).p2pnccl.registry_port == 0


@pytest.mark.parametrize(("text", "key"), [
    ('[taotoken]\napi_key = "sk-live-0123456789abcdef"\n', "taotoken.api_key"),
    ('[taotoken]\nmodel_id = "sk-proj-abcdefghijk"\n', "taotoken.model_id"),
    ('[server]\nhost = "Bearer abcdef"\n', "server.host"),
    ('[limits]\nsecret = "hunter2"\n', "limits.secret"),
    ('[taotoken]\nbase_url = "0123456789abcdef0123456789abcdef0123"\n', "taotoken.base_url"),
])
def test_key_looking_values_stop_start_up(tmp_path: Path, text: str, key: str) -> None:
    """A key (or a value named like one) in settings.toml is refused with a message pointing at the env var."""
    path = _settings(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        router_config.load(path, env={})
    assert caught.value.key == key
    assert "TAOTOKEN_API_KEY" in str(caught.value) and "environment variable" in str(caught.value)
    assert "hunter2" not in str(caught.value) and "0123456789abcdef" not in str(caught.value)


@pytest.mark.parametrize(("text", "message"), [
    ('[server]\nport = "80x"\n', "settings.toml: server.port: expected an integer"),
    ('[limits]\nrpm = -1\n', "settings.toml: limits.rpm: must be >= 0"),
    ('[scheduler]\npolicy = "random"\n', "settings.toml: scheduler.policy: must be one of"),
    ('[taotoken]\napi_key_env = "my key"\n', "settings.toml: taotoken.api_key_env: must be the NAME"),
    ('[limits]\nrqm = 5\n', "settings.toml: limits.rqm: unknown key"),
    ('[p2pnccl]\ninstance_ttl_ms = 0\n', "settings.toml: p2pnccl.instance_ttl_ms: must be > 0"),
    ('[usage]\nflush_interval_ms = 0\n', "settings.toml: usage.flush_interval_ms: must be > 0"),
    ('kv_transfer_port = 9200\n', "settings.toml: kv_transfer_port: unknown key"),  # only KV_TRANSFER_PORT sets it
])
def test_invalid_values_name_file_key_and_problem(tmp_path: Path, text: str, message: str) -> None:
    """A bad value gives one line: file, dotted key, problem."""
    path = _settings(tmp_path, text + '[prefill]\nendpoint = "http://p:8000"\n[decode]\nendpoint = "http://d:8000"\n')
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        router_config.load(path, env={})


def test_keys_file_refuses_literal_keys(tmp_path: Path) -> None:
    """The keys file names env vars; a literal key in it is refused like in settings.toml."""
    (tmp_path / "keys.toml").write_text('[[keys]]\nname = "bob"\nenv = "BOB_KEY"\nkey = "sk-bob-0123456789"\n')
    path = _settings(tmp_path, '[auth]\nkeys_file = "keys.toml"\n[prefill]\nendpoint = "http://p:8000"\n[decode]\nendpoint = "http://p:8000"\n')
    config = router_config.load(path, env={})
    with pytest.raises(ConfigError, match=r"keys\[0\]\.key: looks like an API key"):
        router_config.load_keys_file(config)


def test_main_exits_2_with_one_line_on_bad_config(tmp_path: Path) -> None:
    """`python -m stack.router` with a bad settings file prints one line naming file and key, and exits 2."""
    path = _settings(tmp_path, '[taotoken]\napi_key = "sk-live-0123456789abcdef"\n')
    result = subprocess.run([sys.executable, "-m", "stack.router", "--config", str(path)], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{path}: taotoken.api_key: looks like an API key" in lines[0]
    assert "0123456789abcdef" not in result.stdout + result.stderr


@pytest.mark.parametrize("flag, setting", [("--port", "[server] port"), ("--health-port", "[server] health_port")])
def test_main_on_a_taken_port_exits_2_naming_port_process_and_setting(tmp_path: Path, flag: str, setting: str) -> None:
    """A router started on a port another process listens on prints one line (the port, that process, what to set)
    and exits 2, instead of a bind traceback."""
    path = _settings(tmp_path, f'[server]\nhost = "127.0.0.1"\nport = 0\nhealth_port = 0\n[usage]\ndb_path = "{tmp_path / "u.sqlite3"}"\n'
                                '[prefill]\nendpoint = "http://127.0.0.1:9"\n[decode]\nendpoint = "http://127.0.0.1:9"\n')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "stack.router", "--config", str(path), flag, str(port)],
                                capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert f"port {port} is already in use by " in line and f"(pid {os.getpid()})" in line and setting in line, line


def test_unwritable_usage_db_is_a_config_error(tmp_path: Path) -> None:
    """A usage db the router cannot open stops start-up naming usage.db_path, not with a traceback."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    path = _settings(tmp_path, f'[usage]\ndb_path = "{blocker}/usage.sqlite3"\n'
                               '[prefill]\nendpoint = "http://p:8000"\n[decode]\nendpoint = "http://p:8000"\n')
    config = router_config.load(path, env={})
    with pytest.raises(ConfigError, match=r"settings.toml: usage.db_path: cannot open"):
        create_app(config, env={})
