"""The Grafana provisioning JSON: current with its definition, well-formed, and every name it uses exists.

Grafana cannot run here, so its structure is checked directly (the integration test runs every
panel's PromQL against a real Prometheus), and each metric a panel or rule names is checked against
what the router and engines really expose, so a typo cannot hide behind an empty panel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from observability import dashboards
from stack.engine.metrics import EngineMetrics
from stack.router.metrics import SLO, Metrics

REPO = Path(__file__).resolve().parents[3]
GRAFANA = REPO / "observability" / "grafana"
RULES = REPO / "observability" / "prometheus" / "rules"
FILES = sorted((GRAFANA / "dashboards").glob("*.json"))
PROMQL_WORDS = {"sum", "by", "rate", "increase", "delta", "histogram_quantile", "max", "min", "avg", "on", "or", "vector",
                "clamp_min", "scalar", "absent", "label_replace", "count", "up", "le", "and", "unless", "without", "bool"}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_committed_json_is_what_the_definitions_render() -> None:
    """observability/grafana/dashboards/*.json == `python -m observability.dashboards` output (rerun it after editing)."""
    rendered = dashboards.render_all()
    assert sorted(rendered) == [p.name for p in FILES]
    for path in FILES:
        assert path.read_text() == rendered[path.name], f"{path.name} is stale: run python -m observability.dashboards"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_dashboard_structure(path: Path) -> None:
    """Unique uid/panel ids/refIds, the provisioned datasource uid everywhere, a non-empty expr per target, no overlapping panels."""
    board = load(path)
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert board["uid"] == path.stem and board["title"] and board["schemaVersion"] >= 36
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and ids, "panel ids must be unique"
    cells = set()
    for panel in board["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": datasource["uid"]}
        assert panel["type"] == "timeseries" and panel["title"] and panel["fieldConfig"]["defaults"]["unit"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"] and target["expr"].strip(), panel["title"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
        g = panel["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
    role = [v for v in board["templating"]["list"] if v["name"] == "role"]
    uses_role = any("$role" in t["expr"] for p in board["panels"] for t in p["targets"])
    assert bool(role) == uses_role, "a $role variable exactly where panels use it"


def exposed_names() -> set[str]:
    """Every metric name the router and engines expose (histograms with their _bucket/_sum/_count)."""
    router, engine = Metrics(SLO()), EngineMetrics("m")
    router.add_key_gauges(lambda: [], None, None)  # type: ignore[arg-type]
    names = set(router._gauge_help) | set(engine._gauge_help)
    names |= {"pd_router_backend_up", "pd_router_backend_in_flight", "pd_router_backend_outstanding_tokens",
              "pd_router_backend_circuit", "pd_router_queue_depth", "pd_router_pool_backends", "pd_router_pool_up"}  # monitor.py's gauges
    for owner in (router, engine):
        for metric in vars(owner).values():
            if hasattr(metric, "buckets"):
                names |= {metric.name + s for s in ("_bucket", "_sum", "_count")}
            elif hasattr(metric, "values") and hasattr(metric, "name"):
                names.add(metric.name)
    return names


def recorded() -> set[str]:
    return {r["record"] for f in RULES.glob("*.yml") for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"] if "record" in r}


def metric_names(expr: str) -> set[str]:
    """Metric-looking identifiers in a PromQL expression (not functions, keywords, label names or strings)."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers
    expr = re.sub(r"\b(by|on|without)\s*\([^)]*\)", "", expr)  # grouping labels
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {w for w in words if w not in PROMQL_WORDS and not re.fullmatch(r"e\d*|Inf|NaN", w)}


def test_every_name_in_panels_and_rules_is_exposed_or_recorded() -> None:
    """Each metric a panel or rule reads is a real exposed series or a recording rule defined in observability/prometheus."""
    known = exposed_names() | recorded()
    exprs = [t["expr"] for p in FILES for panel in load(p)["panels"] for t in panel["targets"]]
    exprs += [r["expr"] for f in RULES.glob("*.yml") for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]]
    unknown = {name: e for e in exprs for name in metric_names(e) if name not in known}
    assert not unknown, unknown
