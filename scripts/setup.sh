#!/usr/bin/env bash
# Install what diskkit needs on a fresh Debian 12 machine, a .venv with the project, and the test guest disk.
#   setup.sh          the test suite's set: every real peer the tests drive (qemu, skopeo, umoci, podman, ...)
#   setup.sh demo     what scripts/demo.sh needs: qemu, libvirt's daemon (no system service), a registry, skopeo
set -euo pipefail
cd "$(dirname "$0")/.."
SET=${1:-test}
case $SET in demo|test) ;; *) echo "usage: $0 [demo|test]" >&2; exit 2 ;; esac

APT_PACKAGES=(
    python3-venv python3-dev gcc
    qemu-utils qemu-system-x86 qemu-block-extra
    skopeo umoci buildah docker-registry
    xorriso genisoimage mtools syslinux syslinux-common fdisk dosfstools busybox-static cpio kmod e2fsprogs
    util-linux zstd libnbd-bin
    libvirt-daemon-system libvirt-clients libvirt-dev pkg-config libxml2-utils ovmf swtpm swtpm-tools tgt
    docker.io podman catatonit mmdebstrap
    golang-go golang-golang-x-crypto-dev openssl
    gnupg
    dropbear-bin openssh-client passt slirp4netns python3-yaml
    curl casync
)
# The demo's set: build and boot the test guest, a registry to push it to, skopeo to read it back.
# libvirt-daemon, not -system: a root launcher starts the qemu user's session daemon itself, and
# the demo has no use for a system service (nor docker.io, golang, tgt, mmdebstrap, ovmf...).
DEMO_PACKAGES=(
    python3-venv python3-dev gcc pkg-config libvirt-dev
    qemu-utils qemu-system-x86 libvirt-daemon
    skopeo docker-registry
    busybox-static cpio kmod fdisk dosfstools mtools syslinux syslinux-common zstd dropbear-bin passt
)
if [ "$SET" = demo ]; then
    WANTED=("${DEMO_PACKAGES[@]}")
    EXTRA=launcher
else
    WANTED=("${APT_PACKAGES[@]}")
    EXTRA=test
fi
# Wait for another apt or dpkg (unattended-upgrades, a desktop updater) rather than fail at once.
APT=(apt-get -o DPkg::Lock::Timeout=600)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for pkg in "${WANTED[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
# The test guest's kernel comes from the archive, so the package lists must be current either way.
$SUDO "${APT[@]}" update -qq
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}" >&2
    $SUDO env DEBIAN_FRONTEND=noninteractive "${APT[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
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
# pip only when the project's requirements changed since this set was last installed: a reinstall of
# the editable package takes it away for a moment from whatever runs from this .venv meanwhile (the
# test suite runs the demo).
stamp=.venv/.setup-$EXTRA
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/pip install -q --disable-pip-version-check -e ".[$EXTRA]"
    echo "$want" >"$stamp"
fi

bash images/testguest/build.sh build/testguest >&2
echo "setup: ready (.venv, build/testguest)" >&2
