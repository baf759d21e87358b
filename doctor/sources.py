"""Where log lines come from: the running compose project (Docker API), files/folders, stdin.

A compose project is found through container labels (`com.docker.compose.project` with services
router/prefill/decode/engine) or named with `--project`. Files may be `docker compose logs` output
(v1 or v2 prefixes, with or without --timestamps) or raw JSON lines, one file per service or mixed;
a file named after a service (router.log, decode.jsonl) gives plain lines that service.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterable

from doctor.errors import DoctorError
from doctor.parse import SERVICES, ParseStats, Record, parse_lines

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
NUMBER_LABEL = "com.docker.compose.container-number"
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


@dataclass
class Loaded:
    """Everything read: records in read order, stats, a description of the sources, docker facts."""

    records: list[Record] = field(default_factory=list)
    stats: ParseStats = field(default_factory=ParseStats)
    sources: list[str] = field(default_factory=list)
    docker: dict | None = None

    def add(self, lines: Iterable[str], origin: str, service: str | None = None, client: bool = False) -> None:
        records, stats = parse_lines(lines, origin, service, client)
        self.records.extend(records)
        self.stats.merge(stats)
        self.sources.append(origin)


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """`10m`, `2h`, `30s`, `1d` or an ISO-8601 time → an aware UTC datetime."""
    now = now or datetime.now(timezone.utc)
    match = _DURATION.match(value.strip())
    if match:
        amount, unit = float(match.group(1)), match.group(2)
        return now - timedelta(**{{"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[unit]: amount})
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError as exc:
        raise DoctorError(f"--since: {value!r} is neither a duration (10m, 2h) nor an ISO-8601 time") from exc
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def since_filter(records: list[Record], since: datetime) -> list[Record]:
    """Keep records at or after `since` (lines without a timestamp, such as client errors, are kept)."""
    cutoff = since.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:23]
    return [r for r in records if not r.ts or r.ts[:23] >= cutoff]


def _service_of_file(path: Path) -> str | None:
    stem = path.name.split(".")[0].lower()
    return stem if stem in SERVICES else None


def load_files(paths: list[str], client_logs: list[str] = (), stdin=None) -> Loaded:
    """Read `--logs` (files, folders, `-` for stdin) and `--client-log` files."""
    loaded = Loaded()
    for raw in paths:
        if raw == "-":
            loaded.add(stdin or sys.stdin, "stdin")
            continue
        path = Path(raw)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
            if not files:
                raise DoctorError(f"--logs {raw}: the folder holds no log files")
        elif path.is_file():
            files = [path]
        else:
            raise DoctorError(f"--logs {raw}: no such file or folder")
        for file in files:
            _add_file(loaded, file, _service_of_file(file), client=file.name.split(".")[0] == "client")
    add_client_logs(loaded, client_logs)
    return loaded


def add_client_logs(loaded: Loaded, client_logs: list[str]) -> None:
    """`--client-log` files: what a client printed, next to the services' logs from any source."""
    for raw in client_logs:
        if not Path(raw).is_file():
            raise DoctorError(f"--client-log {raw}: no such file")
        _add_file(loaded, Path(raw), None, client=True)


def _add_file(loaded: Loaded, path: Path, service: str | None, client: bool) -> None:
    with path.open("r", encoding="utf-8", errors="replace", newline="") as handle:
        loaded.add(handle, str(path), service, client)


def _docker_client():
    try:
        import docker
        from docker.errors import DockerException
    except ImportError as exc:  # pragma: no cover - docker is a runtime dependency
        raise DoctorError("the `docker` Python package is missing: pip install docker") from exc
    try:
        client = docker.from_env()
        client.ping()
    except DockerException as exc:
        raise DoctorError(f"cannot reach the Docker daemon ({exc}); pass --logs FILE instead") from exc
    return client


def _replica_number(container) -> int:
    number = container.labels.get(NUMBER_LABEL, "1")
    return int(number) if number.isdigit() else 1


