#!/usr/bin/env bash
# CI job: package a disk image and push it, no container engine needed.
# Credentials come from REGISTRY_AUTH_FILE or ~/.docker/config.json, as for skopeo and podman.
set -euo pipefail
disk=${1:?usage: build-and-push.sh DISK IMAGE}   # e.g. out/fedora.qcow2
image=${2:?usage: build-and-push.sh DISK IMAGE}  # e.g. quay.io/me/fedora:40

export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}

diskkit convert -O qcow2 "$disk" disk.qcow2        # raw/vmdk/vhdx in, qcow2 out (checked first)
diskkit build disk.qcow2 -t "$image" --json \
    --annotation "org.opencontainers.image.source=${CI_PROJECT_URL:-${GITHUB_SERVER_URL:-}/${GITHUB_REPOSITORY:-}}" \
    --annotation "org.opencontainers.image.revision=${GITHUB_SHA:-${CI_COMMIT_SHA:-unknown}}" > build.json
diskkit verify "$image"                             # what KubeVirt will check, against the pushed image
