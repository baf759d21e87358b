"""Events declare their fields: every log call in stack/ matches its declaration, and log_event enforces it."""

from __future__ import annotations

import ast
import asyncio
import io
import json
import re
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from loguru import logger

from stack.common import events
from stack.common import logging as pd_logging
from stack.common.logging import EventDeclarationError, log_event, setup_logging

STACK = Path(__file__).parents[3] / "stack"


def _calls() -> list[tuple[str, events.Event, set[str], bool]]:
    """(where, event, keyword names, has **kwargs) of every log_event(events.X, …) and logger.bind(event=events.X, …)."""
    found = []
    for path in sorted(STACK.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            keywords = {k.arg: k.value for k in node.keywords}
            if name == "log_event" and node.args:
                target, skip = node.args[0], {"level", "request_id"}
            elif name == "bind" and "event" in keywords:
                target, skip = keywords["event"], {"event", "request_id"}
            else:
                continue
            if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "events":
                names = {k for k in keywords if k is not None and k not in skip}
                where = f"{path.relative_to(STACK.parent)}:{node.lineno}"
                found.append((where, getattr(events, target.attr), names, None in keywords))
    return found


def test_every_log_call_in_the_code_matches_its_declaration() -> None:
    """Each call site (run by a test or not) passes exactly its event's declared fields: none undeclared, all required."""
    calls = _calls()
    assert len(calls) > 50, "the scan found the log calls"
    drift = []
    for where, event, names, spread in calls:
        undeclared, missing = event.problems(names)
        missing = [m for m in missing if not spread and m != "exc"]  # **details / exception info: known at run time
        if undeclared or missing:
            drift.append(f"{where}: {event} undeclared {undeclared} missing {missing}")
    assert drift == []


def test_every_declared_event_is_logged_somewhere() -> None:
    """No declaration without a call site (the doctor would wait for lines nobody writes), but the retired events, which
    only older versions logged; and none of those is logged any more."""
    logged = {event for _, event, _, _ in _calls()} | {events.HTTP_ACCESS, events.LOG, events.LOG_FIELDS_MISMATCH}
    assert set(events.ALL) - logged == set(events.RETIRED)
    assert not logged & events.RETIRED


def test_declarations_are_well_formed() -> None:
    """Every example fits its field's type, and each event's constant can be named in an error message."""
    for event in events.ALL.values():
        assert event.required <= event.names
        for field in event.fields.values():
            assert field.accepts(field.example), f"{event}.{field.name}: example {field.example!r}"
        assert getattr(events, events.constant_of(event)) is event


def test_strict_mode_is_on_in_the_tests() -> None:
    """tests/conftest.py turns strict mode on: an undeclared field raises and names the event, field and declaration."""
    with pytest.raises(EventDeclarationError) as info:
        log_event(events.KV_CONSUMER_LISTENING, "listening", kv_port=9100, kv_buffer_size=8e9, kv_lease_ms=1, port=1)
    message = str(info.value)
    assert "kv_consumer.listening: undeclared field(s) port." in message
    assert "KV_CONSUMER_LISTENING = Event('kv_consumer.listening', …) in stack/common/events.py" in message
    assert f"{Path(__file__).name}:" in message  # the call site


@pytest.mark.parametrize("fields,said", [
    ({"kv_port": 9100}, "missing required field(s) kv_buffer_size, kv_lease_ms"),
    ({"kv_port": "9100", "kv_buffer_size": 8e9, "kv_lease_ms": 1}, "kv_port='9100' is not int"),
    ({"kv_port": True, "kv_buffer_size": 8e9, "kv_lease_ms": 1}, "kv_port=True is not int"),
])
def test_strict_mode_rejects_missing_fields_and_wrong_types(fields, said) -> None:
    """A required field left out, or a value of another type (a bool is no number), raises in strict mode."""
    with pytest.raises(EventDeclarationError, match=re.escape(said)):
        log_event(events.KV_CONSUMER_LISTENING, "listening", **fields)


def test_unknown_event_raises_in_strict_mode() -> None:
    """An event name not in events.py says where to declare it."""
    with pytest.raises(EventDeclarationError, match=r"unknown event 'kv.new_thing': declare it in stack/common/events.py"):
        log_event("kv.new_thing", "x")


def test_null_values_and_ints_for_floats_are_fine() -> None:
    """Any field may be null (unknown); a JSON integer is a fine float."""
    sink = io.StringIO()
    setup_logging("decode", sink=sink)
    log_event(events.KV_CONSUMER_LISTENING, "listening", kv_port=None, kv_buffer_size=8000000000, kv_lease_ms=30000)
    assert json.loads(sink.getvalue())["kv_buffer_size"] == 8000000000


def test_production_writes_the_line_and_warns_once(monkeypatch) -> None:
    """Without strict mode a drifting call never raises: its line is written as given, plus one
    log.fields_mismatch warning per event and problem that says what to fix."""
    sink = io.StringIO()
    setup_logging("router", sink=sink)
    monkeypatch.setattr(pd_logging._Output, "strict", False)
    for _ in range(3):
        log_event(events.ROUTER_QUEUED, "queued", role="decode", queue_depth=1, priority="high")
    lines = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["log.fields_mismatch"] + ["router.queued"] * 3
    warning = lines[0]
    assert warning["level"] == "WARNING" and warning["for_event"] == "router.queued"
    assert warning["problem"].startswith("router.queued: undeclared field(s) priority. Fix the call, or the declaration "
                                         "ROUTER_QUEUED = Event('router.queued', …)")
    assert lines[1]["priority"] == "high"


def test_loguru_lines_are_checked_too() -> None:
    """An event bound on loguru's logger (exception lines) is checked against its declaration like log_event."""
    sink = io.StringIO()
    setup_logging("decode", sink=sink)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.bind(event=events.ENGINE_STEP_FAILED, sequences=2).opt(exception=True).error("step failed")
    [line] = [json.loads(x) for x in sink.getvalue().splitlines()]
    assert line["event"] == "engine.step_failed" and line["exc"] == "RuntimeError: boom"
    assert events.ENGINE_STEP_FAILED.problems(line.keys() - events.BASE_KEYS) == ([], [])


async def test_access_lines_match_their_declaration() -> None:
    """The access logger writes http.access itself (hot path): its fields are exactly the declared ones."""
    sink = io.StringIO()
    setup_logging("router", sink=sink)

    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/ok", ok)
    runner = web.AppRunner(app, access_log_class=pd_logging.AccessLogger)  # as stack.common.server runs it
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/ok") as response:
            assert response.status == 200
        for _ in range(1000):  # aiohttp writes the access line after the response has left
            if '"http.access"' in sink.getvalue():
                break
            await asyncio.sleep(0.001)
    finally:
        await runner.cleanup()
    [line] = [json.loads(x) for x in sink.getvalue().splitlines() if '"http.access"' in x]
    assert events.HTTP_ACCESS.problems(line.keys() - events.BASE_KEYS) == ([], [])
