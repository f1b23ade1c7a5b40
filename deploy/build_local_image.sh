#!/usr/bin/env bash
# Build the CPU image (deploy/Dockerfile) on a machine with no Docker daemon and no registry to
# pull a base image from: Debian's podman with runc, a Debian bookworm base image made here with
# debootstrap (Python 3.11 from Debian), and a local torch 2.13.0 CPU wheel when there is one.
#
#   deploy/build_local_image.sh                 # -> localhost/pagedllm:cpu
#   IMAGE=pagedllm:test TORCH_WHEEL=/path/torch-2.13.0+cpu-cp311-...whl deploy/build_local_image.sh
#
# Run as root from anywhere. Steps (each skipped when already done):
#   1. apt-get install podman runc debootstrap (when missing);
#   2. default_ulimits = [] in /etc/containers/containers.conf (podman's default RLIMIT_NOFILE
#      fails on this host), runc as the runtime (crun fails on its hybrid cgroups);
#   3. the base image localhost/pagedllm-base:bookworm: debootstrap --variant=minbase bookworm,
#      with python3.11 + venv, then `podman import`;
#   4. the torch wheel hard-linked (or copied) into deploy/wheels/ (the build context), found as
#      $TORCH_WHEEL or under /opt/wheels or pip's cache; without one the build fetches torch from
#      PyTorch's CPU index (TORCH_INDEX_URL);
#   5. podman build with PYTHON_IMAGE=the base and TORCH_WHEEL_DIR=deploy/wheels, at nice 15, pip
#      trusting the host's CA bundle ($HOST_CA, mounted for the build's RUN steps only).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
IMAGE="${IMAGE:-localhost/pagedllm:cpu}"
BASE_IMAGE="${BASE_IMAGE:-localhost/pagedllm-base:bookworm}"
ROOTFS="${ROOTFS:-/var/tmp/pagedllm-bookworm-rootfs}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
NICE="${NICE:-15}"
PODMAN=(podman --runtime runc)

log() { echo "[build_local_image] $*" >&2; }

# 1. the tools
missing=()
for tool in podman runc debootstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc debootstrap
fi

# 2. podman's settings on this host
CONF=/etc/containers/containers.conf
if ! grep -qs '^[[:space:]]*default_ulimits[[:space:]]*=' "$CONF"; then
    log "setting default_ulimits = [] in $CONF"
    mkdir -p /etc/containers
    if grep -qs '^\[containers\]' "$CONF"; then
        sed -i '/^\[containers\]/a default_ulimits = []' "$CONF"
    else
        printf '[containers]\ndefault_ulimits = []\n' >> "$CONF"
    fi
fi

# 3. the base image
if ! "${PODMAN[@]}" image exists "$BASE_IMAGE"; then
    if [ ! -x "$ROOTFS/usr/bin/python3.11" ]; then
        log "debootstrap bookworm (minbase + python3.11) into $ROOTFS"
        rm -rf "$ROOTFS"
        nice -n "$NICE" debootstrap --variant=minbase \
            --include=python3.11,python3.11-venv,python3-venv,ca-certificates bookworm "$ROOTFS" \
            http://deb.debian.org/debian
        ln -sf python3 "$ROOTFS/usr/bin/python"
        rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    fi
    log "importing $ROOTFS as $BASE_IMAGE"
    tar -C "$ROOTFS" -c . | "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE"
fi

# 4. the torch wheel, into the build context
WHEELS="$REPO/deploy/wheels"
if ! ls "$WHEELS"/torch-"$TORCH_VERSION"*.whl >/dev/null 2>&1; then
    wheel="${TORCH_WHEEL:-}"
    if [ -z "$wheel" ]; then
        wheel="$(find /opt/wheels "${HOME:-/root}/.cache/pip" -name "torch-${TORCH_VERSION}+cpu-cp311-*.whl" \
                 2>/dev/null | head -n1 || true)"
    fi
    if [ -n "$wheel" ]; then
        log "torch wheel: $wheel"
        ln -f "$wheel" "$WHEELS/" 2>/dev/null || cp "$wheel" "$WHEELS/"
    else
        log "no local torch ${TORCH_VERSION} CPU wheel: the build downloads it from TORCH_INDEX_URL"
    fi
fi

# 5. the image. pip in the build trusts this host's CA bundle (a TLS-inspecting proxy's CA is in
# it where there is one): mounted for the RUN steps only, not left in the image.
HOST_CA="${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}"
CA_ARGS=()
if [ -f "$HOST_CA" ]; then
    CA_ARGS=(--volume "$HOST_CA:/etc/ssl/certs/build-host-ca.crt:ro" --build-arg PIP_CERT=/etc/ssl/certs/build-host-ca.crt)
fi
log "building $IMAGE on $BASE_IMAGE"
cd "$REPO"
nice -n "$NICE" "${PODMAN[@]}" build --network host -f deploy/Dockerfile "${CA_ARGS[@]}" \
    --build-arg PYTHON_IMAGE="$BASE_IMAGE" --build-arg TORCH_WHEEL_DIR=deploy/wheels \
    --build-arg TORCH_VERSION="$TORCH_VERSION" ${TORCH_INDEX_URL:+--build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL"} \
    -t "$IMAGE" .
log "built $IMAGE"
