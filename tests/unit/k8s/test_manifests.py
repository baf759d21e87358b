"""deploy/k8s renders (tests/unit/k8s/kustomize.py), every object validates against the Kubernetes 1.37 schemas, and the
wiring holds: selectors match pods, Services and probes name real ports, the ports are the ones the configs set, only
prefill reaches decode's KV port, keys come from the Secret, and the GPU overlay runs vLLM as compose.gpu.yaml does.
Nothing here runs on a cluster (there is none): README "Outgrowing one machine" gives the commands a user runs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from stack.engine.config import load_config
from stack.router import config as router_config
from tests.unit.k8s.kustomize import Obj, build, by_kind, containers

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "deploy/k8s"
VARIANTS = {"base": K8S / "base", "vllm-gpu": K8S / "overlays/vllm-gpu"}
KUBERNETES = "1.37.0"
SECRET_ENV = {"TAOTOKEN_API_KEY", "PD_INTERNAL_KEY", "VLLM_API_KEY", "HF_TOKEN"}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    return request.param, build(VARIANTS[request.param])


def workloads(objects: list[Obj]) -> dict[str, Obj]:
    return {**by_kind(objects, "Deployment"), **by_kind(objects, "StatefulSet")}


def pod_labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def named_ports(workload: Obj) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in containers(workload) for p in c.get("ports", [])}


def reachable(objects: list[Obj], source: Obj, target: Obj, port: int) -> bool:
    """Does NetworkPolicy let `source`'s pods open TCP `port` on `target`'s pods? (Ingress rules; pod selectors only.)"""
    policies = [p for p in by_kind(objects, "NetworkPolicy").values() if matches(p["spec"]["podSelector"]["matchLabels"], pod_labels(target))]
    if not policies:
        return True  # no policy selects the pod: everything may reach it
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            from_ok = any(matches(peer["podSelector"]["matchLabels"], pod_labels(source)) for peer in rule.get("from", []))
            ports = rule.get("ports")
            if from_ok and (ports is None or any(p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in ports)):
                return True
    return False


def test_every_object_validates_against_the_kubernetes_schemas(rendered: tuple[str, list[Obj]]) -> None:
    """Strict schema validation (unknown fields are errors) of every rendered object, base and GPU overlay."""
    _, objects = rendered
    assert len(objects) >= 12
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_a_wrong_field_is_caught_by_the_validation() -> None:
    """The validator is not a rubber stamp: a misspelt probe field in a rendered Deployment fails it."""
    decode = by_kind(build(VARIANTS["base"]), "Deployment")["decode"]
    decode["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 3
    with pytest.raises(kubernetes_validate.ValidationError, match="periodSecond"):
        kubernetes_validate.validate(decode, KUBERNETES, strict=True)


def test_selectors_services_and_probes_are_wired(rendered: tuple[str, list[Obj]]) -> None:
    """Each workload's selector matches its own pods; each Service selects exactly one workload and targets its named
    ports; every container is probed for start-up, readiness and liveness on ports it exposes; engine pools are headless."""
    _, objects = rendered
    pods = workloads(objects)
    for name, workload in pods.items():
        assert matches(workload["spec"]["selector"]["matchLabels"], pod_labels(workload)), name
        for container in containers(workload):
            for probe in ("startupProbe", "readinessProbe", "livenessProbe") if name != "redis" else ("readinessProbe", "livenessProbe"):
                spec = container[probe]
                port = (spec.get("grpc") or spec.get("httpGet") or {}).get("port")
                assert spec.get("exec") or port in named_ports(workload) or port in named_ports(workload).values(), (name, probe)
            assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"], name
    for name, service in by_kind(objects, "Service").items():
        selected = [w for w, workload in pods.items() if matches(service["spec"]["selector"], pod_labels(workload))]
        assert len(selected) == 1, (name, selected)
        ports = named_ports(pods[selected[0]])
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports and ports[port["targetPort"]] == port["port"], (name, port)
    assert {n for n, s in by_kind(objects, "Service").items() if s["spec"].get("clusterIP") == "None"} == {"prefill-headless", "decode-headless"}


def test_only_prefill_reaches_the_kv_port(rendered: tuple[str, list[Obj]]) -> None:
    """The KV port (ours: decode's 9100, where prefill pushes; NIXL: decode's side channel 5600) admits prefill and
    nobody else; prefill's HTTP admits the router (and under NIXL decode, which pulls the KV from prefill on ports UCX
    picks); Redis admits only the router."""
    variant, objects = rendered
    pods = workloads(objects)
    kv_port = 9100 if variant == "base" else 5600
    assert [name for name, pod in pods.items() if reachable(objects, pod, pods["decode"], kv_port)] == ["prefill"]
    pullers = ["router"] if variant == "base" else ["decode", "router"]
    assert sorted(name for name, pod in pods.items() if reachable(objects, pod, pods["prefill"], 8000)) == pullers
    assert [name for name, pod in pods.items() if reachable(objects, pod, pods["redis"], 6379)] == ["router"]
    assert not reachable(objects, pods["router"], pods["decode"], kv_port)


def test_ports_are_the_ones_the_configs_set(tmp_path: Path) -> None:
    """decode.json's kv_port is the container's, the Service's and the NetworkPolicy's KV port; the engines' command
    lines match their container ports; the router's settings (which its real loader accepts) match its ports, its
    pools name the headless Services' HTTP port, and its Redis is the redis Service."""
    objects = build(VARIANTS["base"])
    pods, services, maps = workloads(objects), by_kind(objects, "Service"), by_kind(objects, "ConfigMap")
    decode_json = K8S / "base/config/decode.json"
    decode_config, _ = load_config(decode_json, env={})
    kv = decode_config.kv_transfer_config.kv_port
    assert named_ports(pods["decode"])["kv"] == kv
    decode_env = {e["name"]: e for e in containers(pods["decode"])[0]["env"]}
    assert decode_env["KV_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"  # a KV address prefill can reach
    assert {p["name"]: p["port"] for p in services["decode-headless"]["spec"]["ports"]}["kv"] == kv
    kv_rule = by_kind(objects, "NetworkPolicy")["decode-ingress"]["spec"]["ingress"][1]
    assert [p["port"] for p in kv_rule["ports"]] == [kv]
    load_config(K8S / "base/config/prefill.json", env={})
    assert maps["decode-config"]["data"]["config.json"] == decode_json.read_text()
    for role in ("prefill", "decode"):
        command = containers(pods[role])[0]["command"]
        assert (int(command[command.index("--port") + 1]), int(command[command.index("--health-port") + 1])) == \
            (named_ports(pods[role])["http"], named_ports(pods[role])["grpc-health"])
    settings_text = maps["router-config"]["data"]["settings.toml"]
    settings = tomllib.loads(settings_text)
    for role in ("prefill", "decode"):
        host, port = re.fullmatch(r"dns://([a-z0-9-]+):(\d+)", settings[role]["discover"]).groups()
        assert host == f"{role}-headless" and int(port) == named_ports(pods[role])["http"]
    path = tmp_path / "settings.toml"
    path.write_text(settings_text)
    config = router_config.load(path, env={})
    assert {role: getattr(config, role).discover for role in ("prefill", "decode")} == \
        {role: settings[role]["discover"] for role in ("prefill", "decode")}
    assert (config.server.port, config.server.health_port) == (named_ports(pods["router"])["http"], named_ports(pods["router"])["grpc-health"])
    redis_host = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)/\d+", config.limits_store.redis_url).groups()
    assert redis_host == ("redis", str(services["redis"]["spec"]["ports"][0]["port"]))
    assert config.usage.db_path.startswith("/app/data/")  # the router's writable volume (the root filesystem is read-only)
    router_mounts = {m["mountPath"] for m in containers(pods["router"])[0]["volumeMounts"]}
    assert "/app/data" in router_mounts


