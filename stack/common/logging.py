"""JSON-lines logging for every service: one flat object per line on stdout.

    {"ts": "2026-11-29T20:31:55.123Z", "level": "INFO", "service": "prefill", "event": "kv_producer.sent",
     "request_id": "3f9c…", "msg": "pushed 812 tokens of KV to decode:9100", "bytes": 5312512, …}

Use `log_event(events.KV_PRODUCER_SENT, "pushed …", bytes=n)`; the request id comes from
`request_context(request_id)`, entered by each service's request-id middleware, so it follows
awaits and tasks. Secrets registered with `register_secret` (and anything shaped like a bearer
token) are replaced by `[REDACTED]` before a line reaches the sink.

Each call is checked against its event's declaration in stack/common/events.py (two set
comparisons). With PD_LOG_STRICT=1 (the tests set it in tests/conftest.py) an unknown event, an
undeclared or missing field, or a value of the wrong type raises EventDeclarationError. Otherwise
(production; value types unchecked) the line is written as given and one `log.fields_mismatch`
warning per event and problem says what drifted: logging never fails a request.

`log_event` builds its line directly: it runs several times per request on the router's hot path,
and loguru's record machinery cost about 20 µs a line, a fifth of the router's CPU per request. The
line itself is written as text around one JSON encoding of the call's own fields (the keys every line
has are quoted, not encoded as a dict), and its time comes from a clock that formats the date once a
second: the same bytes as one `json.dumps` of the whole line, for less.
Everything else (stdlib logging from aiohttp/grpc/asyncio, `logger.opt(exception=True)…` with its
traceback) goes through loguru and ends in the same writer, so every line has the same shape.
"""

from __future__ import annotations

import asyncio
import atexit
import io
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from datetime import datetime
from json.encoder import encode_basestring as _quote  # a str as a JSON string literal (C; UTF-8 kept, as _ENCODE)
from types import FrameType
from typing import Any, Callable, TextIO

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from loguru import logger

from stack.common import events, json_text

# The request's id, set by stack.common.errors.request_id_middleware and read by every hop's logs.
REQUEST_ID = web.RequestKey("request_id", str)
_request_id: ContextVar[str] = ContextVar("request_id", default="-")
_client_request_id: ContextVar[str | None] = ContextVar("client_request_id", default=None)  # a client's X-Request-ID (router)

# loguru's level numbers (TRACE and SUCCESS included), so both paths filter alike.
_LEVELS = {"TRACE": 5, "DEBUG": 10, "INFO": 20, "SUCCESS": 25, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}
STRICT_ENV = "PD_LOG_STRICT"  # "1": a log call that differs from its event's declaration raises


class EventDeclarationError(Exception):
    """A log call differs from its event's declaration in stack/common/events.py (strict mode only)."""


_MILLIS = tuple(f".{ms:03d}Z" for ms in range(1000))  # a line's milliseconds, formatted once (not ~3k instructions a line)


class _UtcClock:
    """Now as a line's `ts` (`2026-11-29T20:31:55.123Z`, what datetime.isoformat gave): the date and time up to
    the second are formatted once a second, not once a line."""

    second = -1
    prefix = ""

    @classmethod
    def text(cls) -> str:
        now = time.time()
        second = int(now)
        if second != cls.second:
            cls.second, cls.prefix = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return cls.prefix + _MILLIS[int((now - second) * 1000)]


def _clock_text(clock: Callable[[], datetime]) -> Callable[[], str]:
    """A given clock (tests: a fake one) as a line's `ts`."""
    return lambda: clock().isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _Output:
    """Where lines go and which are kept: set by setup_logging, process-wide like loguru itself."""

    service = "-"
    service_json = '"-"'  # the service as its JSON string, quoted once
    min_level = _LEVELS["INFO"]
    stream: TextIO = sys.stdout
    timestamp: Callable[[], str] = _UtcClock.text  # tests set a fake clock (setup_logging)
    strict = os.environ.get(STRICT_ENV) == "1"
    flush_loop: asyncio.AbstractEventLoop | None = None  # the loop a flush is scheduled on, if any
    flush_thread = 0  # the thread that loop runs in

    @classmethod
    def flush(cls) -> None:
        cls.flush_loop = None
        cls.stream.flush()


