#!/usr/bin/env bash
# The main job end to end: build the test guest disk, package it as a containerDisk image,
# inspect and verify it the way KubeVirt will consume it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
work=build/demo
rm -rf "$work" && mkdir -p "$work"

step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }

step diskkit build build/testguest/testguest.qcow2 -t "oci:$work/layout:testguest"
step diskkit inspect "oci:$work/layout:testguest"
step diskkit verify "oci:$work/layout:testguest"
step skopeo inspect --format '{{.Digest}} {{.Os}}/{{.Architecture}} layers={{len .Layers}}' "oci:$work/layout:testguest"
