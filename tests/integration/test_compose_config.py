"""What the compose files resolve to (`docker compose config`): GPU overlays, CPU sets, ports, mounts."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.integration.compose_stack import (
    COLOCATED, DISAGGREGATED, REPO, compose_run, stack_env, unique_project, write_env_file,
)

pytestmark = pytest.mark.integration

GPU = ("compose.yaml", "compose.gpu.yaml")
P2PNCCL = (*GPU, "compose.gpu.p2pnccl.yaml")
VLLM_CPU = ("compose.yaml", "compose.vllm-cpu.yaml")


@pytest.fixture()
def resolve() -> Iterator[Any]:
    """resolve(files, env overrides) -> the merged compose config as a dict."""
    made: list[Path] = []

    def _resolve(files: Sequence[str], env: Mapping[str, str | None] | None = None) -> dict[str, Any]:
        env_file = write_env_file(stack_env(unique_project("pdt-config"), env))
        made.append(env_file)
        return json.loads(compose_run(files, env_file, ["config", "--format", "json"]).stdout)

    yield _resolve
    for path in made:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize(("files", "connector"), [(GPU, "NixlConnector"), (P2PNCCL, "P2pNcclConnector")])
def test_gpu_overlay_validates_with_vllm_and_gpu_reservations(resolve, files, connector) -> None:
    """The GPU overlays resolve: vLLM images, the connector's kv-transfer-config, a GPU each, our router."""
    config = resolve(files)
    for service, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        svc = config["services"][service]
        assert svc["image"].startswith("vllm/vllm-openai")
        assert "build" not in svc  # never build our Dockerfile under vLLM's name
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        kv_config = _kv_config(svc)
        assert kv_config["kv_connector"] == connector
        assert kv_config["kv_role"] == role
    assert config["services"]["router"]["image"] == "pd-deploy/app:latest"


def test_gpu_overlay_gives_nixl_the_same_host_fast_path(resolve) -> None:
    """compose.gpu.yaml: both engines see every GPU and pick their own (CUDA IPC needs mutual visibility), prefill
    lives in decode's PID namespace and is restarted with it, both share the host IPC namespace, and UCX logs the
    lanes it chose (the doctor's evidence of CUDA IPC vs TCP): vllm-project/vllm#55906."""
    services = resolve(GPU, {"PREFILL_GPU": "2", "DECODE_GPU": "3"})["services"]
    prefill, decode = services["prefill"], services["decode"]
    for svc in (prefill, decode):
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["count"] == -1  # count: all
        assert svc["ipc"] == "host"
        assert (svc["environment"]["CUDA_DEVICE_ORDER"], svc["environment"]["UCX_TLS"]) == ("PCI_BUS_ID", "all")
        assert svc["environment"]["UCX_LOG_LEVEL"] == "info"
    assert (prefill["environment"]["CUDA_VISIBLE_DEVICES"], decode["environment"]["CUDA_VISIBLE_DEVICES"]) == ("2", "3")
    assert prefill["pid"] == "service:decode" and "pid" not in decode
    assert prefill["depends_on"]["decode"] == {"condition": "service_healthy", "restart": True, "required": True}


def test_p2pnccl_overlay_pins_the_last_vllm_with_the_connector(resolve) -> None:
    """P2pNcclConnector left vLLM in PR #44854 (after v0.22.1): the overlay pins v0.22.1 on both engines, never
    `latest` (which fails with `Unsupported connector type: P2pNcclConnector`); the NIXL overlay keeps VLLM_IMAGE."""
    services = resolve(P2PNCCL, {"VLLM_IMAGE": "vllm/vllm-openai:v0.33.0"})["services"]
    assert services["prefill"]["image"] == services["decode"]["image"] == "vllm/vllm-openai:v0.22.1"
    assert resolve(GPU, {"VLLM_IMAGE": "vllm/vllm-openai:v0.33.0"})["services"]["decode"]["image"].endswith("v0.33.0")


def test_vllm_cpu_overlay_wires_nixl_side_channels_and_one_core_each(resolve) -> None:
    """compose.vllm-cpu.yaml: our vLLM-CPU image, NixlConnector with KV in host memory, each engine's side channel
    (port 5600) and UCX on the kv network, each engine's OpenMP threads bound to its own core and no cpuset (vLLM's
    NIXL worker pins a thread to the host's last core, which a cpuset without it refuses), the router in vLLM
    mode (the runtime behaviour: tests/vllm/test_overlay.py)."""
    services = resolve(VLLM_CPU, {"PREFILL_CPUS": "1", "DECODE_CPUS": "0"})["services"]
    for name, role, core in (("prefill", "kv_producer", "1"), ("decode", "kv_consumer", "0")):
        svc = services[name]
        assert svc["image"] == "pd-deploy/vllm-cpu:0.32.0" and "build" not in svc
        kv = _kv_config(svc)
        assert (kv["kv_connector"], kv["kv_role"], kv["kv_buffer_device"]) == ("NixlConnector", role, "cpu")
        env = svc["environment"]
        # side channel and UCX on the kv network: the entrypoint takes both from this kv-only alias
        assert (env["VLLM_KV_ALIAS"], env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == (f"{name}-kv", "5600")
        assert svc["networks"]["kv"]["aliases"] == [f"{name}-kv"] and "5600" in svc["expose"]
        assert "VLLM_KV_ALIAS" in svc["entrypoint"][2] and "UCX_NET_DEVICES" in svc["entrypoint"][2]
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == core and "cpuset" not in svc
        assert int(svc["shm_size"]) >= 512 * 2**20
        assert "PD_CHECKPOINT" not in env  # the numpy engine's variables do not reach vLLM
    router = services["router"]["environment"]
    assert (router["KV_CONNECTOR"], router["BACKEND_HEALTH_CHECK"], router["BACKEND_CAPABILITIES"]) == ("nixl", "http", "vllm")
    assert services["prefill"]["depends_on"]["decode"]["condition"] == "service_healthy"
    default = resolve(VLLM_CPU)["services"]
    # decode away from the host's last core, where both engines' NIXL workers spin a thread
    assert [default[n]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] for n in ("prefill", "decode")] == ["1", "0"]