_secrets: set[str] = set()
# `Bearer <token>` and OpenAI/Anthropic-style `sk-…` keys, wherever they appear in a line.
# The token class stops at quotes, commas and backslashes so that redacting a serialized JSON line
# (once per line, not per field: logging is on every request's hot path) keeps it valid JSON.
# A placeholder after `Bearer ` (`<key>`, `[REDACTED]`, `…`) is a hint, not a token, and stays readable; so do backticks.
_TOKEN_PATTERN = re.compile(r"(Bearer\s+)(?![<\[{…`])[^\s\"',\\`]+|\bsk-[A-Za-z0-9_\-]{6,}")


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


# The lines keep json.dumps' `"key": value` spacing, which readers grep for (json_text.text writes it).
_ENCODE = json_text.text


def _json(value: Any) -> str:
    return _quote(value) if isinstance(value, str) else _ENCODE(value)


def _write(level: str, event: str, request_id: str, msg: str, fields: dict[str, Any]) -> None:
    """The one writer: a flat JSON line, redacted, flushed (`docker logs` and the doctor read it live).

    The line is `{"ts": …, "level": …, "service": …, "event": …, "request_id": …, "msg": …, <fields>,
    "client_request_id": …}`, as json.dumps would write that dict; a field may not replace one of the
    line's own keys (strict mode refuses such a call; otherwise the line's own value is kept).
    On an event loop the flush waits for the end of the current loop step, so the lines of many
    requests handled in one step leave in one write instead of one syscall each."""
    line = (f'{{"ts": "{_Output.timestamp()}", "level": "{level}", "service": {_Output.service_json}, "event": {_json(event)}, '
            f'"request_id": {_json(request_id)}, "msg": {_json(msg)}')
    if fields and not events.BASE_KEYS.isdisjoint(fields):
        fields = {name: value for name, value in fields.items() if name not in events.BASE_KEYS}
    if fields:
        line += ", " + _ENCODE(fields)[1:-1]  # the fields' object without its braces
    client_id = _client_request_id.get()
    if client_id is not None:
        line += ', "client_request_id": ' + _json(client_id)
    _Output.stream.write(redact(line) + "}\n")
    pending = _Output.flush_loop
    if pending is not None and _Output.flush_thread == threading.get_ident() and pending.is_running():
        return  # this thread's loop flushes at the end of its step (asking for the running loop is a getpid syscall on 3.11)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread (start-up, worker threads, tools): now
        _Output.stream.flush()
        return
    if pending is not loop:  # (a loop that closed before its flush ran does not block the next loop's)
        _Output.flush_loop, _Output.flush_thread = loop, threading.get_ident()
        loop.call_soon(_Output.flush)


def _write_record(message: Any) -> None:
    """loguru's sink: stdlib and free-form `logger` lines in the same shape as log_event's."""
    record = message.record
    extra = dict(record["extra"])
    extra.pop("service", None)
    event = extra.pop("event", "log")
    request_id = extra.pop("request_id", None) or _request_id.get()
    if record["exception"] is not None:
        exc_type, exc, _ = record["exception"]
        extra["exc"] = f"{exc_type.__name__ if exc_type else 'Exception'}: {exc}"
    declared = events.ALL.get(event)
    if declared is None or not (extra.keys() <= declared.names and extra.keys() >= declared.required) or _Output.strict:
        _check(event, declared, extra, f"{record['file'].path}:{record['line']}")
    _write(record["level"].name, event, request_id, record["message"], extra)


