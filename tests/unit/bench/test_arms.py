"""stack.bench.arms and stacks: arm names, their cpus, and the vLLM projects rendered from the real compose files."""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess

import pytest

from stack.bench import arms, compare, stacks


def parse(*argv: str, out) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_cli_args(parser)
    args = parser.parse_args([*argv, "--api-key", "k", "--out", str(out)])
    return args


@pytest.mark.parametrize("name, message", [
    ("vllm:colocated-chunked", "unknown shape 'colocated-chunked' for the vllm engine"),
    ("colocated:warm", "'warm' is not cache or nocache"),
    ("disaggregated@0", "disaggregated takes @CPUS/CPUS, got @0"),
    ("colocated@0/1", "colocated takes @CPUS, got @0/1"),
])
def test_bad_arm_names_are_refused_by_name(name: str, message: str) -> None:
    """Each malformed arm is an error that quotes it and says what would be right."""
    with pytest.raises(arms.ArmError, match=message):
        arms.parse_name(name)


def test_placement_splits_the_cores_per_arm(tmp_path) -> None:
    """`@P/D` places prefill and decode (`+` joins cpus of one set); without it the --*-cpus defaults apply; vLLM arms
    bind their threads through the overlay's PREFILL_CPUS / DECODE_CPUS, a colocated one on the decode service."""
    args = parse("--stacks", "disaggregated@0+1/1,disaggregated,vllm:disaggregated@1/0,vllm:colocated,vllm:colocated-x2",
                 "--checkpoint", "tiny-llama", out=tmp_path)
    assert compare.check(args) == []
    shared, plain, vpd, vcol, vx2 = arms.build_arms(args)
    assert (shared.env["PREFILL_CPUS"], shared.env["DECODE_CPUS"]) == ("0,1", "1")
    assert (plain.env["PREFILL_CPUS"], plain.env["DECODE_CPUS"]) == ("0", "1")
    assert (vpd.engine, vpd.env["PREFILL_CPUS"], vpd.env["DECODE_CPUS"]) == ("vllm", "1", "0")
    assert vcol.env["DECODE_CPUS"] == "0,1" and "PREFILL_CPUS" not in vcol.env
    assert (vx2.env["DECODE_CPUS"], vx2.replica_cpus) == ("0", "1")
    # One checkpoint for every arm: written once, mounted at /models, named to both engines.
    assert shared.env["PD_CHECKPOINT"] == vpd.env["VLLM_MODEL"] == "/models/tiny-llama"
    written = tmp_path / "checkpoint" / "tiny-llama"
    assert json.loads((written / "config.json").read_text())["max_position_embeddings"] == 2048
    # Readable by the containers' unprivileged users (vLLM runs as `vllm`): safetensors writes its file owner-only.
    assert all(p.stat().st_mode & 0o004 for p in written.iterdir())


def test_vllm_arms_need_a_checkpoint_both_engines_serve(tmp_path) -> None:
    """A dummy model exists only in the numpy engine: a vLLM arm with it is refused, naming the flag to use."""
    args = parse("--stacks", "colocated,vllm:disaggregated", out=tmp_path)
    assert any("--checkpoint tiny-llama" in p for p in compare.check(args))


def test_a_checkpoint_the_engines_cannot_read_is_refused_by_file(tmp_path) -> None:
    """The engines run unprivileged in their containers: a weights file only its owner may read is named up front
    instead of leaving the engine unhealthy at start."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "config.json").chmod(0o644)
    (checkpoint / "model.safetensors").write_bytes(b"")
    (checkpoint / "model.safetensors").chmod(0o600)
    args = parse("--stacks", "vllm:colocated", "--checkpoint", str(checkpoint), out=tmp_path)
    problems = compare.check(args)
    assert len(problems) == 1 and "model.safetensors" in problems[0] and "chmod a+r" in problems[0]
    (checkpoint / "model.safetensors").chmod(0o644)
    assert compare.check(parse("--stacks", "vllm:colocated", "--checkpoint", str(checkpoint), out=tmp_path)) == []


def rendered_project(tmp_path, stack: str, *extra: str) -> dict:
    """The project file `compose` would start for a vLLM arm, from the real compose.yaml + compose.vllm-cpu.yaml."""
    args = parse("--stacks", stack, "--checkpoint", "tiny-llama", "--max-model-len", "4096", *extra, out=tmp_path)
    arm, = arms.build_arms(args)
    project = f"pdtest-arms-{secrets.token_hex(3)}"
    argv = stacks.compose_argv(arm, project)
    try:
        generated = stacks.project_file(project)
        assert generated.stat().st_mode & 0o077 == 0  # it holds the stack's keys
        # The reshaped project is itself valid for docker compose.
        check = subprocess.run([*argv, "config", "--quiet"], capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stderr
        return json.loads(generated.read_text())
    finally:
        stacks.project_file(project).unlink(missing_ok=True)


def test_vllm_colocated_is_one_engine_without_a_kv_connector(tmp_path) -> None:
    """vllm:colocated: only decode and the router; decode serves the checkpoint without kv-transfer-config, with the
    arm's context and cache flag, threads on all the cores; both router legs go to it."""
    services = rendered_project(tmp_path, "vllm:colocated:nocache")["services"]
    assert set(services) == {"decode", "router"}
    command = services["decode"]["command"]
    assert command[0] == "/models/tiny-llama"
    assert not [a for a in command if a.startswith("--kv-transfer-config")]
    assert "--max-model-len=4096" in command and "--max-model-len=2048" not in command
    assert "--no-enable-prefix-caching" in command
    assert services["decode"]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    router = services["router"]
    assert router["environment"]["PREFILL_ENDPOINT"] == router["environment"]["DECODE_ENDPOINT"] == "http://decode:8000"
    assert "KV_CONNECTOR" not in router["environment"] and set(router["depends_on"]) == {"decode"}


def test_vllm_colocated_x2_adds_a_twin_on_the_other_cpus(tmp_path) -> None:
    """vllm:colocated-x2: decode on cpu 0 and its twin engine2 on cpu 1, both behind the router."""
    services = rendered_project(tmp_path, "vllm:colocated-x2")["services"]
    assert set(services) == {"decode", "engine2", "router"}
    assert services["decode"]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert services["engine2"]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert services["engine2"]["networks"]["kv"] == {"aliases": ["engine2-kv"]}
    assert services["router"]["environment"]["DECODE_ENDPOINT"] == "http://decode:8000,http://engine2:8000"


def test_vllm_disaggregated_keeps_the_overlays_nixl_wiring(tmp_path) -> None:
    """vllm:disaggregated@1/0: the overlay's 1P1D over NIXL as it ships, with the arm's threads and context."""
    services = rendered_project(tmp_path, "vllm:disaggregated@1/0")["services"]
    assert set(services) == {"prefill", "decode", "router"}
    for name, role, cpus in (("prefill", "kv_producer", "1"), ("decode", "kv_consumer", "0")):
        command = services[name]["command"]
        assert any(role in a for a in command if a.startswith("--kv-transfer-config")) and "--max-model-len=4096" in command
        assert services[name]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == cpus
    assert services["router"]["environment"]["KV_CONNECTOR"] == "nixl"
