#!/usr/bin/env bash
# .cache/deployed-venv: the router's interpreter and packages as the image runs them, on the host, for the router
# benchmarks (benchmarks.router_peers --pd-python, benchmarks.pd_flow). The image runs Debian bookworm's CPython 3.11
# (a PGO + LTO build, its interpreter linked statically) with the wheelhouse's packages; a host venv made from another
# build of 3.11 (pyenv's default: no PGO, a shared libpython) runs the same router ~10% slower
# (docs/router-performance.md), so a figure measured there is not the deployed router's.
set -euo pipefail
source "$(dirname "$0")/common.sh"

deployed="$CACHE/deployed-venv"
python=/usr/bin/python3.11  # Debian's own interpreter, the image's (pd-deploy/base:bookworm installs the same package)
[[ -x "$python" ]] && dpkg -s python3.11-minimal >/dev/null 2>&1 \
    || die "no Debian python3.11 on this host: the image runs Debian bookworm's (apt-get install python3.11 on bookworm), \
or measure with .venv/bin/python and say that it is not the deployed interpreter"
[[ -f "$CACHE/wheels/requirements.txt" ]] || die "no wheelhouse in .cache/wheels: run ./pd bootstrap first"
stamp="$deployed/.pd-stamp"
want="$(digest "$CACHE/wheels/requirements.txt")"
if [[ -x "$deployed/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "$deployed/bin/python"
    exit 0
fi
say "creating .cache/deployed-venv from $python and the image's wheelhouse (pip; output in $(step_log deployed-venv))"
rm -rf "$deployed"
quietly deployed-venv "$python" -m venv --without-pip "$deployed"
# Debian's python3.11 has no ensurepip: the project venv's pip installs into it (pip >= 22.3 takes --python).
quietly deployed-venv "$VENV/bin/pip" --python "$deployed/bin/python" install --quiet --no-index \
    --find-links "$CACHE/wheels" -r "$CACHE/wheels/requirements.txt"
echo "$want" >"$stamp"
echo "$deployed/bin/python"
