# Shared by every bootstrap step: paths, names and small helpers. Sourced, never run.
# Each step is idempotent: it checks what is already there and does only what is missing.

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$REPO/.cache"
VENV="${PD_VENV:-$REPO/.venv}"   # PD_VENV: another checkout's venv (e.g. a git worktree sharing one)
# The one image every CPU service runs (the command picks the role).
PD_IMAGE="${PD_IMAGE:-pd-deploy/app:latest}"
# Base image made from Debian packages when no registry can give python:3.11-slim.
LOCAL_BASE="pd-deploy/base:bookworm"
DEFAULT_BASE="python:3.11-slim"

mkdir -p "$CACHE"

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# A step's own output (apt, dpkg, pip, mmdebstrap, docker pull) goes to .cache/logs/NAME.log, not the terminal, which
# gets the step's one `say` line naming that log; if the step fails, the log's last lines and its path.
LOG_DIR="$CACHE/logs"
step_log() { printf '%s' "${LOG_DIR#"$REPO"/}/$1.log"; }
quietly() {  # quietly NAME COMMAND [ARGS...]
    local log="$LOG_DIR/$1.log" rc=0
    shift
    mkdir -p "$LOG_DIR"
    printf '\n$ %s\n' "$*" >>"$log"
    "$@" >>"$log" 2>&1 || rc=$?
    if [[ "$rc" != 0 ]]; then
        printf 'error: %s failed (exit %s); the end of %s:\n' "$1" "$rc" "$log" >&2
        tail -n 20 "$log" | sed 's/^/    /' >&2
    fi
    return "$rc"
}

# Digest of files' contents, so a step reruns only when its inputs change.
digest() { cat "$@" | sha256sum | cut -c1-16; }

# Compose v2 plugin directory: honour DOCKER_CONFIG like the docker CLI does.
plugin_dir() { echo "${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"; }

compose_ok() { docker compose version --short >/dev/null 2>&1; }

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# For images made from Debian packages (base-image.sh, prometheus-image.sh): installs mmdebstrap if it is
# missing, and sets `mirror`, `security` and `sources` (mmdebstrap's source lines: bookworm and
# bookworm-updates from the main archive and, where configured, bookworm-security). The mirrors come
# from this machine's apt configuration (one-line or deb822 style), never a fixed host.
debian_sources() {
    if ! command -v mmdebstrap >/dev/null; then
        [[ "$(id -u)" == 0 ]] || die "mmdebstrap is missing; install it (apt-get install mmdebstrap) and rerun"
        say "installing mmdebstrap (apt; output in $(step_log apt))"
        quietly apt apt-get update -qq
        quietly apt env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap
    fi
    local mirrors
    mirrors="$( { grep -hsE '^(deb |URIs:)' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
                   /etc/apt/sources.list.d/*.sources || true; } | grep -oE '(https?|file)://[^ ]+')"
    mirror="$(grep -v -- '-security' <<<"$mirrors" | head -n1 || true)"
    security="$(grep -- '-security' <<<"$mirrors" | head -n1 || true)"
    [[ -n "$mirror" ]] || die "no Debian mirror found in /etc/apt/sources.list{,.d}"
    sources=("deb $mirror bookworm main" "deb $mirror bookworm-updates main")
    if [[ -n "$security" ]]; then sources+=("deb $security bookworm-security main"); fi
}
