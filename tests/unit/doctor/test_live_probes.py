"""Live probes that need no stack: the compose v1 trap and reading the key (never printing it)."""

from __future__ import annotations

import stat

import pytest

from doctor import live
from doctor.errors import DoctorError


def _tool(folder, name: str, script: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_compose_v1_only_is_the_unknown_flag_wait_trap(tmp_path, monkeypatch):
    """A docker CLI without the compose plugin and a v1 docker-compose → error naming v1 and --wait."""
    _tool(tmp_path, "docker", 'case "$1" in version) echo "28.2.2 20.10.24 1.41";; '
                              '*) echo "docker: unknown command: docker compose" >&2; exit 1;; esac\n')
    _tool(tmp_path, "docker-compose", 'echo "1.29.2"\n')
    monkeypatch.setenv("PATH", str(tmp_path))
    found = {f.id: f for f in live.probe_docker()}
    assert found["docker.version"].title == "docker client 28.2.2, engine 20.10.24 (API 1.41)"
    compose = found["docker.compose"]
    assert compose.severity == "error"
    assert "docker-compose 1.29.2, v1" in compose.title and "unknown flag: --wait" in compose.cause
    assert "cli-plugins" in compose.fix


def test_no_docker_means_the_doctor_cannot_run(tmp_path, monkeypatch):
    """No docker CLI on PATH → DoctorError (exit 2), not a finding."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(DoctorError, match="not on PATH"):
        live.probe_docker()


def test_key_read_from_env_then_dotenv(tmp_path, monkeypatch):
    """The shell's TAOTOKEN_API_KEY wins over .env, as in compose."""
    monkeypatch.delenv("TAOTOKEN_API_KEY", raising=False)
    env_file = tmp_path / ".env"
    env_file.write_text("# comment\nTAOTOKEN_API_KEY=sk-from-dotenv\nOTHER=1\n")
    assert live.read_key(env_file) == "sk-from-dotenv"
    monkeypatch.setenv("TAOTOKEN_API_KEY", "sk-from-shell")
    assert live.read_key(env_file) == "sk-from-shell"


def _vllm_stack(monkeypatch, lines: list[str]):
    """sources.load_docker replaced by vLLM's plain log lines (decode) read as from a compose project."""
    from doctor import sources

    def load(project, since):
        loaded = sources.Loaded()
        loaded.add(lines, "docker:pd/decode", "decode")
        loaded.docker = {"project": project, "services": {"decode": "running"}}
        return loaded

    monkeypatch.setattr(sources, "load_docker", load)
    return type("S", (), {"project": "pd"})()


def _router_only_timeline():
    from doctor.timeline import Timeline
    from tests.unit.doctor.scenarios import Log, request
    from doctor.parse import parse_lines

    log = Log()
    rid = request(log, 1)
    records, _ = parse_lines([x for x in log.render("v2") if x.startswith("router")], "t")
    return Timeline(rid, [r for r in records if r.request_id == rid])


def test_verify_on_vllm_requires_vllm_kv_transfer_metrics(monkeypatch, tmp_path):
    """Router legs done but engines are vLLM: verified only with `KV Transfer metrics: Num successful transfers` > 0."""
    from datetime import datetime, timezone

    from doctor import environment

    env = environment.snapshot(tmp_path, environ={})
    timeline = _router_only_timeline()
    assert live._foreign_engines(timeline)
    proof = ("(APIServer pid=1) INFO 12-01 09:12:25 [metrics.py:120] KV Transfer metrics: Num successful transfers=2, "
             "Avg xfer time (ms)=63.33")
    stack = _vllm_stack(monkeypatch, [proof])
    found = live._verify_vllm(stack, env, datetime.now(timezone.utc), "r1", "200", timeline, wait_s=0)
    assert found[0].id == "verify" and found[0].severity == "ok"
    assert any("KV Transfer metrics" in e.line for e in found[0].evidence)

    stack = _vllm_stack(monkeypatch, ["(EngineCore_DP0 pid=1) WARNING 12-01 09:12:03 [core.py:712] Got kv_transfer_params, "
                                      "but no KVConnector found. Disabling KVTransfer for this request."])
    found = live._verify_vllm(stack, env, datetime.now(timezone.utc), "r1", "200", timeline, wait_s=0)
    assert [f.id for f in found] == ["verify.no_vllm_kv_proof", "vllm.no_kv_connector"]


def test_verify_on_a_recorded_vllm_pd_stack_proves_kv_from_vllms_own_line(monkeypatch, tmp_path):
    """`verify` end to end over what a real vLLM 0.32 PD stack logged (bundles/vllm_pd_healthy, the streamed request
    renamed to verify's id): the router's timeline alone would look complete; the proof is decode's KV Transfer
    metrics line, and the finding shows it."""
    import argparse
    import uuid
    from pathlib import Path

    from doctor import sources

    bundle = Path(__file__).parent / "bundles" / "vllm_pd_healthy"
    rid_hex = "0123456789ab0123456789ab01234567"
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(rid_hex))
    recorded = "be2f75a832554748811a585b2a81807b"  # the streamed request of the recorded run

    def load(project, since):
        loaded = sources.Loaded()
        for service in ("router", "prefill", "decode"):
            text = (bundle / f"{service}.log").read_text().replace(recorded, f"doctor-verify-{rid_hex[:12]}")
            loaded.add(text.splitlines(), f"docker:pd/{service}", service)
        loaded.docker = {"project": project, "services": {"router": "running", "prefill": "running", "decode": "running"}}
        return loaded

    monkeypatch.setattr(sources, "load_docker", load)
    monkeypatch.setattr(live, "send_stream", lambda url, model, rid, timeout: (True, "200, 6 chunks, [DONE]"))
    args = argparse.Namespace(project="pd", router_url="http://127.0.0.1:1", home=tmp_path, model="your-model-id", timeout=5)
    found, summary = live.verify(args, stack=type("S", (), {"project": "pd"})(), url="http://127.0.0.1:1")
    assert found[0].id == "verify" and found[0].severity == "ok", [(f.id, f.title) for f in found]
    assert "vLLM reports successful KV transfers" in found[0].title
    assert any("KV Transfer metrics: Num successful transfers=" in e.line and e.service == "decode" for e in found[0].evidence)
