#!/usr/bin/env bash
# Wheels for the image's runtime dependencies (pyproject [project].dependencies), downloaded on the host:
# containers here cannot reach the package index over HTTPS, so the image installs from this folder.
set -euo pipefail
source "$(dirname "$0")/common.sh"

wheels="$CACHE/wheels"
mkdir -p "$wheels"
reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
"$VENV/bin/python" - "$REPO/pyproject.toml" >"$reqs" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
PY
# pip download evaluates python_full_version markers for this host's Python, not the image's: Debian bookworm's
# python3 is 3.11.2, where redis needs async-timeout (`python_full_version < "3.11.3"`). Listed here so the
# wheelhouse holds it whatever the host runs (harmless on python:3.11-slim, which is newer).
echo 'async-timeout>=4.0.3' >>"$reqs"
if [[ -f "$wheels/requirements.txt" ]] && cmp -s "$reqs" "$wheels/requirements.txt"; then
    exit 0
fi
say "downloading the runtime wheelhouse into .cache/wheels (pip; output in $(step_log wheelhouse))"
rm -f "$wheels"/*.whl
# cp311 wheels: both python:3.11-slim and Debian bookworm's python3 are 3.11.
quietly wheelhouse "$VENV/bin/pip" download --quiet --only-binary=:all: --python-version 3.11 \
    --dest "$wheels" -r "$reqs"
cp "$reqs" "$wheels/requirements.txt"
