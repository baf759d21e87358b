"""JSON-lines logging for every service: one flat object per line on stdout.

    {"ts": "2026-11-29T20:31:55.123Z", "level": "INFO", "service": "prefill", "event": "kv_producer.sent",
     "request_id": "3f9c…", "msg": "pushed 812 tokens of KV to decode:9100", "bytes": 5312512, …}

Use `log_event(events.KV_PRODUCER_SENT, "pushed …", bytes=n)`; the request id comes from
`logger.contextualize(request_id=…)` set by each service's middleware, so it follows awaits.
Secrets registered with `register_secret` (and anything shaped like a bearer token) are
replaced by `[REDACTED]` before a line reaches the sink.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import timezone
from typing import Any, TextIO

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from loguru import logger

from stack.common import events

# The request's id, set by stack.common.errors.request_id_middleware and read by every hop's logs.
REQUEST_ID = web.RequestKey("request_id", str)

_secrets: set[str] = set()
# `Bearer <token>` and OpenAI/Anthropic-style `sk-…` keys, wherever they appear in a line.
# The token class stops at quotes, commas and backslashes so that redacting a serialized JSON line
# (once per line, not per field: logging is on every request's hot path) keeps it valid JSON.
_TOKEN_PATTERN = re.compile(r"(Bearer\s+)[^\s\"',\\]+|\bsk-[A-Za-z0-9_\-]{6,}")


def register_secret(value: str) -> None:
    """Never let `value` reach a log sink (API keys read from the environment)."""
    if value and value.strip():
        _secrets.add(value.strip())


def redact(text: str) -> str:
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, "[REDACTED]")
    if "Bearer" not in text and "sk-" not in text:
        return text  # the common case, without a regex pass over every line
    return _TOKEN_PATTERN.sub(lambda m: (m.group(1) or "") + "[REDACTED]", text)


def _json_default(value: Any) -> Any:
    return str(value)


def _format(record: dict[str, Any]) -> str:
    extra = dict(record["extra"])
    line: dict[str, Any] = {
        "ts": record["time"].astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "level": record["level"].name,
        "service": extra.pop("service", "-"),
        "event": extra.pop("event", "log"),
        "request_id": extra.pop("request_id", "-"),
        "msg": record["message"],
    }
    line.update(extra)
    if record["exception"] is not None:
        exc_type, exc, _ = record["exception"]
        line["exc"] = f"{exc_type.__name__ if exc_type else 'Exception'}: {exc}"
    return redact(json.dumps(line, default=_json_default, ensure_ascii=False))


class _InterceptHandler(logging.Handler):
    """Send stdlib logging (aiohttp, grpc, asyncio) through loguru so every line is JSON."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.bind(logger=record.name).opt(exception=record.exc_info).log(level, record.getMessage())


def setup_logging(service: str, level: str = "INFO", sink: TextIO | None = None) -> None:
    """Configure loguru for `service`; call once at process start (tests may call it again)."""
    out = sink or sys.stdout

    def write(message: Any) -> None:
        out.write(_format(message.record) + "\n")
        out.flush()

    logger.remove()
    logger.configure(extra={"service": service, "request_id": "-"})
    logger.add(write, level=level, format="{message}", diagnose=False, backtrace=False)
    logging.basicConfig(handlers=[_InterceptHandler()], level=logging.INFO, force=True)
    logging.getLogger("aiohttp.access").disabled = True  # AccessLogger below replaces it


def log_event(event: str, msg: str, level: str = "INFO", **fields: Any) -> None:
    """Log one named event (a constant from stack.common.events) with flat extra fields."""
    assert event in events.ALL, f"unknown event {event!r}: add it to stack/common/events.py"
    logger.bind(event=event, **fields).log(level, msg)


class AccessLogger(AbstractAccessLogger):
    """aiohttp access lines as `http.access` events that keep the request id.

    aiohttp writes the access log after middleware context has ended, so the id is read from the
    request (set there by the request-id middleware) rather than from the logging context.
    """

    def log(self, request, response, time: float) -> None:  # type: ignore[override]
        logger.bind(
            event=events.HTTP_ACCESS,
            request_id=request.get(REQUEST_ID, "-"),
            method=request.method,
            path=request.path,
            status=response.status,
            duration_ms=round(time * 1000, 2),
        ).info(f"{request.method} {request.path} {response.status}")
