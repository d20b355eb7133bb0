#!/usr/bin/env bash
# Install everything diskkit and its test suite need on a fresh Debian 12 machine:
# the real peers (qemu, skopeo, umoci, ...), a .venv with the project, and the test guest disk.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
    python3-venv python3-dev gcc
    qemu-utils qemu-system-x86 qemu-block-extra
    skopeo umoci buildah docker-registry
    xorriso genisoimage mtools syslinux syslinux-common fdisk dosfstools busybox-static cpio kmod e2fsprogs
    util-linux zstd libnbd-bin
    libvirt-daemon-system libvirt-clients libvirt-dev pkg-config libxml2-utils ovmf tgt
    docker.io podman catatonit mmdebstrap
    golang-go golang-golang-x-crypto-dev openssl
    dropbear-bin openssh-client
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
# The test guest's kernel comes from the archive, so the package lists must be current either way.
$SUDO apt-get update -qq
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}" >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The launcher runs VMs as KubeVirt's qemu user (UID 107) through libvirt's session daemon;
# the end-to-end tests need that user to exist.
if ! getent passwd 107 >/dev/null; then
    $SUDO useradd --system --uid 107 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin qemu
fi

# Debian's own python, so unprivileged users (the qemu user of the tests) can run the venv too.
PYTHON=${PYTHON:-/usr/bin/python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'

bash images/testguest/build.sh build/testguest >&2
echo "setup: ready (.venv, build/testguest)" >&2
