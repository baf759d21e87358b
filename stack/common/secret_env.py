"""Secrets from the environment: a variable's value, or the file its `<NAME>_FILE` twin names.

Docker Swarm and Kubernetes hand secrets over as files (/run/secrets/<name>, a mounted Secret), never as plain
environment values; the `_FILE` convention (as the official postgres and mariadb images use) lets the same service
read either. The file's content is the secret, a trailing newline dropped (`echo key > file` writes one). Both at once
is a mistake, as is a file that cannot be read or is empty: one ConfigError naming the variable. Callers register the
value with the log redactor (stack.common.logging.register_secret), as for a plain variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from stack.common.config import ConfigError


def read_secret(env: Mapping[str, str], name: str) -> str:
    """`name`'s value, or the content of the file `<name>_FILE` names; "" when neither is set."""
    file_var = f"{name}_FILE"
    path = env.get(file_var, "").strip()
    if not path:
        return env.get(name, "")
    if env.get(name, "").strip():
        raise ConfigError("environment", file_var, f"both {name} and {file_var} are set: keep one")
    try:
        value = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("environment", file_var, f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not value.strip():
        raise ConfigError("environment", file_var, f"{path} is empty")
    return value
