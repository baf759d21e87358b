"""How NIXL's KV really moves between the vLLM engines: CUDA IPC / shared memory, or a silent TCP fallback.

NIXL hands the KV to UCX, which picks a transport per peer and says so only in its own log. Two vLLM containers
on one host that share no PID namespace (or do not see each other's GPU) cannot open each other's CUDA IPC
handles, and UCX falls back to TCP at about 1 % of the link while every request still answers 200
(vllm-project/vllm#55906; ../shared/reference/anchors-2026-12.md §2 #12). The lines read (doctor/signatures.py
UCX_TRANSPORT; UCX_LOG_LEVEL=info, which the vLLM overlays set):
- lane selection, per endpoint configuration: `ucp_worker.c:1912 UCX INFO ucp_context_0 intra-node cfg#2
  rma_am(tcp/eth1) amo_am(tcp/eth1) am(tcp/eth1 … cuda_ipc/cuda) ka(tcp/eth1)` (ai-dynamo/nixl#1097: cuda_ipc
  present only as an active-message lane, RMA emulated over TCP);
- the protocol table of UCX_PROTO_INFO=y: `… | software emulation | tcp/eth0 |` (vllm-project/vllm#51377, #55906);
- `cuda-ipc get zcopy disabled as no nvlinks detected` (UCX uct/cuda/cuda_ipc/cuda_ipc_iface.c, debug level): no
  NVLink, so NixlConnector's pulls (GET/READ) cannot use CUDA IPC (vllm-project/vllm#52607: 0.5 GB/s pull vs
  49 GB/s push; fixed in NIXL by ai-dynamo/nixl#2208);
- `invalid device context`: CUDA IPC handle import across PID namespaces failed (vllm-project/vllm#55906).
A TCP lane is a fallback only when the KV is GPU memory (a cuda transport appears in UCX's lines); for the CPU
build (compose.vllm-cpu.yaml, kv_buffer_device "cpu") TCP between two containers is the expected path, reported
as a fact.
"""

from __future__ import annotations

import re

from doctor.findings import Context, Finding, finding
from doctor.parse import UPSTREAM, Record
from doctor.signatures import UCX_TRANSPORT

# `<context> <scope> cfg#N <lanes>`: the context is `ucp_context_0` (nixl#1097) or, as NIXL names it, the agent's id
# (recorded here: UCX 1.23 in nixl-cu13 1.5.1); scope self / intra-node / inter-node.
_LANES = re.compile(r"UCX\s+INFO\s+\S+ (self|intra-node|inter-node) cfg#\d+ (.*)")
_LANE = re.compile(r"(\w+)\(([^)]*)\)")
_DATA_LANES = {"rma", "rma_bw", "rma_am"}  # the lanes that carry NIXL's READ/WRITE of KV blocks
_CUDA = re.compile(r"\b(?:cuda_ipc|cuda_copy|gdr_copy)/")
_FAST = re.compile(r"^(?:cuda_ipc|posix|sysv|cma|knem|xpmem|rc\w*|dc\w*|ud\w*)/")  # IPC, shared memory, RDMA
_NO_NVLINK = "cuda-ipc get zcopy disabled as no nvlinks detected"
SAME_HOST_FIX = ("compose.gpu.yaml does this: both engines see every GPU (count: all, CUDA_VISIBLE_DEVICES picks "
                 "their own), prefill joins decode's PID namespace (pid: \"service:decode\"), both ipc: host; then "
                 "docker compose up -d --force-recreate prefill decode, and check `docker compose logs decode | "
                 "grep cfg#` names cuda_ipc in rma(…)")


def check(ctx: Context) -> list[Finding]:
    lines = ctx.by_event(UPSTREAM + UCX_TRANSPORT.id)
    if not lines:
        return []
    gpu = any(_CUDA.search(r.line) for r in lines)
    tcp_only = [r for r in lines if _tcp_only_rma(r.line)]
    fast = [r for r in lines if _fast_rma(r.line)]
    emulated = [r for r in lines if re.search(r"software emulation\s*\|\s*tcp/", r.line)]
    ipc_failed = [r for r in lines if "invalid device context" in r.line]
    no_nvlink = [r for r in lines if _NO_NVLINK in r.line]
    out: list[Finding] = []
    if gpu and (tcp_only or emulated or ipc_failed) and not fast:
        out.append(finding(
            "nixl.tcp_fallback", "warning",
            "NIXL moves the GPU KV over TCP: UCX found no CUDA IPC path between prefill and decode",
            "UCX chose TCP for the KV reads (" + _lanes_text(tcp_only or emulated or ipc_failed) + "). Two containers on "
            "one host without a shared PID namespace and mutual GPU visibility cannot open each other's CUDA IPC handles "
            "(\"invalid device context\"), so UCX emulates RMA over TCP at about 1 % of the link while every request "
            "still answers 200 (vllm-project/vllm#55906, ai-dynamo/nixl#1097).",
            SAME_HOST_FIX, tcp_only + emulated + ipc_failed))
    if gpu and no_nvlink:
        out.append(finding(
            "nixl.pull_without_nvlink", "warning",
            "GPUs without NVLink: UCX serves NixlConnector's pulls (GET) over TCP, not CUDA IPC",
            "UCX disables CUDA IPC GET when it detects no NVLink (cuda_ipc_iface.c: \"" + _NO_NVLINK + "\"); "
            "NixlConnector (= NixlPullConnector) reads the KV, so it moves at about 0.5 GB/s where a push "
            "gets 49 GB/s (vllm-project/vllm#52607; NIXL's fix: ai-dynamo/nixl#2208).",
            "set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on in .env (compose.gpu.yaml passes it to both engines), or "
            "VLLM_NIXL_CONNECTOR=NixlPushConnector with a vLLM that has it; then "
            "docker compose up -d --force-recreate prefill decode", no_nvlink))
    if not out:
        kind = "GPU memory over " if gpu else "host memory (CPU build) over "
        lanes = fast or tcp_only or lines
        out.append(finding(
            "nixl.transport", "ok", f"NIXL KV moves as {kind}{_lanes_text(lanes)}",
            "UCX's own lane selection. " + ("" if gpu or not tcp_only else
                                            "TCP between two containers is the expected path for host-memory KV "
                                            "(kv_buffer_device \"cpu\": compose.vllm-cpu.yaml)."),
            "nothing to fix", lanes))
    return out


def _data_lanes(line: str) -> list[str]:
    """The transports of the RMA lanes (rma, rma_bw, rma_am) of one lane-selection line to a peer (a worker's
    `self` configuration is its loopback, not the path to the other engine)."""
    match = _LANES.search(line)
    if not match or match.group(1) == "self":
        return []
    return [tl for name, tls in _LANE.findall(match.group(2)) if name in _DATA_LANES for tl in tls.split()]


def _tcp_only_rma(line: str) -> bool:
    lanes = _data_lanes(line)
    return bool(lanes) and all(tl.startswith("tcp/") for tl in lanes)


def _fast_rma(line: str) -> bool:
    return any(_FAST.match(tl) for tl in _data_lanes(line))


def _lanes_text(records: list[Record]) -> str:
    """`intra-node rma_am(tcp/eth1)` for the first peer's lane line, else the line itself (shortened)."""
    for r in records:
        match = _LANES.search(r.line)
        if match and match.group(1) != "self":
            data = [f"{n}({t})" for n, t in _LANE.findall(match.group(2)) if n in _DATA_LANES]
            return f"{match.group(1)} " + (" ".join(data) or "no RMA lane")
    return records[0].line[-120:] if records else "?"
