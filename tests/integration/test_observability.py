"""The observability overlay on a real stack: Prometheus scrapes router + engines, rules and dashboards work, alerts fire.

One stack (compose.yaml + compose.observability.yaml, dummy:tiny) for the module, with the shipped
Prometheus config made fast for tests (1 s scrape/eval, 2 s DNS refresh, every `for:` 2 s), a
short load of streamed chats (plus some 401s), then: every target healthy; every dashboard query
non-empty; the PNG rendered; and, last, decode killed → PDPoolEmpty fires. promtool (inside the
Prometheus image) checks the shipped config and rules, lints both /metrics bodies, and unit-tests
every alert on synthetic series (tests/unit/observability/alerts_test.yml).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from observability import panels
from observability.dashboards import DASHBOARDS
from tests.integration.compose_stack import REPO, Stack, free_port, parse_ts, start_stack, unique_project

pytestmark = pytest.mark.integration

FILES = ("compose.yaml", "compose.observability.yaml")
PROMETHEUS_DIR = REPO / "observability" / "prometheus"
ALERTS_TEST = REPO / "tests" / "unit" / "observability" / "alerts_test.yml"
PROMPT = [{"role": "user", "content": "tell me about disaggregated prefill"}]
ALL_ROLES = "prefill|decode|engine"  # the dashboards' $role "All" value


def prometheus_image() -> str:
    return subprocess.run([str(REPO / "scripts" / "prometheus-image.sh")], check=True, capture_output=True, text=True).stdout.strip()


def promtool(image: str, *args: str, mounts: dict[Path, str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    volumes = [a for host, inside in mounts.items() for a in ("-v", f"{host}:{inside}:ro")]
    return subprocess.run(["docker", "run", "--rm", "-i", *volumes, "--entrypoint", "promtool", image, *args],
                          input=stdin, capture_output=True, text=True)


def fast_config(src: Path, dst: Path) -> Path:
    """The shipped config with test intervals: 1 s scrape/eval, 2 s DNS refresh, every `for:` 2 s."""
    shutil.copytree(src, dst)
    for main in dst.glob("prometheus*.yml"):
        text = re.sub(r"(scrape|evaluation)_interval: \S+", r"\1_interval: 1s", main.read_text())
        main.write_text(text.replace("refresh_interval: 10s", "refresh_interval: 2s"))
    for rules in (dst / "rules").glob("*.yml"):
        rules.write_text(re.sub(r"for: \S+", "for: 2s", rules.read_text()))
    dst.chmod(0o755)
    return dst


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: Any) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=30) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.get("/api/v1/query", query=expr)["result"]

    def wait(self, what: str, check, timeout_s: float) -> Any:
        """Poll `check()` until it returns something truthy; fail with `what` and the last value."""
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(1)
        pytest.fail(f"{what} not seen within {timeout_s} s; last: {last}")


@pytest.fixture(scope="module")
def obs_stack(app_image: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Prometheus]]:
    prometheus_image()
    config = fast_config(PROMETHEUS_DIR, tmp_path_factory.mktemp("prom") / "prometheus")
    port = free_port()
    stack = start_stack(unique_project("pdt-obs"), FILES, env={
        "PROMETHEUS_CONFIG_DIR": str(config), "PROMETHEUS_PORT": str(port),
        "PD_SLO_TTFT_MS": "5000", "PD_SLO_TPOT_MS": "1000",
    })
    try:
        yield stack, Prometheus(f"http://127.0.0.1:{port}")
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def loaded(obs_stack: tuple[Stack, Prometheus]) -> tuple[Stack, Prometheus]:
    """A short load: 4 clients streaming chats for ~20 s, and a few requests with a wrong key (401)."""
    stack, prom = obs_stack
    client = openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0, timeout=60)
    stop = time.monotonic() + 20
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while time.monotonic() < stop:
                stream = client.chat.completions.create(model="your-model-id", messages=PROMPT, max_tokens=12, stream=True)
                assert sum(1 for _ in stream) > 0
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    bad = openai.OpenAI(base_url=stack.base_url, api_key="sk-wrong", max_retries=0)
    for _ in range(3):
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return stack, prom


def test_shipped_config_and_rules_are_valid() -> None:
    """promtool check config (which checks the rule files it names) and check rules pass on observability/prometheus."""
    image = prometheus_image()
    mounts = {PROMETHEUS_DIR: "/etc/prometheus"}
    config = promtool(image, "check", "config", "/etc/prometheus/prometheus.yml", mounts=mounts)
    assert config.returncode == 0, config.stdout + config.stderr
    rules = sorted(p.name for p in (PROMETHEUS_DIR / "rules").glob("*.yml"))
    checked = promtool(image, "check", "rules", *[f"/etc/prometheus/rules/{r}" for r in rules], mounts=mounts)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("SUCCESS") == len(rules)


def test_alert_rules_fire_on_synthetic_series() -> None:
    """promtool test rules: each alert fires on the series that should trigger it and stays quiet otherwise."""
    image = prometheus_image()
    result = promtool(image, "test", "rules", "/tests/alerts_test.yml",
                      mounts={PROMETHEUS_DIR / "rules": "/etc/prometheus/rules", ALERTS_TEST.parent: "/tests"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_all_targets_healthy(obs_stack: tuple[Stack, Prometheus]) -> None:
    """Prometheus finds router, prefill and decode by compose DNS and scrapes each with health up."""
    _, prom = obs_stack

    def healthy() -> dict[str, str] | None:
        targets = {t["labels"]["job"]: t["health"] for t in prom.get("/api/v1/targets")["activeTargets"]}
        return targets if set(targets) >= {"router", "prefill", "decode"} and set(targets.values()) == {"up"} else None

    targets = prom.wait("every target up", healthy, 60)
    assert set(targets) == {"router", "prefill", "decode", "prometheus"}


def test_metrics_bodies_pass_promtool_lint(obs_stack: tuple[Stack, Prometheus]) -> None:
    """The router's and an engine's /metrics parse as Prometheus text (promtool check metrics: no errors)."""
    stack, prom = obs_stack
    image = prometheus_image()
    with urllib.request.urlopen(f"{stack.router_url}/metrics", timeout=10) as response:
        router_body = response.read().decode()
    engine = stack.container("decode").exec_run(["python", "-c", "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/metrics').read().decode())"])
    assert engine.exit_code == 0, engine.output
    for name, body in (("router", router_body), ("decode", engine.output.decode())):
        lint = promtool(image, "check", "metrics", mounts={}, stdin=body)
        # Lint findings (e.g. naming advice for vLLM's `vllm:` names) are warnings; a parse error is not.
        assert "error while linting" not in lint.stderr and "text format parsing error" not in lint.stderr, f"{name}: {lint.stderr}"
    assert "vllm:num_requests_running{" in engine.output.decode()


def test_every_dashboard_query_returns_data(loaded: tuple[Stack, Prometheus]) -> None:
    """After the load, every target of every dashboard panel returns at least one series ($role = both roles)."""
    _, prom = loaded
    missing: dict[str, str] = {}
    deadline = time.monotonic() + 60  # rates need two scrapes, recording rules one evaluation after that
    for uid, (_, panel_list) in DASHBOARDS.items():
        for panel in panel_list:
            for expr, _legend in panel.targets:
                query = expr.replace("$role", ALL_ROLES)
                while not (found := prom.query(query)) and time.monotonic() < deadline:
                    time.sleep(1)
                if not found:
                    missing[f"{uid} / {panel.title}"] = query
    assert not missing, f"panels without data: {json.dumps(missing, indent=1)}"
    kv = prom.query('pd:kv_transfer_bytes:rate1m{side="send"}')
    assert float(kv[0]["value"][1]) > 0, "prefill pushed KV during the load"


def test_panels_png_from_live_prometheus(loaded: tuple[Stack, Prometheus], tmp_path: Path) -> None:
    """python -m observability.panels renders the key panels from this Prometheus into a non-trivial PNG."""
    _, prom = loaded
    out = tmp_path / "overview.png"
    assert panels.main(["--prometheus", prom.url, "--minutes", "3", "--step", "2", "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000, f"PNG of {len(data)} bytes: panels are probably empty"


def test_killing_decode_fires_backend_down(loaded: tuple[Stack, Prometheus]) -> None:
    """docker kill decode → the router's pool has no decode up (it leaves the discover pool, or its probe marks it
    down first) → PDPoolEmpty{role=decode} fires (for: 2 s in tests)."""
    stack, prom = loaded
    stack.container("decode").kill()

    def firing() -> list[dict[str, Any]]:
        alerts = prom.get("/api/v1/alerts")["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "PDPoolEmpty" and a["labels"].get("role") == "decode" and a["state"] == "firing"]

    alert = prom.wait("PDPoolEmpty firing for decode", firing, 60)[0]
    assert alert["labels"]["severity"] == "critical"


def test_scaled_decode_replicas_are_discovered(loaded: tuple[Stack, Prometheus]) -> None:
    """`up --scale decode=2`: compose DNS gives Prometheus both replicas as targets, without a config change."""
    stack, prom = loaded
    stack.run("up", "--detach", "--wait", "--no-deps", "--no-recreate", "--scale", "decode=2", "decode")

    def two_decodes_up() -> list[str]:
        targets = [t for t in prom.get("/api/v1/targets")["activeTargets"] if t["labels"]["job"] == "decode" and t["health"] == "up"]
        return [t["labels"]["instance"] for t in targets] if len(targets) == 2 else []

    instances = prom.wait("two decode targets up", two_decodes_up, 60)
    assert len(set(instances)) == 2


def test_colocated_overlay_scrapes_router_and_engine(app_image: None, tmp_path: Path) -> None:
    """compose.colocated.observability.yaml: Prometheus scrapes router + the one engine (job engine); no role alert fires."""
    prometheus_image()
    config = fast_config(PROMETHEUS_DIR, tmp_path / "prometheus")
    port = free_port()
    stack = start_stack(unique_project("pdt-obs-colo"), ("compose.colocated.yaml", "compose.colocated.observability.yaml"),
                        env={"PROMETHEUS_CONFIG_DIR": str(config), "PROMETHEUS_PORT": str(port)})
    try:
        prom = Prometheus(f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=stack.base_url, api_key=stack.api_key, max_retries=0, timeout=60)
        for _ in range(3):
            assert sum(1 for _ in client.chat.completions.create(model="your-model-id", messages=PROMPT, max_tokens=8, stream=True)) > 0

        def scraped() -> dict[str, str] | None:
            targets = {t["labels"]["job"]: t["health"] for t in prom.get("/api/v1/targets")["activeTargets"]}
            return targets if set(targets) == {"router", "engine", "prometheus"} and set(targets.values()) == {"up"} else None

        prom.wait("router and engine scraped", scraped, 60)
        scraped_at = time.time()
        prom.wait("engine utilisation recorded", lambda: prom.query('pd:role_utilisation{job="engine"}'), 30)
        prom.wait("TTFT P99 recorded", lambda: prom.query("pd:ttft_seconds:p99"), 30)

        def alerts_evaluated_past_for() -> bool:  # a wrongly firing PDRoleNotScraped (for: 2s) would show by then
            groups = prom.get("/api/v1/rules", type="alert")["groups"]
            last = next(g["lastEvaluation"] for g in groups if g["name"] == "pd-alerts")
            return parse_ts(last).timestamp() > scraped_at + 3

        prom.wait("the alert group evaluated 3 s after the targets were up", alerts_evaluated_past_for, 30)
        alerts = [a["labels"] for a in prom.get("/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == "PDRoleNotScraped"]
        assert not alerts, alerts
    finally:
        stack.stop()
