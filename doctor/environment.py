"""A read-only snapshot of the client side: environment variables and client config files.

Read once from `--home` (default $HOME) so tests point it at a tmp dir. Values of keys are kept only
to test presence and shape; findings name variables, never print their values.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
NO_PROXY_VARS = ("NO_PROXY", "no_proxy")
# The variables a client of this stack reads (the router key and the clients' own).
RELEVANT_PREFIXES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "ANTHROPIC_", "OPENAI_", "TAOTOKEN_",
                     "CODEX_", "CLAUDE_CODE_")


@dataclass(frozen=True)
class Environment:
    home: Path
    env: Mapping[str, str]  # only the relevant variables
    router_url: str  # where clients should point, e.g. http://localhost:8080
    claude_settings: dict[str, Any] | None = None  # ~/.claude/settings.json
    claude_settings_error: str | None = None
    claude_credentials: bool = False  # ~/.claude/.credentials.json exists (OAuth login)
    codex_auth: dict[str, Any] | None = None  # ~/.codex/auth.json
    codex_config: dict[str, Any] | None = None  # ~/.codex/config.toml
    codex_config_error: str | None = None
    config_files: tuple[str, ...] = field(default_factory=tuple)  # the ones found, for the summary
    set_vars: frozenset[str] = frozenset()  # names of every non-empty variable (Codex env_key can be any name)

    @property
    def claude_env(self) -> dict[str, str]:
        block = (self.claude_settings or {}).get("env")
        return {k: str(v) for k, v in block.items()} if isinstance(block, dict) else {}

    def client_env(self, name: str) -> str | None:
        """A variable as Claude Code sees it: its settings env block wins over the shell."""
        return self.claude_env.get(name, self.env.get(name))

    @property
    def router_host(self) -> str:
        return urlsplit(self.router_url).hostname or "localhost"

    @property
    def router_port(self) -> int:
        parts = urlsplit(self.router_url)
        return parts.port or (443 if parts.scheme == "https" else 80)


def snapshot(home: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None,
             router_url: str | None = None) -> Environment:
    """Read the environment and the client config files under `home`."""
    environ = os.environ if environ is None else environ
    home_path = Path(home or environ.get("HOME") or Path.home())
    env = {k: v for k, v in environ.items() if k.upper().startswith(RELEVANT_PREFIXES)}
    url = router_url or environ.get("PD_ROUTER_URL") or "http://localhost:8080"
    found: list[str] = []

    settings, settings_error = _read(home_path / ".claude" / "settings.json", json.loads, found)
    codex_auth, _ = _read(home_path / ".codex" / "auth.json", json.loads, found)
    codex_config, codex_error = _read(home_path / ".codex" / "config.toml", tomllib.loads, found)
    credentials = (home_path / ".claude" / ".credentials.json").exists()
    if credentials:
        found.append(str(home_path / ".claude" / ".credentials.json"))
    return Environment(home_path, env, url.rstrip("/"), settings, settings_error, credentials, codex_auth,
                       codex_config, codex_error, tuple(found), frozenset(k for k, v in environ.items() if v))


def _read(path: Path, loads, found: list[str]) -> tuple[dict | None, str | None]:
    if not path.is_file():
        return None, None
    found.append(str(path))
    try:
        value = loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        return None, f"{path}: {exc}"
    return (value if isinstance(value, dict) else None), None


def redact_url(url: str) -> str:
    """Drop user:password from a proxy URL before it is shown."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        return parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")).geturl()
    return url
