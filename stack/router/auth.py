"""The unified key: who may call the router, decided in constant time without keeping any key.

Keys come only from the environment: the variable named by `[taotoken] api_key_env` (key name
"default", limits from `[limits]`) and the variables named in the optional keys file; each may instead
name a file in `<VAR>_FILE` (a Docker secret, /run/secrets/...: stack.common.secret_env). Only their
sha256 digests are kept. A request's key is hashed and compared with `hmac.compare_digest`
against every known digest (no early exit), so timing says nothing about which byte differed.

Each way of getting the key wrong has its own message (missing header, no `Bearer `, stray
whitespace, quotes, unknown key, a router started without a key); none repeats the key or its hash.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from stack.common import events
from stack.common.errors import Unauthorized
from stack.common.logging import enabled, log_event, register_secret
from stack.common.config import ConfigError
from stack.common.secret_env import read_secret
from stack.router.config import KeyLimits, KeysFile, RouterConfig

DEFAULT_KEY_NAME = "default"
_QUOTES = "\"'`\u201c\u201d\u2018\u2019"
_OTHER_SCHEMES = {"basic", "digest", "token", "apikey", "api-key", "key", "negotiate", "aws4-hmac-sha256", "hoba", "mutual"}


@dataclass(frozen=True)
class Caller:
    """An authenticated key: its name (for logs, limits and usage) and its limits."""

    name: str
    limits: KeyLimits


@dataclass(frozen=True)
class _StoredKey:
    caller: Caller
    digest: bytes  # sha256 of the key; the key itself is never kept


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class KeyRing:
    """The known keys (as digests) and the precise 401 for every way a request can miss them."""

    def __init__(self, keys: list[tuple[Caller, str]], key_env: str) -> None:
        self._keys = [_StoredKey(caller, _digest(value)) for caller, value in keys]
        self.key_env = key_env  # named in the "no key configured" message (the name, never a value)

    @classmethod
    def from_environment(cls, config: RouterConfig, keys_file: KeysFile, env: Mapping[str, str]) -> KeyRing:
        """Read every configured key from `env`; log `auth.key_missing` for each one that is unset."""
        wanted = [(DEFAULT_KEY_NAME, config.taotoken.api_key_env, config.limits)]
        wanted += [(entry.name, entry.env, entry.limits(config.limits)) for entry in keys_file.keys]
        keys: list[tuple[Caller, str]] = []
        for name, var, limits in wanted:
            value = read_secret(env, var)  # or the file <var>_FILE names (a Docker/Kubernetes secret)
            if not value.strip():
                log_event(events.AUTH_KEY_MISSING, f"environment variable {var} is unset or empty: key {name!r} is disabled",
                          "WARNING", key_name=name, env_var=var)
                continue
            register_secret(value)
            twin = next((caller.name for caller, known in keys if known == value.strip()), None)
            if twin is not None:  # one key under two names would make usage and limits ambiguous
                raise ConfigError("environment", var, f"holds the same key as the one for {twin!r}; every key must be distinct")
            keys.append((Caller(name, limits), value.strip()))
        return cls(keys, config.taotoken.api_key_env)

    def callers(self) -> list[Caller]:
        """The configured keys' callers (names and limits; for the per-key metrics)."""
        return [stored.caller for stored in self._keys]

    def authenticate(self, headers: Mapping[str, str]) -> Caller:
        """The caller for these request headers, or Unauthorized with a precise, key-free message."""
        if not self._keys:
            self._reject("no_keys_configured", "-",
                         f"This router has no API key configured: set the environment variable {self.key_env} "
                         "for the router and restart it.", "no_key_configured")
        candidates = [(h, headers[h]) for h in ("Authorization", "x-api-key") if h in headers]
        if not candidates or all(not value.strip() for _, value in candidates):
            self._reject("missing", "-", "Missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`.",
                         "missing_api_key")
        first_problem: tuple[str, str, str, str] | None = None
        for header, value in candidates:
            token, problem = self._extract(header, value)
            if problem is None:
                caller = self._match(token)
                if caller is not None:
                    if enabled("DEBUG"):  # off as deployed: the line is not built on every request
                        log_event(events.AUTH_ACCEPTED, f"key {caller.name!r} accepted", "DEBUG", key_name=caller.name,
                                  header=header.lower())
                    return caller
                problem = ("unknown", "Invalid API key: it matches no key configured on this router "
                           f"(the router reads its key from {self.key_env}; check the client sends the same value).",
                           "invalid_api_key")
            first_problem = first_problem or (problem[0], header.lower(), problem[1], problem[2])
        assert first_problem is not None, "candidates was non-empty"
        self._reject(*first_problem)
        raise AssertionError("unreachable")

    def _extract(self, header: str, value: str) -> tuple[str, tuple[str, str, str] | None]:
        """The key carried by one header, or (reason, message, code) saying what is wrong with it."""
        token = value
        if header == "Authorization":
            scheme, _, rest = value.partition(" ")
            if scheme.lower() != "bearer":
                if scheme.lower() in _OTHER_SCHEMES:  # named only when it is a known scheme, never key text
                    return "", ("malformed", f"Unsupported Authorization scheme {scheme!r}: send `Authorization: Bearer <key>`.",
                                "invalid_authorization_header")
                return "", ("malformed", "Malformed Authorization header: the `Bearer ` prefix is missing; "
                            "send `Authorization: Bearer <key>`.", "invalid_authorization_header")
            token = rest
            if not token.strip():
                return "", ("missing", "Missing API key: the Authorization header says `Bearer` but carries no key.",
                            "missing_api_key")
        elif value[:7].lower() == "bearer ":
            return "", ("malformed", "Malformed x-api-key header: it carries the key alone, without `Bearer `.",
                        "invalid_api_key_format")
        if not token.strip():
            return "", ("missing", f"Missing API key: the {header} header is empty.", "missing_api_key")
        if token.split(maxsplit=1) != [token]:  # spaces around or inside (one C call, not a loop per character)
            return "", ("whitespace", f"Malformed API key in {header}: it contains spaces, tabs or line breaks "
                        "(often a copy-paste or `export` slip); send the key alone, with exactly one space after `Bearer`.",
                        "invalid_api_key_format")
        if token[0] in _QUOTES or token[-1] in _QUOTES:
            return "", ("quoted", f"Malformed API key in {header}: it is wrapped in quotes; send the key without "
                        "quotation marks (check how the env var or config file quotes it).", "invalid_api_key_format")
        return token, None

    def _match(self, token: str) -> Caller | None:
        digest = _digest(token)
        found = None
        for stored in self._keys:  # every digest is compared: no early exit
            if hmac.compare_digest(digest, stored.digest):
                found = stored.caller
        return found

    @staticmethod
    def _reject(reason: str, header: str, message: str, code: str) -> None:
        log_event(events.AUTH_REJECTED, message, "WARNING", reason=reason, header=header)
        raise Unauthorized(message, code=code)
