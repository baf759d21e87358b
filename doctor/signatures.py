"""Failure strings of real PD engines (vLLM, NIXL, UCX, SGLang, Mooncake, NCCL, LMCache) → cause and fix.

Each signature is the exact text those projects log (a regex over the stable part of the format
string), the cause, the fix and where the string comes from: cited upstream lines, collected in
../shared/reference/anchors-2026-12.md §2 with the source file or issue thread given here. Those a
real vLLM 0.32.0 (CPU) printed in this project's own runs (issue 11: the vllm tier) are also recorded
as bundles, tests/unit/doctor/bundles/vllm_*/: the connector errors, the KV lease lines and the
transfer metrics.
The unit fixtures (tests/unit/doctor/bundles/upstream_*.log) carry one line per signature, each
with a comment naming its source.

Lines are matched only when they are not our JSON events (an engine's plain log output, or a `log`
event's message), with one combined regex, so JSON-heavy logs pay nothing for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Signature:
    id: str  # the finding id
    severity: str  # warning | error
    pattern: str  # regex over the logged text
    title: str
    cause: str
    fix: str
    source: str  # upstream file / issue thread the exact string comes from
    proof: bool = False  # a positive line: KV really moved (verify on a vLLM stack looks for it)
    fact: bool = False  # not a finding by itself: a check reads these lines (UCX transport: checks/nixl_transport.py)


RESTART_BOTH = "restart both engines: docker compose up -d --force-recreate prefill decode"

SIGNATURES: tuple[Signature, ...] = (
    Signature(
        "vllm.unknown_connector", "error",
        r"Unsupported connector type: (\S+)",
        "A vLLM engine names a KV connector its vLLM does not have: it refuses to start",
        "--kv-transfer-config's kv_connector is not registered in this vLLM, so the server exits at start (the "
        "container restarts or stays down). P2pNcclConnector is gone since vLLM PR #44854 (after v0.22.1): not in 0.32.0 or 0.33.0.",
        "P2pNccl: use compose.gpu.p2pnccl.yaml as shipped (it pins vllm/vllm-openai:v0.22.1, the last release before "
        "vllm-project/vllm#44854 removed it); otherwise name a connector this vLLM has (NixlConnector: compose.gpu.yaml); "
        "docker compose logs prefill decode | grep -i connector",
        "vllm-project/vllm vllm/distributed/kv_transfer/kv_connector/factory.py; recorded from vLLM 0.32.0 CPU "
        "(tests/unit/doctor/bundles/vllm_wrong_connector)"),
    Signature(
        "vllm.no_kv_connector", "error",
        r"Got kv_transfer_params, but no KVConnector found\. Disabling KVTransfer for this request\.",
        "An engine got kv_transfer_params but runs without a KV connector: PD is silently off",
        "The vLLM engine was started without --kv-transfer-config, so it ignores the hand-off and recomputes the "
        "whole prefill itself. Answers are 200 and health is OK, but nothing is disaggregated.",
        "start both engines with --kv-transfer-config '{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}' "
        "(compose.gpu.yaml's KV_CONNECTOR); " + RESTART_BOTH,
        "vllm-project/vllm vllm/v1/engine/core.py; kserve/kserve#5987"),
    Signature(
        "vllm.kv_params_invalid", "error",
        r"Got invalid KVTransferParams: .* This request will not utilize KVTransfer",
        "Decode got incomplete kv_transfer_params and recomputes the prefill",
        "The parameters prefill returned lack remote_engine_id / remote_host / remote_port / remote_request_id "
        "(an old router or a proxy that drops fields), so decode cannot pull the KV.",
        "pass prefill's kv_transfer_params to decode unchanged (router: python -m doctor explain <request id>); "
        "use the same vLLM version on both sides",
        "vllm-project/vllm vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py (../shared/reference/vllm_pd.md §2)"),
    Signature(
        "nixl.engine_id_mismatch", "error",
        r"Remote NIXL agent engine ID mismatch\. Expected \S+?,\s*received \S+",
        "NIXL handshake reached the wrong engine (engine ID mismatch)",
        "Decode's handshake to prefill's side channel was answered by another engine: VLLM_NIXL_SIDE_CHANNEL_HOST "
        "left at localhost across hosts, or two engines behind one side-channel address. Decode recomputes.",
        "set VLLM_NIXL_SIDE_CHANNEL_HOST to each engine's own reachable address (and a distinct "
        "VLLM_NIXL_SIDE_CHANNEL_PORT per engine on one host); " + RESTART_BOTH,
        "vllm-project/vllm#27083"),
    Signature(
        "nixl.compat_mismatch", "error",
        r"NIXL compatibility hash mismatch",
        "Prefill and decode have incompatible vLLM configurations (NIXL compatibility hash)",
        "The handshake compares a hash of vLLM version, model, dtype, KV layout and attention backend; they differ, "
        "so every transfer is refused.",
        "run the same image, --model, --dtype, --kv-cache-dtype and attention backend on prefill and decode; "
        + RESTART_BOTH,
        "vllm-project/vllm vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py (PR #29503)"),
    Signature(
        "nixl.block_size_mismatch", "error",
        r"Local block size (\d+) is not divisible by remote block size (\d+)",
        "Prefill and decode use different --block-size",
        "NIXL maps KV blocks one to one; decode's block size must be a multiple of prefill's. The servers stay "
        "healthy while every handshake fails.",
        "give both engines the same --block-size (e.g. 16); " + RESTART_BOTH,
        "vllm-project/vllm#42895"),
    Signature(
        "nixl.port_in_use", "error",
        r"ZMQError: Address already in use \(addr='?(tcp://[^')]+)",
        "A NIXL side-channel / ZMQ port is already taken",
        "Two engines (or an engine and its KV-events publisher) bind the same ZMQ port on one host.",
        "give each engine on a host its own VLLM_NIXL_SIDE_CHANNEL_PORT (default 5600) and KV-events port",
        "vllm-project/vllm#20965, vllm-project/vllm#25059"),
    Signature(
        "nixl.transfer_failure", "error",
        r"NIXL transfer failure: \S+",
        "A NIXL KV transfer failed on decode",
        "The NIXL read/write of prefill's KV failed (handshake_failed, transfer_setup_failed, transfer_failed, …); "
        "decode then fails or recomputes per kv_load_failure_policy.",
        "read the failure type in the line; check that decode reaches prefill's side channel and UCX transport; "
        + RESTART_BOTH,
        "vllm-project/vllm vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py"),
    Signature(
        "nixl.remote_disconnect", "error",
        r"NIXL_ERR_REMOTE_DISCONNECT|nixlRemoteDisconnectError",
        "The NIXL peer disconnected (UCX connection dead); the connector does not heal itself",
        "The UCX connection between the engines died (often after long uptime). Dead agents stay registered, so "
        "every later transfer with that peer fails until both engines restart.",
        RESTART_BOTH,
        "wtdcode/vllm-backport#33; ai-dynamo/nixl#1983, ai-dynamo/nixl#503"),
    Signature(
        "nixl.backend_error", "error",
        r"NIXL_ERR_BACKEND|NIXL_ERR_NOT_FOUND|no specified or potential backend could send the inter-agent notifications",
        "NIXL backend error (no usable transport between the agents)",
        "NIXL found no backend able to reach the peer, or the peer's agent is gone (follows a remote disconnect).",
        "check UCX_TLS / UCX_NET_DEVICES on both engines; " + RESTART_BOTH,
        "ai-dynamo/nixl#149, ai-dynamo/nixl#1983"),
    Signature(
        "ucx.no_cuda", "warning",
        r"memory is detected as host, check that UCX is configured with CUDA support",
        "UCX in the image has no CUDA support: KV goes through host memory",
        "The NIXL/UCX build in the image lacks CUDA, so GPU KV is staged through the host: slow transfers.",
        "use an image whose UCX is built with CUDA (ucx_info -d | grep cuda), or set UCX_TLS to include cuda_copy,cuda_ipc",
        "vllm-project/vllm#41048"),
    Signature(
        "vllm.shm_too_small", "error",
        r"Insufficient space in /dev/shm for shared-memory allocation: (\d+ MiB) required",
        "vLLM's container has too little /dev/shm: the engine core dies at start",
        "vLLM's engine core and its worker exchange requests through a shared-memory ring in /dev/shm; Docker gives a "
        "container 64 MiB, less than the ring needs, so the engine exits and the container never becomes healthy.",
        "give the vLLM services shm_size: 1g (compose.vllm-cpu.yaml) or ipc: host (compose.gpu.yaml); then "
        "docker compose up -d prefill decode",
        "vllm-project/vllm vllm/distributed/device_communicators/shm_broadcast.py check_shm_free_space; recorded "
        "here: vLLM 0.32.0 CPU in a container without shm_size"),
    Signature(
        "vllm.nixl_cpu_affinity", "error",
        r"sched_setaffinity\(0, rsv_cores_for_kv\)",
        "vLLM's NIXL worker (CPU build) could not pin itself to the host's last core: the engine dies at start",
        "On CPU, vLLM's NIXL worker reserves the last core of each NUMA node for KV transfers and pins its thread "
        "there (os.sched_setaffinity); a container whose cpuset lacks that core refuses with EINVAL "
        "(\"OSError: [Errno 22] Invalid argument\").",
        "drop the engine's cpuset (compose.vllm-cpu.yaml binds compute with VLLM_CPU_OMP_THREADS_BIND instead) or "
        "include the host's last core in it; then docker compose up -d prefill decode",
        "vllm-project/vllm vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py; recorded here: "
        "vLLM 0.32.0 CPU, prefill on cpuset 0 of a 2-core host"),
    Signature(
        "nixl.side_channel_bind", "error",
        r"ZMQError: No such device \(addr='?(tcp://[^')]+)",
        "The NIXL side channel could not bind: ZMQ took its host for a network device",
        "VLLM_NIXL_SIDE_CHANNEL_HOST names a host ZMQ could not resolve when it bound (a service name whose DNS "
        "answer was slow or missing), so ZMQ read it as an interface name; the engine exits at start.",
        "set VLLM_NIXL_SIDE_CHANNEL_HOST to the engine's address on the KV network (compose.vllm-cpu.yaml's "
        "entrypoint does), or make the name resolvable in that container; then docker compose up -d prefill decode",
        "vllm-project/vllm nixl side channel (zmq bind of tcp://HOST:PORT); recorded here: vLLM 0.32.0 CPU, "
        "VLLM_NIXL_SIDE_CHANNEL_HOST=prefill on a loaded host (the cause is this project's reading of it)"),
    Signature(
        "kv.stranded_on_prefill", "warning",
        r"Releasing expired KV blocks for request (\S+)",
        "KV computed by prefill expired before decode pulled it",
        "Decode never read the KV within the lease (vLLM 0.32: kv_connector_extra_config kv_lease_duration, 30 s; "
        "older: VLLM_NIXL_ABORT_REQUEST_TIMEOUT): decode crashed, the request was aborted, or decode cannot reach "
        "prefill. (A request whose prefill token ended it, router.prefill_finished, is not counted: no decode was due.)",
        "docker compose logs decode --since 10m; raise the lease (kv_lease_duration, or VLLM_NIXL_ABORT_REQUEST_TIMEOUT "
        "before 0.32) only if decode is merely slow",
        "vllm-project/vllm nixl_connector.py get_finished; vllm-project/vllm#25562; vLLM 0.32.0 nixl/base_worker.py "
        "_reap_expired_send_leases (recorded: tests/unit/doctor/bundles/vllm_kv_expiry, vllm_eos_at_prefill)"),
    Signature(
        "kv.read_after_expiry", "error",
        r"Potentially invalid KV blocks for unrecognized request (\S+) were retrieved by a decode worker",
        "Decode read KV blocks after prefill had released them: output may be silently wrong",
        "Decode pulled after the lease expired; the blocks may already hold another request's KV.",
        "raise the KV lease (kv_connector_extra_config kv_lease_duration; VLLM_NIXL_ABORT_REQUEST_TIMEOUT before 0.32) "
        "above decode's worst queueing delay and the router's [scheduler] kv_lease_ms with it; add decode capacity",
        "vllm-project/aibrix#1772 (../shared/reference/vllm_pd.md §3)"),
    Signature(
        "sglang.bootstrap_timeout", "error",
        r"KVTransferError\(bootstrap_room=\S+\).*timed out after [\d.]+s in KVPoll\.Bootstrapping",
        "SGLang prefill↔decode bootstrap timed out",
        "The bootstrap handshake between the SGLang prefill and decode servers never completed (wrong "
        "--disaggregation-bootstrap-port, a blocked port, or overload).",
        "check --disaggregation-bootstrap-port and that decode reaches it; lower concurrency",
        "sgl-project/sglang#10110, sgl-project/sglang#9266"),
    Signature(
        "sglang.kv_wait_timeout", "error",
        r"timed out after [\d.]+s in KVPoll\.WaitingForInput|Some requests fail to receive KV Cache transfer done signal",
        "SGLang decode waited for KV that never arrived",
        "Decode bootstrapped but the KV transfer-done signal never came (transfer backend stalled or overloaded).",
        "export SGLANG_DISAGGREGATION_WAITING_TIMEOUT=600 only if TTFT allows; check the transfer backend (Mooncake/NIXL)",
        "sgl-project/sglang#11648, sgl-project/sglang#10204"),
    Signature(
        "sglang.aborted_leg", "warning",
        r"KVTransferError\([^)]*\): Aborted by AbortReq",
        "An SGLang PD leg was aborted (the other leg was cancelled)",
        "The client or router cancelled the request and the other leg's transfer was aborted.",
        "usually harmless when clients cancel; if frequent, look at router timeouts",
        "sgl-project/sglang#9266, sgl-project/sglang#12688"),
    Signature(
        "mooncake.mr_register_failed", "error",
        r"Failed to register memory 0x[0-9a-f]+: |Mooncake memory registration failed",
        "Mooncake could not register RDMA memory",
        "RDMA memory-region registration failed: memlock ulimit, MR limits or the device.",
        "run with ulimits memlock=-1 and the RDMA device mapped into the container",
        "sgl-project/sglang#6894; kvcache-ai/Mooncake#454"),
    Signature(
        "mooncake.session_dead", "error",
        r"remote mooncake session \S+ is not alive|Timeout waiting for P side ready",
        "The Mooncake peer session is dead",
        "Decode (or prefill) is gone, or the two sides run different transfer-engine versions.",
        "docker compose ps; use the same Mooncake version on both sides; " + RESTART_BOTH,
        "kvcache-ai/Mooncake#2177; vllm-project/vllm#50719"),
    Signature(
        "nccl.container_shm", "error",
        r"NCCL Error 2: unhandled system error",
        "NCCL cannot set up inside the container (P2pNccl)",
        "The container lacks shared memory / IPC (no --ipc=host or small shm_size) or a usable interface.",
        "add ipc: host (or shm_size: 16g) to both engines and set NCCL_SOCKET_IFNAME; rerun with NCCL_DEBUG=WARN",
        "NVIDIA/nccl#473, NVIDIA/nccl-tests#14, vllm-project/vllm#10523"),
    Signature(
        "lmcache.zero_hit", "warning",
        r"LMCache hit tokens: 0, need to load: 0",
        "LMCache decode found none of prefill's KV (it recomputes)",
        "Prefill reports a transfer but decode gets zero hit tokens: long prompts or a proxy that saved N instead "
        "of N+1 tokens.",
        "check the LMCache chunk settings on both sides and the proxy's first-token handling",
        "LMCache/LMCache#1547, LMCache/LMCache#978"),
    Signature(
        "vllm.kv_transfer_metrics", "ok",
        r"KV Transfer metrics: Num successful transfers=([1-9]\d*)",
        "vLLM reports successful KV transfers",
        "vLLM's own proof that KV moved between the engines.",
        "nothing to fix",
        "vllm-project/vllm#42703", proof=True),
)

# How UCX moves NIXL's KV: lanes chosen (UCX_LOG_LEVEL=info), protocol tables (UCX_PROTO_INFO=y) and CUDA IPC
# failures. Read together by doctor/checks/nixl_transport.py, which tells CUDA IPC / shared memory from a TCP
# fallback; each alternative's source is cited there.
UCX_TRANSPORT = Signature(
    "ucx.transport", "ok",
    r"UCX\s+INFO\s+\S+ (?:self|intra-node|inter-node) cfg#\d+ |cuda-ipc get zcopy disabled as no nvlinks detected|"
    r"software emulation\s*\|\s*tcp/|invalid device context",
    "UCX transport selection", "How UCX moves NIXL's KV between the engines.", "see doctor/checks/nixl_transport.py",
    "ai-dynamo/nixl#1097, vllm-project/vllm#55906, vllm-project/vllm#52607", fact=True)
SIGNATURES += (UCX_TRANSPORT,)

BY_ID = {s.id: s for s in SIGNATURES}
_COMPILED = tuple((s, re.compile(s.pattern)) for s in SIGNATURES)
# One pass over a line decides whether any signature can match (most lines: no).
_ANY = re.compile("|".join(f"(?:{s.pattern})" for s in SIGNATURES))


def match(text: str) -> Signature | None:
    """The first signature this line shows, or None."""
    if _ANY.search(text) is None:
        return None
    return next((s for s, rx in _COMPILED if rx.search(text)), None)
