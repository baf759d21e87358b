#!/usr/bin/env bash
# Resolves the base image for the app image and prints its name on stdout.
# BASE_IMAGE if given; else python:3.11-slim when present or pullable; else a minimal Debian bookworm
# with python3 + python3-venv made here from Debian packages (mmdebstrap) and `docker import`ed.
set -euo pipefail
source "$(dirname "$0")/common.sh"

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

if [[ -n "${BASE_IMAGE:-}" ]]; then
    have_image "$BASE_IMAGE" || docker pull "$BASE_IMAGE" >&2 || die "base image $BASE_IMAGE is not available"
    echo "$BASE_IMAGE"; exit 0
fi
# Local images first, so a machine without a registry does not wait on a pull at every run.
if have_image "$DEFAULT_BASE"; then echo "$DEFAULT_BASE"; exit 0; fi
if have_image "$LOCAL_BASE"; then echo "$LOCAL_BASE"; exit 0; fi
# A registry answers or refuses quickly; the timeout only guards against a hanging network.
if timeout 120 docker pull --quiet "$DEFAULT_BASE" >/dev/null 2>&1; then echo "$DEFAULT_BASE"; exit 0; fi

say "no registry for $DEFAULT_BASE: building $LOCAL_BASE from Debian packages"
if ! command -v mmdebstrap >/dev/null; then
    [[ "$(id -u)" == 0 ]] || die "mmdebstrap is missing; install it (apt-get install mmdebstrap) and rerun"
    say "installing mmdebstrap"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >&2
fi

# The mirrors come from this machine's apt configuration (one-line or deb822 style), never a fixed host:
# the main archive (bookworm and bookworm-updates) and, where configured, the security archive.
mirrors="$( { grep -hsE '^(deb |URIs:)' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
               /etc/apt/sources.list.d/*.sources || true; } | grep -oE '(https?|file)://[^ ]+')"
mirror="$(grep -v -- '-security' <<<"$mirrors" | head -n1 || true)"
security="$(grep -- '-security' <<<"$mirrors" | head -n1 || true)"
[[ -n "$mirror" ]] || die "no Debian mirror found in /etc/apt/sources.list{,.d}"
sources=("deb $mirror bookworm main" "deb $mirror bookworm-updates main")
[[ -n "$security" ]] && sources+=("deb $security bookworm-security main")

tar="$CACHE/base-bookworm.tar"
say "mmdebstrap bookworm from $mirror${security:+ with security updates from $security} (about 30 s)"
mmdebstrap --quiet --variant=minbase --include=python3,python3-venv \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='truncate -s 0 "$1/etc/resolv.conf" "$1/etc/hostname"' \
    bookworm "$tar" "${sources[@]}" >&2
docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' "$tar" "$LOCAL_BASE" >/dev/null
rm -f "$tar"
say "imported $LOCAL_BASE"
echo "$LOCAL_BASE"
