#!/usr/bin/env bash
# redis-server on the host, for the tests of several routers sharing per-key limits (tests/unit/router_fleet):
# they start their own on a free loopback port. Debian's package; nothing is started or enabled here.
set -euo pipefail
source "$(dirname "$0")/common.sh"

command -v redis-server >/dev/null && exit 0
[[ "$(id -u)" == 0 ]] || die "redis-server is missing; install it (apt-get install redis-server) and rerun"
say "installing redis-server (Debian package) for the shared-limits tests (apt; output in $(step_log apt))"
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d 101: the package must not start a daemon of its own (the tests start theirs on free ports).
policy=/usr/sbin/policy-rc.d
had_policy=0; [[ -e "$policy" ]] && had_policy=1
[[ "$had_policy" == 1 ]] || { printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; }
# A stale package index fails the first try quietly (into the log); after apt-get update a failure is shown.
mkdir -p "$LOG_DIR"
apt-get install -y -qq --no-install-recommends redis-server >>"$LOG_DIR/apt.log" 2>&1 \
    || { quietly apt apt-get update -qq && quietly apt apt-get install -y -qq --no-install-recommends redis-server; }
[[ "$had_policy" == 1 ]] || rm -f "$policy"
command -v redis-server >/dev/null || die "redis-server still missing after apt-get install redis-server"