def test_keys_come_from_the_secret_and_are_never_inlined(rendered: tuple[str, list[Obj]]) -> None:
    """No Secret object (the user creates pd-keys), every key variable is a secretKeyRef to pd-keys, no env value or
    config looks like a key."""
    _, objects = rendered
    assert not [obj for obj in objects if obj["kind"] == "Secret"]
    secret_like = re.compile(r"(sk-[A-Za-z0-9_\-]{6,}|[A-Za-z0-9]{32,})")
    referenced = set()
    for workload in workloads(objects).values():
        for container in containers(workload):
            for env in container.get("env", []):
                if env["name"] in SECRET_ENV:
                    assert env["valueFrom"]["secretKeyRef"]["name"] == "pd-keys", env
                    referenced.add(env["name"])
                else:
                    assert not secret_like.search(str(env.get("value", ""))), env
    assert {"TAOTOKEN_API_KEY", "PD_INTERNAL_KEY"} <= referenced
    for config_map in by_kind(objects, "ConfigMap").values():
        for text in config_map["data"].values():
            assert not secret_like.search(text), config_map["metadata"]["name"]


def _compose_gpu() -> dict[str, Any]:
    return yaml.safe_load(re.sub(r"!(reset|override)\b", "", (REPO / "compose.gpu.yaml").read_text()))


def _resolved(arg: str) -> str:
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)  # compose's ${VAR:-default} with VAR unset


def test_gpu_overlay_runs_vllm_as_compose_gpu_does() -> None:
    """Prefill and decode run `vllm serve` with compose.gpu.yaml's arguments (model, port, served name, the NixlConnector
    kv-transfer-config and its role), one nvidia.com/gpu each, probed on vLLM's GET /health; the router gets the same
    BACKEND_HEALTH_CHECK, BACKEND_CAPABILITIES and KV_CONNECTOR as in compose.gpu.yaml."""
    objects, compose = build(VARIANTS["vllm-gpu"]), _compose_gpu()
    pods = workloads(objects)
    for role in ("prefill", "decode"):
        container = containers(pods[role])[0]
        assert container["command"] == compose["x-vllm"]["entrypoint"]
        assert container["args"] == [_resolved(arg) for arg in compose["services"][role]["command"]]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        env = {e["name"]: e for e in container["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == compose["x-vllm"]["environment"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    router_env = {e["name"]: e.get("value") for e in containers(pods["router"])[0]["env"]}
    assert {k: router_env[k] for k in compose["services"]["router"]["environment"]} == compose["services"]["router"]["environment"]
