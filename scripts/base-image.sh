#!/usr/bin/env bash
# Resolves the base image for the app image and prints its name on stdout.
# BASE_IMAGE if given; else python:3.11-slim when present or pullable; else a minimal Debian bookworm
# with python3 + python3-venv made here from Debian packages (mmdebstrap) and `docker import`ed.
set -euo pipefail
source "$(dirname "$0")/common.sh"

if [[ -n "${BASE_IMAGE:-}" ]]; then
    have_image "$BASE_IMAGE" || quietly docker-pull docker pull "$BASE_IMAGE" || die "base image $BASE_IMAGE is not available"
    echo "$BASE_IMAGE"; exit 0
fi
# Local images first, so a machine without a registry does not wait on a pull at every run.
if have_image "$DEFAULT_BASE"; then echo "$DEFAULT_BASE"; exit 0; fi
if have_image "$LOCAL_BASE"; then echo "$LOCAL_BASE"; exit 0; fi
# A registry answers or refuses quickly; the timeout only guards against a hanging network.
if timeout 120 docker pull --quiet "$DEFAULT_BASE" >/dev/null 2>&1; then echo "$DEFAULT_BASE"; exit 0; fi

say "no registry for $DEFAULT_BASE: building $LOCAL_BASE from Debian packages"
debian_sources

tar="$CACHE/base-bookworm.tar"
say "mmdebstrap bookworm from $mirror${security:+ with security updates from $security} (about 30 s; output in $(step_log base-image))"
quietly base-image mmdebstrap --quiet --variant=minbase --include=python3,python3-venv \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='truncate -s 0 "$1/etc/resolv.conf" "$1/etc/hostname"' \
    bookworm "$tar" "${sources[@]}"
docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' "$tar" "$LOCAL_BASE" >/dev/null
rm -f "$tar"
say "imported $LOCAL_BASE"
echo "$LOCAL_BASE"
