#!/usr/bin/env bash
# Build the launcher image with no registry to pull a base from, and write it as an image archive (docker-archive: podman load and docker load both take it).
#   bash images/launcher/build.sh OUT.tar          then: podman load -i OUT.tar
# The base root filesystem comes from Debian packages alone (mmdebstrap, the host's apt sources);
# podman/buildah run with private storage and settings under a temporary directory, so nothing of
# the host's container storage is touched and nothing is left behind.
# Needs root (mmdebstrap's root mode, rootful buildah), mmdebstrap, podman and buildah.
# EXTRA_PACKAGES (environment) replaces the Containerfile's optional packages; "" drops them.
# DEPS_CACHE=DIR (environment) keeps the Containerfile's deps stage (Debian packages and Python
# dependencies, nearly all of the build's time) in DIR as launcher-deps-HASH.tar, HASH covering
# the Containerfile, this script, pyproject.toml, EXTRA_PACKAGES and the apt sources: a later build
# with the same ones rebuilds only the source layer. The archive of any other HASH in DIR goes.
set -euo pipefail

out=${1:?usage: build.sh OUT.tar}
root=$(cd "$(dirname "$0")/../.." && pwd)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml" | head -n1)
tag=localhost/diskkit-launcher:$version

work=$(mktemp -d "${TMPDIR:-/var/tmp}/launcher-image.XXXXXX")
tmp_out="$out.tmp.$$"
cleanup() {
    # Layers, containers and mounts belong to this private store only; a half-written archive
    # never takes OUT's name.
    if [ "${CONTAINERS_STORAGE_CONF:-}" = "$work/storage.conf" ]; then
        buildah rm --all >/dev/null 2>&1 || true
    fi
    # overlay's mounts (and the store's own bind mount of its directory) go before the files.
    findmnt -rn -o TARGET | grep -F "$work/" | sort -r | while read -r mnt; do umount "$mnt" || umount -l "$mnt"; done || true
    rm -rf --one-file-system "$work" "$tmp_out" "${cached:-$work}.tmp.$$"  # and a deps archive half-saved
}
trap cleanup EXIT

# overlay where the kernel can mount one here: a container or a commit then costs what it changes,
# where vfs copies the whole tree (400 MiB) for each. vfs works on any filesystem, including one
# already on overlayfs.
driver=vfs
mkdir "$work/probe" "$work/probe/lower" "$work/probe/upper" "$work/probe/work" "$work/probe/merged"
if mount -t overlay overlay -o "lowerdir=$work/probe/lower,upperdir=$work/probe/upper,workdir=$work/probe/work" \
        "$work/probe/merged" 2>/dev/null; then
    umount "$work/probe/merged"
    driver=overlay
fi
rm -rf "$work/probe"
echo "build.sh: $driver storage under $work" >&2
# runc cannot raise rlimits on these machines ("error setting rlimit type 7"): pin them at what
# the host allows.
cat >"$work/storage.conf" <<EOF
[storage]
driver = "$driver"
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
containerfile=$root/images/launcher/Containerfile
key=$({ cat "$containerfile" "$0" "$root/pyproject.toml" "$sources"; printf '%s' "${EXTRA_PACKAGES-default}"; } | sha256sum | cut -c1-20)
deps=localhost/diskkit-launcher-deps:$key
cached=${DEPS_CACHE:+$DEPS_CACHE/launcher-deps-$key.tar}

# pip inside the build trusts what the host's pip trusts: where the package index is reached
# through a proxy with its own CA, the host's bundle is the only one that verifies it.
ca=$(python3 -c 'import ssl; print(ssl.get_default_verify_paths().cafile or "")' 2>/dev/null || true)
ca=${PIP_CERT:-${ca:-/etc/ssl/certs/ca-certificates.crt}}
mkdir "$work/pip"
cp "$ca" "$work/pip/ca.crt"
printf '[global]\ncert = /run/diskkit-build/ca.crt\ndisable-pip-version-check = true\n' >"$work/pip/pip.conf"
# The Python packages as wheels fetched by the host's pip (with its cache, indexes and mirrors) for
# the image's Python (CPython 3.11, glibc 2.36, x86_64), so pip in the build installs them with no
# index: the dependencies for the deps stage, setuptools to build diskkit's wheel in the last. Where
# the host's pip cannot get them all, pip in the build asks the package index itself.
wheelhouse() {  # REQUIREMENT...
    local platforms=() minor
    for minor in $(seq 36 -1 5); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
    platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
    if python3 -m pip download --quiet --only-binary=:all: --python-version 3.11 --implementation cp \
            --abi cp311 --abi abi3 --abi none "${platforms[@]}" -d "$work/pip/wheels" "$@" >&2; then
        printf 'find-links = /run/diskkit-build/wheels\nno-index = true\n' >>"$work/pip/pip.conf"
    else
        echo "build.sh: the host's pip has not all of them; pip in the build uses the package index" >&2
    fi
}
build() {
    buildah build --quiet --pull=never --network=host --layers=false \
        --volume "$work/pip:/run/diskkit-build:ro" \
        --build-arg PIP_CONFIG_FILE=/run/diskkit-build/pip.conf "$@" "$root" >/dev/null
}

