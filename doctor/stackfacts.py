"""The stack a fix text talks about: its compose project's real service, network and file names.

Live (read through the Docker API): the project's containers, the networks they are attached to and
the host files mounted as /config. Otherwise: the shipped compose.yaml next to this doctor (project
`pd-deploy`), its networks and the per-service config folders. Fix texts take names from here, and a
test checks that every name a fix text uses exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG_FILES = {"prefill": "prefill/config.json", "decode": "decode/config.json", "engine": "colocated/config.json",
                "router": "router/settings.toml"}


@dataclass(frozen=True)
class StackFacts:
    project: str
    services: tuple[str, ...]
    networks: dict[str, tuple[str, ...]]  # service → the real network names it is attached to
    config_dirs: dict[str, str] = field(default_factory=dict)  # service → host folder mounted as /config
    live: bool = False

    def network_between(self, a: str, b: str) -> str | None:
        """The network two services share (e.g. prefill and decode → pd-deploy_kv)."""
        shared = sorted(set(self.networks.get(a, ())) & set(self.networks.get(b, ())))
        return shared[0] if shared else None

    def config_file(self, service: str) -> tuple[str, Path | None]:
        """(name to show, path to read) of the file that holds a service's settings."""
        shown = CONFIG_FILES.get(service, f"{service}/config.json")
        folder = self.config_dirs.get(service)
        if folder:
            path = Path(folder) / Path(shown).name
            return (shown if Path(folder).name == service else str(path)), path
        return shown, REPO / shown

    def engine_config(self, service: str) -> tuple[str, dict | None]:
        shown, path = self.config_file(service)
        try:
            return shown, json.loads(path.read_text()) if path else None
        except (OSError, ValueError):
            return shown, None


@lru_cache(maxsize=1)
def shipped() -> StackFacts:
    """The facts of the shipped compose.yaml."""
    try:
        import yaml
        doc = yaml.safe_load((REPO / "compose.yaml").read_text())
    except (ImportError, OSError, ValueError):  # no pyyaml (an image without the dev extra) or no compose.yaml
        return StackFacts("pd-deploy", ("decode", "prefill", "router"), {})
    project = doc.get("name", "pd-deploy")
    nets = {name: tuple(f"{project}_{n}" for n in (svc.get("networks") or ["default"]))
            for name, svc in doc["services"].items()}
    return StackFacts(project, tuple(doc["services"]), nets)


def from_docker(docker: dict | None) -> StackFacts:
    """Live facts when the logs came from a compose project, else the shipped compose.yaml's."""
    if not docker or not docker.get("networks"):
        return shipped()
    return StackFacts(docker["project"], tuple(docker.get("services", {})),
                      {s: tuple(n) for s, n in docker["networks"].items()}, dict(docker.get("config_dirs") or {}),
                      live=True)
