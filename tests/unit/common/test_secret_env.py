"""Secrets as files (<NAME>_FILE, Docker Swarm and Kubernetes secrets): the router's keys and the engines' internal key."""

from __future__ import annotations

from pathlib import Path

import pytest

from stack.common import internal_auth
from stack.common.config import ConfigError
from stack.common.secret_env import read_secret
from stack.router.auth import KeyRing
from stack.router.config import KeysFile, RouterConfig

KEY = "sk-pd-0123456789abcdef0123456789abcdef"


def test_the_router_key_can_come_from_a_secret_file(tmp_path: Path) -> None:
    """TAOTOKEN_API_KEY_FILE=/run/secrets/… : the file's content (its trailing newline dropped) is the key."""
    secret = tmp_path / "pd_api_key"
    secret.write_text(KEY + "\n")
    ring = KeyRing.from_environment(RouterConfig(), KeysFile(), {"TAOTOKEN_API_KEY_FILE": str(secret)})
    assert ring.authenticate({"Authorization": f"Bearer {KEY}"}).name == "default"


def test_the_internal_key_can_come_from_a_secret_file(tmp_path: Path) -> None:
    secret = tmp_path / "pd_internal_key"
    secret.write_text("internal-0123456789\n")
    assert internal_auth.internal_key({"PD_INTERNAL_KEY_FILE": str(secret)}) == "internal-0123456789"


@pytest.mark.parametrize(("env", "problem"), [
    ({"TAOTOKEN_API_KEY": KEY, "TAOTOKEN_API_KEY_FILE": "/x"}, "both TAOTOKEN_API_KEY and TAOTOKEN_API_KEY_FILE are set"),
    ({"TAOTOKEN_API_KEY_FILE": "/nonexistent/pd_api_key"}, "cannot read /nonexistent/pd_api_key: No such file or directory"),
])
def test_a_bad_secret_file_names_the_variable_and_never_the_key(env: dict[str, str], problem: str) -> None:
    with pytest.raises(ConfigError) as raised:
        read_secret(env, "TAOTOKEN_API_KEY")
    assert (raised.value.file, raised.value.key) == ("environment", "TAOTOKEN_API_KEY_FILE")
    assert problem in raised.value.problem and KEY not in str(raised.value)


def test_an_empty_secret_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_secret({"PD_INTERNAL_KEY_FILE": str(tmp_path / "empty")}, "PD_INTERNAL_KEY")