if [ -n "$cached" ] && [ -f "$cached" ]; then
    echo "build.sh: deps stage from $cached" >&2
    podman load --quiet -i "$cached" >/dev/null
    wheelhouse setuptools wheel
else
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

    # shellcheck disable=SC2046  # one requirement a line, none with blanks
    wheelhouse setuptools wheel $(python3 -c 'import sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(" ".join(p["dependencies"]))' "$root/pyproject.toml")
    build --target deps --build-arg BASE="$base" \
        ${EXTRA_PACKAGES+--build-arg "EXTRA_PACKAGES=$EXTRA_PACKAGES"} \
        -f "$containerfile" -t "$deps"
    if [ -n "$cached" ]; then
        podman save --quiet --format docker-archive -o "$cached.tmp.$$" "$deps"
        mv -f "$cached.tmp.$$" "$cached"
        for old in "$DEPS_CACHE"/launcher-deps-*.tar; do
            [ "$old" = "$cached" ] || rm -f "$old"
        done
    fi
fi

# The final stage alone, on the deps image: the Containerfile's text from its `FROM deps` on.
sed -n '/^FROM deps$/,$p' "$containerfile" | sed 's|^FROM deps$|FROM '"$deps"'|' >"$work/Containerfile.final"
grep -qx "FROM $deps" "$work/Containerfile.final" || { echo "build.sh: no 'FROM deps' line in $containerfile" >&2; exit 1; }

# An SBOM as labels: every Debian package and every Python distribution with its version. The
# source layer adds diskkit alone, so the labels are the deps image's list plus diskkit, given to
# the build (a label set afterwards would copy the whole image once more); the finished image is
# then read and must hold exactly what they list.
sbom() {  # IMAGE: reads its files in place, as root (chroot) without a container and writing nothing
    local mnt
    mnt=$(podman image mount "$1")
    debs=$(chroot "$mnt" dpkg-query -W -f '${Package}=${Version} ' | sed 's/ $//')
    pys=$(chroot "$mnt" /opt/diskkit/bin/python -I -B -c \
        'import importlib.metadata as m; print(" ".join(sorted(d.metadata["Name"] + "==" + d.version for d in m.distributions())))')
    podman image unmount "$1" >/dev/null
}
sbom "$deps"
pys=$(printf '%s\n' $pys "diskkit==$version" | LC_ALL=C sort | tr '\n' ' ' | sed 's/ $//')
want_debs=$debs want_pys=$pys
build --build-arg VERSION="$version" \
    --label "io.diskkit.sbom.debian=$debs" --label "io.diskkit.sbom.python=$pys" --label "io.diskkit.version=$version" \
    -f "$work/Containerfile.final" -t "$tag"
sbom "$tag"
if [ "$debs" != "$want_debs" ] || [ "$pys" != "$want_pys" ]; then
    echo "build.sh: $tag holds other packages than its SBOM labels list:" >&2
    diff <(tr ' ' '\n' <<<"$want_debs $want_pys") <(tr ' ' '\n' <<<"$debs $pys") >&2 || true
    exit 1
fi

podman save --quiet --format docker-archive -o "$tmp_out" "$tag"
sync "$tmp_out"
mv -f "$tmp_out" "$out"

size=$(podman image inspect --format '{{.Size}}' "$tag")
echo "build.sh: $tag -> $out; image size $((size / 1024 / 1024)) MiB ($size bytes), archive $(($(stat -c %s "$out") / 1024 / 1024)) MiB"
