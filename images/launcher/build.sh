#!/usr/bin/env bash
# Build the launcher image with no registry to pull a base from, and write it as an image archive (docker-archive: podman load and docker load both take it).
#   bash images/launcher/build.sh OUT.tar          then: podman load -i OUT.tar
# The base root filesystem comes from Debian packages alone (mmdebstrap, the host's apt sources);
# podman/buildah run with private storage and settings under a temporary directory, so nothing of
# the host's container storage is touched and nothing is left behind.
# Needs root (mmdebstrap's root mode, rootful buildah), mmdebstrap, podman and buildah.
# EXTRA_PACKAGES (environment) replaces the Containerfile's optional packages; "" drops them.
set -euo pipefail

out=${1:?usage: build.sh OUT.tar}
root=$(cd "$(dirname "$0")/../.." && pwd)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml" | head -n1)
tag=localhost/diskkit-launcher:$version

work=$(mktemp -d "${TMPDIR:-/var/tmp}/launcher-image.XXXXXX")
tmp_out="$out.tmp.$$"
cleanup() {
    # vfs layers and the build's mounts belong to this private store only; a half-written
    # archive never takes OUT's name.
    if [ "${CONTAINERS_STORAGE_CONF:-}" = "$work/storage.conf" ]; then
        buildah rm --all >/dev/null 2>&1 || true
    fi
    rm -rf "$work" "$tmp_out"
}
trap cleanup EXIT

# runc cannot raise rlimits on these machines ("error setting rlimit type 7"): pin them at what
# the host allows. vfs works on any filesystem, including one already on overlayfs.
cat >"$work/storage.conf" <<EOF
[storage]
driver = "vfs"
graphroot = "$work/storage"
runroot = "$work/run"
EOF
cat >"$work/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
EOF
export CONTAINERS_STORAGE_CONF=$work/storage.conf CONTAINERS_CONF=$work/containers.conf
export BUILDAH_ISOLATION=chroot

# The Debian archive the host itself is configured for (deb822 or one-line sources).
sources=/etc/apt/sources.list.d/debian.sources
[ -f "$sources" ] || sources=/etc/apt/sources.list
echo "build.sh: base root filesystem from $sources" >&2
# Without documentation, manuals and translations (a third of minbase); the excludes stay in
# the image's dpkg configuration, so packages installed later are trimmed the same way.
mmdebstrap --quiet --variant=minbase \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    bookworm "$work/base.tar" "$sources"
base=localhost/diskkit-launcher-base:bookworm
podman import --quiet "$work/base.tar" "$base" >/dev/null
rm -f "$work/base.tar"

# pip inside the build trusts what the host's pip trusts: where the package index is reached
# through a proxy with its own CA, the host's bundle is the only one that verifies it.
ca=$(python3 -c 'import ssl; print(ssl.get_default_verify_paths().cafile or "")' 2>/dev/null || true)
ca=${PIP_CERT:-${ca:-/etc/ssl/certs/ca-certificates.crt}}
mkdir "$work/pip"
cp "$ca" "$work/pip/ca.crt"
printf '[global]\ncert = /run/diskkit-build/ca.crt\ndisable-pip-version-check = true\n' >"$work/pip/pip.conf"

buildah build --quiet --pull=never --network=host --layers=false \
    --volume "$work/pip:/run/diskkit-build:ro" \
    --build-arg BASE="$base" \
    --build-arg VERSION="$version" \
    --build-arg PIP_CONFIG_FILE=/run/diskkit-build/pip.conf \
    ${EXTRA_PACKAGES+--build-arg "EXTRA_PACKAGES=$EXTRA_PACKAGES"} \
    -f "$root/images/launcher/Containerfile" -t "$tag" "$root" >/dev/null

# An SBOM as labels: every Debian package and every Python distribution with its version, read
# from the finished image itself so the list is what ships.
ctr=$(buildah from --pull-never "$tag")
debs=$(buildah run "$ctr" -- dpkg-query -W -f '${Package}=${Version} ' | sed 's/ $//')
pys=$(buildah run "$ctr" -- /opt/diskkit/bin/python -c \
    'import importlib.metadata as m; print(" ".join(sorted(d.metadata["Name"] + "==" + d.version for d in m.distributions())))')
buildah config --label "io.diskkit.sbom.debian=$debs" --label "io.diskkit.sbom.python=$pys" \
    --label "io.diskkit.version=$version" "$ctr"
buildah commit --quiet --rm "$ctr" "$tag" >/dev/null

podman save --quiet --format docker-archive -o "$tmp_out" "$tag"
sync "$tmp_out"
mv -f "$tmp_out" "$out"

size=$(podman image inspect --format '{{.Size}}' "$tag")
echo "build.sh: $tag -> $out; image size $((size / 1024 / 1024)) MiB ($size bytes), archive $(($(stat -c %s "$out") / 1024 / 1024)) MiB"
