# Shared by every bootstrap step: paths, names and small helpers. Sourced, never run.
# Each step is idempotent: it checks what is already there and does only what is missing.

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$REPO/.cache"
VENV="$REPO/.venv"
# The one image every CPU service runs (the command picks the role).
PD_IMAGE="${PD_IMAGE:-pd-deploy/app:latest}"
# Base image made from Debian packages when no registry can give python:3.11-slim.
LOCAL_BASE="pd-deploy/base:bookworm"
DEFAULT_BASE="python:3.11-slim"

mkdir -p "$CACHE"

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Digest of files' contents, so a step reruns only when its inputs change.
digest() { cat "$@" | sha256sum | cut -c1-16; }

# Compose v2 plugin directory: honour DOCKER_CONFIG like the docker CLI does.
plugin_dir() { echo "${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"; }

compose_ok() { docker compose version --short >/dev/null 2>&1; }