def _kv_config(service: dict[str, Any]) -> dict[str, Any]:
    return json.loads(next(a for a in service["command"] if a.startswith("--kv-transfer-config=")).split("=", 1)[1])


def test_p2pnccl_engines_register_at_the_router_address_they_are_given(resolve) -> None:
    """P2pNccl: each engine pings the router's fixed address and registry port, announces the fixed address it
    really has (VLLM_HOST_IP), and keeps request ids unrandomized; the router runs its registry on that port."""
    services = resolve(P2PNCCL, {"P2P_SUBNET": "10.77.0.0/24", "P2P_ROUTER_IP": "10.77.0.2", "P2P_PREFILL_IP": "10.77.0.11",
                                 "P2P_DECODE_IP": "10.77.0.12"})["services"]
    router = services["router"]
    assert router["environment"]["P2PNCCL_REGISTRY_PORT"] == "30001"
    for name, address in (("prefill", "10.77.0.11"), ("decode", "10.77.0.12")):
        extra = _kv_config(services[name])["kv_connector_extra_config"]
        assert (extra["proxy_ip"], extra["proxy_port"]) == (router["networks"]["p2p"]["ipv4_address"], "30001")
        assert services[name]["networks"]["p2p"]["ipv4_address"] == services[name]["environment"]["VLLM_HOST_IP"] == address
        assert services[name]["environment"]["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] == "1"


def test_cpu_sets_come_from_env_and_are_absent_when_unset(resolve) -> None:
    """PREFILL/DECODE/ENGINE_CPUS pin cores (same cores for both stacks); unset means no cpuset at all."""
    pinned = {"PREFILL_CPUS": "0", "DECODE_CPUS": "1", "ENGINE_CPUS": "0-1", "ROUTER_CPUS": "0-1"}
    disaggregated = resolve(DISAGGREGATED, pinned)["services"]
    colocated = resolve(COLOCATED, pinned)["services"]
    assert (disaggregated["prefill"]["cpuset"], disaggregated["decode"]["cpuset"]) == ("0", "1")
    assert colocated["engine"]["cpuset"] == "0-1"
    assert disaggregated["router"]["cpuset"] == colocated["router"]["cpuset"] == "0-1"
    unpinned = resolve(DISAGGREGATED)["services"]
    assert all("cpuset" not in svc for svc in unpinned.values())


def test_colocated_router_is_the_same_service_on_the_same_port(resolve) -> None:
    """The colocated router keeps the port, key and config; only its endpoints point at the one engine."""
    env = {"ROUTER_PORT": "18765", "TAOTOKEN_API_KEY": "sk-same"}
    disaggregated = resolve(DISAGGREGATED, env)["services"]["router"]
    colocated = resolve(COLOCATED, env)["services"]["router"]
    for router in (disaggregated, colocated):
        assert [(p["target"], p["published"]) for p in router["ports"]] == [(8080, "18765")]
        assert router["environment"]["TAOTOKEN_API_KEY"] == "sk-same"
        assert router["command"] == disaggregated["command"]
    assert colocated["environment"]["PREFILL_ENDPOINT"] == colocated["environment"]["DECODE_ENDPOINT"] == "http://engine:8000"


def test_checkpoint_dir_is_mounted_read_only_in_every_engine(resolve, tmp_path) -> None:
    """PD_CHECKPOINT_DIR binds a host directory read-only at /models in prefill and decode."""
    services = resolve(DISAGGREGATED, {"PD_CHECKPOINT_DIR": str(tmp_path)})["services"]
    for name in ("prefill", "decode"):
        mount = next(v for v in services[name]["volumes"] if v["target"] == "/models")
        assert (mount["type"], mount["source"], mount["read_only"]) == ("bind", str(tmp_path), True)


def test_env_file_variables_reach_the_router_only(resolve) -> None:
    """A key added to the env file for a keys-file entry reaches the router (both stacks), not the engines."""
    for files in (DISAGGREGATED, COLOCATED):
        services = resolve(files, {"ALICE_KEY": "sk-alice-0123456789"})["services"]
        assert services["router"]["environment"]["ALICE_KEY"] == "sk-alice-0123456789"
    services = resolve(DISAGGREGATED, {"ALICE_KEY": "sk-alice-0123456789"})["services"]
    assert all("ALICE_KEY" not in (services[name].get("environment") or {}) for name in ("prefill", "decode"))


CONFIG_FOLDERS = {"prefill", "decode", "colocated", "router"}
CONFIG_SUFFIXES = {".json", ".toml"}
SCENARIO_OVERLAYS = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "integration").glob("*/*.yaml"))


