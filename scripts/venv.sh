#!/usr/bin/env bash
# Host virtualenv with the project (editable) and its dev extra: pytest, testcontainers, SDKs, compose v2.
set -euo pipefail
source "$(dirname "$0")/common.sh"

PYTHON="${PYTHON:-python3}"
stamp="$VENV/.pd-stamp"
want="$(digest "$REPO/pyproject.toml")"

if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$PYTHON is $("$PYTHON" --version 2>&1); pd-deploy needs Python >= 3.11 (set PYTHON=...)"
if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating $VENV"
    quietly venv "$PYTHON" -m venv "$VENV"
fi
say "installing the project and its dev extra into .venv (pip; output in $(step_log venv))"
quietly venv "$VENV/bin/pip" install --quiet -e "$REPO[dev]"
echo "$want" >"$stamp"