def _is_client_garbage(record: logging.LogRecord) -> bool:
    """aiohttp's "Error handling request" for bytes that are not HTTP (HttpProcessingError: bad method, line, header)."""
    from aiohttp.http_exceptions import HttpProcessingError

    exc = record.exc_info[1] if record.exc_info else None
    return isinstance(exc, HttpProcessingError)


class _InterceptHandler(logging.Handler):
    """Send stdlib logging (aiohttp, grpc, asyncio) through loguru so every line is JSON."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        if record.name == "aiohttp.server" and _is_client_garbage(record):
            level = "WARNING"  # HTTP-parser garbage, port scans, TLS on a plain port: the client's mistake, not a fault
            record.exc_info = (record.exc_info[0], record.exc_info[1], None) if record.exc_info else None
        logger.bind(logger=record.name).opt(exception=record.exc_info).log(level, record.getMessage())


_buffers: dict[int, TextIO] = {}  # stdout's file descriptor → the buffered stream over it (one per process)


def _buffered(stdout: TextIO) -> TextIO:
    """stdout with a buffer of its own when it writes through: under PYTHONUNBUFFERED (the image sets it, so that
    every other writer's output leaves at once) each line would be a write syscall of its own, to the container's log
    pipe. `_write` flushes this buffer itself: at the end of the loop step that wrote, or at once off a loop; and at exit."""
    if not getattr(stdout, "write_through", False):
        return stdout
    try:
        fd = stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a file (a test's capture): as it is
        return stdout
    if fd not in _buffers:
        raw = io.FileIO(fd, "w", closefd=False)
        _buffers[fd] = io.TextIOWrapper(io.BufferedWriter(raw, 1 << 16), encoding=stdout.encoding, errors=stdout.errors)
        atexit.register(_buffers[fd].flush)
    return _buffers[fd]


def setup_logging(service: str, level: str = "INFO", sink: TextIO | None = None,
                  clock: Callable[[], datetime] | None = None) -> None:
    """Configure logging for `service`; call once at process start (tests may call it again).

    `clock` gives each line's time (a timezone-aware datetime); tests pass a fake one."""
    _Output.service, _Output.service_json = service, _json(service)
    _Output.min_level = _LEVELS[level.upper()]
    _Output.stream = sink or _buffered(sys.stdout)
    _Output.timestamp = _clock_text(clock) if clock is not None else _UtcClock.text
    _Output.strict = os.environ.get(STRICT_ENV) == "1"
    _Output.flush_loop = None
    logger.remove()
    logger.add(_write_record, level=level.upper(), format="{message}", diagnose=False, backtrace=False)
    logging.basicConfig(handlers=[_InterceptHandler()], level=logging.INFO, force=True)
    logging.getLogger("aiohttp.access").disabled = True  # AccessLogger below replaces it


def client_request_id() -> str | None:
    """The client's own X-Request-ID of the request being handled (None: none sent, or outside a request)."""
    return _client_request_id.get()


RequestTokens = tuple[Token[str], Token[str | None]]


def enter_context(request_id: str, client_request_id: str | None = None) -> RequestTokens:
    """`request_context` without the context manager (the router's front middleware, where every call on a request's
    path counts): the same ids set, until `leave_context` with what this returned."""
    return _request_id.set(request_id), _client_request_id.set(client_request_id)


def leave_context(tokens: RequestTokens) -> None:
    _client_request_id.reset(tokens[1])
    _request_id.reset(tokens[0])


@contextmanager
def request_context(request_id: str, client_request_id: str | None = None) -> Iterator[None]:
    """Lines logged inside (and in tasks started inside) carry `request_id`, and `client_request_id` when given."""
    tokens = enter_context(request_id, client_request_id)
    try:
        yield
    finally:
        leave_context(tokens)


def ms(seconds: float) -> float:
    """A duration as a line's milliseconds to 0.01 ms (`queue_ms`, `e2e_ms`…): round(seconds * 1000, 2) but for a value
    exactly half-way between two hundredths. round() with digits formats the number as decimal text to round it: ~3k
    instructions, three or four times a request."""
    return int(seconds * 100_000 + 0.5) / 100


def enabled(level: str) -> bool:
    """Whether a line at `level` is written: a caller on the hot path asks before it builds a DEBUG line's message."""
    return _LEVELS[level] >= _Output.min_level


def log_event(event: str, msg: str, level: str = "INFO", **fields: Any) -> None:
    """Log one event (a constant from stack.common.events) with the flat fields it declares.

    A `request_id` field names the request explicitly (work outside its request's context)."""
    request_id = fields.pop("request_id", None)
    declared = events.ALL.get(event)
    keys = fields.keys()
    # Most calls pass every declared field: one set comparison; the others take two.
    if declared is None or not (keys == declared.names or keys <= declared.names and keys >= declared.required) \
            or _Output.strict:
        _check(event, declared, fields, sys._getframe(1))
    if _LEVELS[level] < _Output.min_level:
        return
    _write(level, event, request_id or _request_id.get(), msg, fields)


_reported: set[tuple[str, str]] = set()  # (event, problem) already warned about


def _check(event: str, declared: events.Event | None, fields: dict[str, Any], where: FrameType | str) -> None:
    """Say what differs from the declaration, precisely enough to fix it: raise (strict) or warn once."""
    problem = _problem(event, declared, fields, types=_Output.strict)
    if problem is None:
        return
    if isinstance(where, FrameType):
        where = f"{where.f_code.co_filename}:{where.f_lineno}"
    message = f"log call at {where}: {problem}"
    if _Output.strict:
        raise EventDeclarationError(message)
    if (event, problem) not in _reported:
        _reported.add((event, problem))
        if _LEVELS["WARNING"] >= _Output.min_level:
            _write("WARNING", events.LOG_FIELDS_MISMATCH, _request_id.get(), message, {"for_event": event, "problem": problem})


def _problem(event: str, declared: events.Event | None, fields: dict[str, Any], types: bool) -> str | None:
    """What differs, by field name (and, with `types`, by value: strict mode only, so that production's
    warnings stay one per event and problem whatever the values)."""
    if declared is None:
        return (f"unknown event {event!r}: declare it in stack/common/events.py, e.g. "
                f"NAME = Event({event!r}, <service>, <when it is logged>, required=(…))")
    undeclared, missing = declared.problems(fields)
    wrong = [f"{name}={value!r} is not {field.type.__name__}" for name, value in fields.items()
             if types and (field := declared.fields.get(name)) is not None and not field.accepts(value)]
    if not (undeclared or missing or wrong):
        return None
    said = ([f"undeclared field(s) {', '.join(undeclared)}"] if undeclared else []) + \
           ([f"missing required field(s) {', '.join(missing)}"] if missing else []) + wrong
    return (f"{event}: {'; '.join(said)}. Fix the call, or the declaration "
            f"{events.constant_of(declared)} = Event({event!r}, …) in stack/common/events.py "
            f"(required=… is on every call, optional=… on some)")


# Set on a request whose service logged its own summary line (the router's router.request_done: status and
# duration included): the access line would repeat it, so it is left out and the hop keeps one line.
SUMMARY_LOGGED = web.RequestKey("summary_logged", bool)


class AccessLogger(AbstractAccessLogger):
    """aiohttp access lines as `http.access` events that keep the request id (none for a request with SUMMARY_LOGGED).

    aiohttp writes the access log after middleware context has ended, so the id is read from the
    request (set there by the request-id middleware) rather than from the logging context.
    """

    def log(self, request, response, time: float) -> None:  # type: ignore[override]
        if _Output.min_level <= _LEVELS["INFO"] and not request.get(SUMMARY_LOGGED):
            _write("INFO", events.HTTP_ACCESS, request.get(REQUEST_ID, "-"), f"{request.method} {request.path} {response.status}",
                   {"method": request.method, "path": request.path, "status": response.status, "duration_ms": round(time * 1000, 2)})
