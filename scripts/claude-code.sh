#!/usr/bin/env bash
# The real Claude Code CLI for the agents test tier (tests/agents), installed from the package index alone: the
# claude-agent-sdk wheel bundles the `claude` binary (claude_agent_sdk/_bundled/claude), so no npm and no download
# from anywhere else. Pinned by version and sha256; cached outside .venv (like scripts/vllm-cpu.sh), shared by clones.
#   scripts/claude-code.sh      download (once), verify, extract; prints the binary's path (and installs strace if missing)
# Idempotent: a second run finds the marker and prints the path at once. Cache: ~400 MB (the wheel, ~180 MB, is
# deleted after extraction). Moving the pin: set SDK_VERSION, SDK_SHA256 (pip download it, sha256sum) and CLI_VERSION
# (`claude --version`), then re-record tests/agents/fixtures/ (python -m tests.agents.record).
set -euo pipefail
source "$(dirname "$0")/common.sh"

SDK_VERSION=0.2.189
SDK_SHA256=b26a6a30a4e2cb025a6f5c95e1ce4469b38fcc51015c392f627bea7c948d67ad
CLI_VERSION=2.1.332  # what this wheel bundles (its claude_agent_sdk/_bundled/claude.version)
WHEEL="claude_agent_sdk-$SDK_VERSION-py3-none-manylinux_2_17_x86_64.whl"
CCACHE="${PD_CLAUDE_CACHE:-$HOME/.cache/pd-deploy/claude-code}"
DIR="$CCACHE/$SDK_VERSION"
BIN="$DIR/claude"

# The tier runs the CLI under strace (tests/agents/claude_code.py) to prove it connects to the router alone.
if ! command -v strace >/dev/null; then
    [[ "$(id -u)" == 0 ]] || die "strace is missing; install it (apt-get install strace) and rerun"
    say "installing strace"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq strace >&2
fi
if [[ -x "$BIN" && -f "$DIR/.complete" ]]; then
    echo "$BIN"
    exit 0
fi
[[ "$(uname -m)" == x86_64 ]] || die "claude-code.sh pins the x86_64 wheel of claude-agent-sdk; this host is $(uname -m)"
if [[ -x "$VENV/bin/python" ]]; then py="$VENV/bin/python"; else py=python3; fi

mkdir -p "$DIR"
work="$(mktemp -d "$CCACHE/.download.XXXXXX")"
trap 'rm -rf "$work"' EXIT
say "downloading claude-agent-sdk $SDK_VERSION (~180 MB; it bundles Claude Code $CLI_VERSION) into $DIR"
"$py" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 \
    --dest "$work" "claude-agent-sdk==$SDK_VERSION" >&2
[[ -f "$work/$WHEEL" ]] || die "pip did not download $WHEEL (found: $(ls "$work"))"
echo "$SDK_SHA256  $work/$WHEEL" | sha256sum --check --quiet - >&2 \
    || die "$WHEEL does not have the pinned sha256 $SDK_SHA256"
"$py" - "$work/$WHEEL" "$work/claude" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open("claude_agent_sdk/_bundled/claude") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
chmod 755 "$work/claude"
found="$("$work/claude" --version)"
[[ "$found" == "$CLI_VERSION "* ]] || die "the wheel's claude says '$found', expected $CLI_VERSION"
mv "$work/claude" "$BIN"
: >"$DIR/.complete"
echo "$BIN"
