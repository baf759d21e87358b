#!/usr/bin/env bash
# Builds the app image ($PD_IMAGE) on the resolved base. Docker's layer cache makes a rebuild with
# unchanged sources take seconds; only the COPY of stack/ and doctor/ reruns when code changes.
set -euo pipefail
source "$(dirname "$0")/common.sh"

base="$("$REPO/scripts/base-image.sh")"
"$REPO/scripts/wheelhouse.sh"
say "building $PD_IMAGE on $base"
# Without buildx the classic builder runs and prints a deprecation banner: show its output only on failure.
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
previous="$(docker image inspect --format '{{.Id}}' "$PD_IMAGE" 2>/dev/null || true)"
docker build --quiet --build-arg "BASE_IMAGE=$base" --tag "$PD_IMAGE" "$REPO" >"$log" 2>&1 \
    || { cat "$log" >&2; die "docker build of $PD_IMAGE failed"; }
# Drop the image this build replaced (it stays while a container still uses it), and our older untagged
# leftovers. Only those older than 30 min: younger untagged images may be the intermediate layers of a
# build running in parallel, which a prune would break ("unknown parent image ID").
current="$(docker image inspect --format '{{.Id}}' "$PD_IMAGE")"
if [[ -n "$previous" && "$previous" != "$current" ]]; then
    docker image rm --no-prune "$previous" >/dev/null 2>&1 || true
fi
docker image prune --force --filter label=org.opencontainers.image.title=pd-deploy --filter until=30m >/dev/null
