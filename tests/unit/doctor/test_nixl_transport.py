"""doctor/checks/nixl_transport.py: how NIXL's KV moves, read from UCX's own lines (fixtures cite their source)."""

from __future__ import annotations

from pathlib import Path

from doctor.signatures import match
from tests.unit.doctor.helpers import by_id, diagnose

BUNDLES = Path(__file__).parent / "bundles"


def test_gpu_kv_over_tcp_between_containers_is_a_fallback_with_the_same_host_fix():
    """nixl#1097's lane line (RMA emulated over TCP although cuda_ipc is there) and #55906's proto row: a warning
    naming the lanes, the cause (no shared PID namespace / GPU visibility) and compose.gpu.yaml's fix."""
    findings, _ = diagnose(BUNDLES / "nixl_tcp_fallback_gpu.log")
    f = by_id(findings, "nixl.tcp_fallback")
    assert f.severity == "warning"
    assert "intra-node rma_am(tcp/eth1)" in f.cause and "vllm-project/vllm#55906" in f.cause
    assert 'pid: "service:decode"' in f.fix and "count: all" in f.fix
    assert {e.service for e in f.evidence} == {"decode"} and len(f.evidence) == 2
    assert "healthy" not in {x.id for x in findings}
    assert "upstream" not in " ".join(x.id for x in findings)  # the facts are read here, never a finding of their own


def test_no_nvlink_pull_is_named_even_when_cuda_ipc_carries_writes():
    """`cuda-ipc get zcopy disabled as no nvlinks detected`: the pull connector's reads go over TCP (#52607)."""
    findings, _ = diagnose(BUNDLES / "nixl_no_nvlink_gpu.log")
    ids = {f.id for f in findings}
    assert "nixl.tcp_fallback" not in ids  # cuda_ipc is an RMA lane: the PID namespace is shared
    f = by_id(findings, "nixl.pull_without_nvlink")
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on" in f.fix and "ai-dynamo/nixl#2208" in f.cause


def test_lines_that_are_not_ucx_transport_do_not_match():
    assert match("(APIServer pid=1) INFO 12-01 [api_server.py:1] Started server process") is None
    assert match("ucp_worker.c:1912 UCX  INFO    ucp_context_0 intra-node cfg#1 rma(posix/memory)").id == "ucx.transport"


def test_recorded_cpu_overlay_lines_are_host_memory_over_tcp_and_fine():
    """Recorded from compose.vllm-cpu.yaml: UCX 1.23 names the context by the NIXL agent id; host-memory KV over TCP
    between two containers is the CPU overlay's expected path, an ok fact, never a fallback warning."""
    findings, _ = diagnose(BUNDLES / "nixl_transport_cpu_recorded.log")
    f = by_id(findings, "nixl.transport")
    assert f.severity == "ok" and "host memory" in f.title and "rma_am(tcp/eth" in f.title
    assert not [x for x in findings if x.id.startswith("nixl.") and x.severity != "ok"]
