"""Every fix text names only things that exist: compose services, networks and files of the shipped stack."""

from __future__ import annotations

import re
from pathlib import Path

from doctor import stackfacts
from tests.unit.doctor.helpers import diagnose

REPO = Path(__file__).resolve().parents[3]
_COMPOSE = re.compile(r"docker compose (?:up|restart|ps|logs|exec|stop|start)\b((?:\s+[^\s;|&'\"]+)*)")
_NETWORK = re.compile(r"docker network (?:inspect|connect|disconnect) (\S+)")
_FILE = re.compile(r"\b((?:prefill|decode|router|colocated)/[\w.-]+\.(?:json|toml))\b")
VERBS_WITH_VALUE = {"--tail", "--since"}


def named_services(fix: str) -> set[str]:
    """The service names after each `docker compose <verb>` (options and their values skipped)."""
    names: set[str] = set()
    for match in _COMPOSE.finditer(fix):
        tokens, skip = match.group(1).split(), False
        for token in tokens:
            if skip:
                skip = False
            elif token.startswith("-"):
                skip = token in VERBS_WITH_VALUE
            elif re.fullmatch(r"[a-z][a-z0-9-]*", token):
                names.add(token)
            else:
                break
            if token in ("sh", "python"):  # exec's command starts: the service came before it
                break
    return names - {"sh", "python"}


def every_fix(bundles: Path) -> list[tuple[str, str]]:
    env_cases = [{}, {"ANTHROPIC_AUTH_TOKEN": "a", "ANTHROPIC_API_KEY": "b", "TAOTOKEN_API_KEY": "a"},
                 {"HTTP_PROXY": "http://127.0.0.1:9", "OPENAI_BASE_URL": "http://localhost:8000/v1"}]
    fixes = []
    for log in sorted(p for p in bundles.iterdir() if p.suffix == ".log" or p.is_dir()):
        for env in env_cases:
            findings, _ = diagnose(log, environ=env)
            fixes += [(f.id, f.fix) for f in findings]
    return fixes


def test_every_service_network_and_file_a_fix_names_exists(bundles):
    """Across every bundle: `docker compose … <service>`, `docker network inspect <net>` and config paths are real."""
    facts = stackfacts.shipped()
    networks = {n for nets in facts.networks.values() for n in nets}
    fixes = every_fix(bundles)
    assert len({fid for fid, _ in fixes}) > 20  # the test sees most findings
    for fid, fix in fixes:
        assert named_services(fix) <= set(facts.services), (fid, fix)
        for net in _NETWORK.findall(fix):
            assert net in networks, (fid, net)
        for path in _FILE.findall(fix):
            assert (REPO / path).is_file(), (fid, path)


def test_the_kv_network_is_the_real_one(bundles):
    """kv.unreachable names pd-deploy_kv (the network prefill and decode share), not a `<project>_default`."""
    findings, _ = diagnose(bundles / "kv_unreachable.log")
    fix = next(f.fix for f in findings if f.id == "kv.unreachable")
    assert "docker network inspect pd-deploy_kv" in fix and "_default" not in fix


def test_quota_fix_points_at_the_keys_file_and_usage(bundles):
    """The quota lives in the keys file and /v1/usage shows it (not /metrics)."""
    findings, _ = diagnose(bundles / "auth_mixed.log")
    fix = next(f.fix for f in findings if f.id == "limit.quota_exhausted")
    assert "/v1/usage" in fix and "keys file" in fix and "/metrics" not in fix