def _bind_sources(services: dict[str, Any]) -> dict[str, list[Path]]:
    return {name: [Path(v["source"]) for v in svc.get("volumes", []) if v["type"] == "bind"] for name, svc in services.items()}


def _config_only(folder: Path) -> bool:
    return all(p.is_file() and p.suffix in CONFIG_SUFFIXES for p in folder.iterdir())


@pytest.mark.parametrize("files", [DISAGGREGATED, COLOCATED, GPU, P2PNCCL, VLLM_CPU])
def test_each_service_mounts_its_config_folder_and_no_source_folder(resolve, files) -> None:
    """/config is the top-level folder named after the service's role (the article's tree); no bind mount
    reaches into the code (stack/, doctor/)."""
    services = resolve(files)["services"]
    expected = {"prefill": "prefill", "decode": "decode", "engine": "colocated", "router": "router"}
    for name, svc in services.items():
        config = next(v for v in svc["volumes"] if v["target"] == "/config")
        assert (config["type"], Path(config["source"]), config["read_only"]) == ("bind", REPO / expected[name], True)
    for name, sources in _bind_sources(services).items():
        inside = [s.relative_to(REPO).parts[0] for s in sources if s.is_relative_to(REPO)]
        assert set(inside) <= CONFIG_FOLDERS, f"{name} mounts {sources}"
        assert all(_config_only(s) for s in sources), f"{name} mounts a folder with more than config: {sources}"


@pytest.mark.parametrize("overlay", SCENARIO_OVERLAYS)
def test_test_overlays_mount_config_folders_only(resolve, overlay, tmp_path) -> None:
    """Scenario and fixture overlays swap a /config for a folder of JSON, never for code."""
    services = resolve((*DISAGGREGATED, overlay), {"PD_TEST_DECODE_CONFIG_DIR": str(tmp_path)})["services"]
    for name, sources in _bind_sources(services).items():
        for source in sources:
            assert not {"stack", "doctor"} & set(source.parts), f"{overlay}: {name} mounts {source}"
            assert _config_only(source), f"{overlay}: {name} mounts {source}, which holds more than config"


def test_kv_transfer_port_is_the_one_override_and_reaches_decode(resolve) -> None:
    """KV_TRANSFER_PORT sets decode's KV listener (its environment, and the exposed port); the router is told
    nothing in compose.yaml and gets the variable only as part of the env file, so the two cannot differ.
    Unset, decode keeps kv_port from decode/config.json, which is also what it exposes."""
    services = resolve(DISAGGREGATED, {"KV_TRANSFER_PORT": "9300"})["services"]
    assert services["decode"]["environment"]["KV_TRANSFER_PORT"] == "9300"
    assert "9300" in services["decode"]["expose"]
    assert "KV_TRANSFER_PORT" not in services["prefill"]["environment"]
    assert services["router"]["environment"]["KV_TRANSFER_PORT"] == "9300"  # from the env file, like ALICE_KEY
    colocated = resolve(COLOCATED, {"KV_TRANSFER_PORT": "9300"})["services"]
    assert "KV_TRANSFER_PORT" not in colocated["engine"]["environment"]  # one engine: no KV listener

    unset = resolve(DISAGGREGATED)["services"]
    assert unset["decode"]["environment"]["KV_TRANSFER_PORT"] is None  # compose drops it: the config's kv_port applies
    assert "KV_TRANSFER_PORT" not in unset["router"]["environment"]
    shipped = json.loads((REPO / "decode" / "config.json").read_text())["kv_transfer_config"]["kv_port"]
    assert str(shipped) in unset["decode"]["expose"]


def test_gpu_images_are_the_vllm_version_the_cpu_tier_tests(resolve) -> None:
    """The GPU overlay and the Kubernetes GPU overlay default to the vLLM release the CPU tier installs and tests
    (scripts/vllm-cpu.sh VLLM_VERSION), never a moving `latest`."""
    version = re.search(r"^VLLM_VERSION=(\S+)$", (REPO / "scripts" / "vllm-cpu.sh").read_text(), re.M).group(1)
    for service in ("prefill", "decode"):
        assert resolve(GPU)["services"][service]["image"] == f"vllm/vllm-openai:v{version}"
    k8s = (REPO / "deploy" / "k8s" / "overlays" / "vllm-gpu" / "vllm-engine.yaml").read_text()
    assert re.search(rf"value: vllm/vllm-openai:v{re.escape(version)}\b", k8s)