def compose_projects(client) -> dict[str, dict[str, object]]:
    """Compose projects on this daemon that run our services → {project: {service: container}}. A scaled service
    (./pd scale) is its lowest-numbered replica under the service's name, the others as `<service>-<number>`."""
    projects: dict[str, dict[str, object]] = {}
    for container in sorted(client.containers.list(all=True, filters={"label": PROJECT_LABEL}), key=_replica_number):
        labels = container.labels
        service = labels.get(SERVICE_LABEL, "")
        services = projects.setdefault(labels[PROJECT_LABEL], {})
        services[service if service not in services else f"{service}-{_replica_number(container)}"] = container
    return {p: s for p, s in projects.items() if set(s) & set(SERVICES)}


def pick_project(projects: dict[str, dict], wanted: str | None) -> str:
    if wanted:
        if wanted not in projects:
            known = ", ".join(sorted(projects)) or "none"
            raise DoctorError(f"--project {wanted}: no such compose project with our services (found: {known})")
        return wanted
    if not projects:
        raise DoctorError("no running compose project with router/prefill/decode containers; "
                          "start it (./pd up) or pass --logs FILE")
    if len(projects) > 1:
        raise DoctorError(f"several compose projects run our services ({', '.join(sorted(projects))}); "
                          "pick one with --project")
    return next(iter(projects))


def load_docker(project: str | None, since: datetime | None) -> Loaded:
    """Read every service container's logs of one compose project through the Docker API."""
    client = _docker_client()
    projects = compose_projects(client)
    name = pick_project(projects, project)
    loaded = Loaded()
    services: dict[str, str] = {}
    networks: dict[str, list[str]] = {}
    config_dirs: dict[str, str] = {}
    published: dict[str, list[str]] = {}
    exits: dict[str, dict] = {}
    for service, container in sorted(projects[name].items()):
        state = container.attrs.get("State", {})
        settings = container.attrs.get("NetworkSettings", {})
        networks[service] = sorted((settings.get("Networks") or {}).keys())
        config_dirs.update({service: m["Source"] for m in container.attrs.get("Mounts", [])
                            if m.get("Destination") == "/config" and m.get("Source")})
        published[service] = [f"{b.get('HostIp') or '0.0.0.0'}:{b['HostPort']}->{port}"
                              for port, binds in (settings.get("Ports") or {}).items() for b in (binds or [])
                              if b.get("HostPort")]
        exits[service] = {"exit_code": state.get("ExitCode"), "oom": bool(state.get("OOMKilled"))}
        # A stopped container keeps its last health status: only a running one reports health.
        health = (state.get("Health") or {}).get("Status") if state.get("Running") else None
        services[service] = health or state.get("Status", "?")
        kwargs = {"stdout": True, "stderr": True}
        if since is not None:
            kwargs["since"] = int(since.timestamp())
        text = container.logs(**kwargs).decode("utf-8", errors="replace")
        role = container.labels.get(SERVICE_LABEL, service)  # a replica's lines are its service's
        loaded.add(text.splitlines(), f"docker:{name}/{service}", role if role in SERVICES else None)
    loaded.docker = {"project": name, "services": services, "router_url": published_router_url(projects[name]),
                     "networks": networks, "config_dirs": config_dirs, "published": published, "exits": exits}
    return loaded


def published_router_url(containers: dict) -> str | None:
    """The router's URL as the host reaches it: its published 8080 port (None when not published)."""
    router = containers.get("router") or containers.get("engine")
    ports = (router.attrs.get("NetworkSettings", {}).get("Ports") or {}) if router is not None else {}
    binding = (ports.get("8080/tcp") or [{}])[0]
    if not binding.get("HostPort"):
        return None
    host = binding.get("HostIp") or "localhost"
    return f"http://{'localhost' if host in ('0.0.0.0', '::', '') else host}:{binding['HostPort']}"

