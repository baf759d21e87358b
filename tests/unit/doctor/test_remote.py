"""`check` / `verify` on engines given by URL (process or remote deployments): no compose project, no Docker.

The engines here answer GET /health and GET /v1/models the way vLLM does (its model card lists root and
max_model_len; its API-key middleware answers 401 {"error": "Unauthorized"}), on real loopback sockets."""

from __future__ import annotations

import asyncio
import io
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from doctor.cli import main
from tests.unit.router_front.conftest import ServiceProcess, free_port
from tests.unit.router_pd.conftest import INTERNAL_KEY, EngineProcess, router_settings


def serve(max_model_len: int, key: str | None = None) -> ThreadingHTTPServer:
    class Engine(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/health":
                return self._send(200, {})
            if key and self.headers.get("Authorization") != f"Bearer {key}":
                return self._send(401, {"error": "Unauthorized"})
            self._send(200, {"object": "list", "data": [{"id": "tiny-llama", "root": "/models/tiny",
                                                         "max_model_len": max_model_len}]})

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def engines() -> Iterator[list[ThreadingHTTPServer]]:
    started: list[ThreadingHTTPServer] = []
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


def url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def run_check(prefill: ThreadingHTTPServer, decode: ThreadingHTTPServer, monkeypatch) -> tuple[int, dict]:
    monkeypatch.setenv("PD_INTERNAL_KEY", "router-key")
    out = io.StringIO()
    # the router URL answers nothing: the engines' findings must not need it (nor Docker)
    code = main(["check", "--json", "--router-url", "http://127.0.0.1:9", "--prefill-url", url(prefill),
                 "--decode-url", url(decode)], stdout=out)
    return code, {f["id"]: f for f in json.loads(out.getvalue())["findings"]}


def test_check_by_url_compares_max_model_len(engines, monkeypatch):
    """Prefill 2048, decode 512 (their /v1/models): config.max_model_len_mismatch, exit 1, no compose project asked."""
    engines += [serve(2048, "router-key"), serve(512, "router-key")]
    code, found = run_check(*engines, monkeypatch)
    assert code == 1
    assert found["engine.prefill"]["severity"] == "ok" and "max_model_len 2048" in found["engine.prefill"]["title"]
    mismatch = found["config.max_model_len_mismatch"]
    assert mismatch["severity"] == "error" and "prefill 2048, decode 512" in mismatch["title"]
    assert "--max-model-len" in mismatch["fix"]
    assert "router.reachable" in found and "docker.compose" not in found


def test_check_by_url_names_an_engine_refusing_the_internal_key(engines, monkeypatch):
    """A decode holding another key answers 401 to the router's PD_INTERNAL_KEY: auth.internal_key_mismatch."""
    engines += [serve(2048, "router-key"), serve(2048, "another-key")]
    code, found = run_check(*engines, monkeypatch)
    assert code == 1
    refused = found["auth.internal_key_mismatch"]
    assert "decode engine" in refused["title"] and "HTTP 401" in refused["title"]
    assert "VLLM_API_KEY" in refused["fix"] and "router-key" not in json.dumps(refused)


def test_verify_proves_the_path_from_a_process_deployments_log_files(tmp_path, monkeypatch):
    """Our engines and the router run as processes (no compose): verify --router-url --logs sends one stream and proves
    router → prefill → KV → decode from their log files."""
    key = "pd-doctor-remote-key"
    started: list = []
    try:
        prefill, decode = EngineProcess("prefill", tmp_path).start(), EngineProcess("decode", tmp_path).start()
        started += [prefill, decode]

        async def ready() -> None:
            await asyncio.gather(prefill.ready(), decode.ready())

        asyncio.run(ready())
        port, health_port = free_port(), free_port()
        model = json.loads(decode.config_path.read_text())["model"]
        settings = router_settings(tmp_path, "router", prefill, decode, model,
                                   server=f"port = {port}\nhealth_port = {health_port}")
        router = ServiceProcess("router", ["stack.router", "--config", str(settings)], tmp_path / "router.log",
                                f"127.0.0.1:{health_port}", bound_s=120,
                                env={**os.environ, "PD_TEST_KEY": key, "PD_INTERNAL_KEY": INTERNAL_KEY})
        started.append(router)
        monkeypatch.setenv("TAOTOKEN_API_KEY", key)  # what the doctor sends, as a client would
        out = io.StringIO()
        code = main(["verify", "--json", "--home", str(tmp_path / "no-home"), "--router-url", f"http://127.0.0.1:{port}",
                     "--logs", str(tmp_path / "router.log"), "--logs", str(prefill.log_path), "--logs",
                     str(decode.log_path)], stdout=out)
        report = json.loads(out.getvalue())
        verified = next(f for f in report["findings"] if f["id"] == "verify")
        assert code == 0 and verified["severity"] == "ok", report
        assert "router → prefill → kv → decode → done" in verified["title"]
    finally:
        for service in reversed(started):
            service.stop()
