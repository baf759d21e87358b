#!/usr/bin/env bash
# Builds the Prometheus image ($PROMETHEUS_IMAGE) offline, the way base-image.sh builds the base: a
# minimal Debian bookworm with Debian's `prometheus` package (server + promtool), made by mmdebstrap
# from this machine's apt mirrors and `docker import`ed. Cached: an existing image is kept, so a second
# run takes a second. PROMETHEUS_IMAGE may name any image with prometheus and promtool on its PATH
# (e.g. prom/prometheus on machines with a registry); then nothing is built.
set -euo pipefail
source "$(dirname "$0")/common.sh"

PROMETHEUS_IMAGE="${PROMETHEUS_IMAGE:-pd-deploy/prometheus:2.42}"
if have_image "$PROMETHEUS_IMAGE"; then echo "$PROMETHEUS_IMAGE"; exit 0; fi
if [[ "$PROMETHEUS_IMAGE" != pd-deploy/prometheus:* ]]; then
    quietly docker-pull docker pull "$PROMETHEUS_IMAGE" || die "Prometheus image $PROMETHEUS_IMAGE is not available"
    echo "$PROMETHEUS_IMAGE"; exit 0
fi

say "building $PROMETHEUS_IMAGE from Debian packages (prometheus 2.42 + promtool; about a minute; output in $(step_log prometheus-image))"
debian_sources

tar="$CACHE/prometheus-bookworm.tar"
trap 'rm -f "$tar"' EXIT
# No recommends (node-exporter); busybox gives the healthcheck a `wget`. /prometheus is the TSDB,
# writable by nobody, the user the server runs as.
quietly prometheus-image mmdebstrap --quiet --variant=minbase --include=prometheus,busybox --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='truncate -s 0 "$1/etc/resolv.conf" "$1/etc/hostname"' \
    --customize-hook='mkdir -p "$1/prometheus" && chown 65534:65534 "$1/prometheus"' \
    bookworm "$tar" "${sources[@]}"
docker import -c 'USER nobody' -c 'WORKDIR /prometheus' -c 'EXPOSE 9090' \
    -c 'ENTRYPOINT ["/usr/bin/prometheus"]' \
    -c 'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]' \
    -c 'LABEL org.opencontainers.image.title=pd-deploy-prometheus' \
    "$tar" "$PROMETHEUS_IMAGE" >/dev/null
say "imported $PROMETHEUS_IMAGE"
echo "$PROMETHEUS_IMAGE"
