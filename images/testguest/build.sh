#!/bin/bash
# Build the diskkit test guest: a tiny BIOS-bootable disk (syslinux + Debian cloud
# kernel + busybox initramfs running ./init) that reports every attached disk on
# the serial console and stays up until its power button is pressed, as a real
# guest does; the -poweroff disk powers off as soon as it has reported (the
# kernel command line says diskkit.poweroff), for tests that wait for the end.
#
#   build.sh OUTDIR   ->  OUTDIR/testguest.qcow2  (64 MiB virtual, compressed qcow2)
#                         OUTDIR/testguest-poweroff.qcow2  (the same, powering off when done)
#                         OUTDIR/vmlinuz, OUTDIR/initrd.img  (for direct kernel boot)
#                         OUTDIR/recipe.sha256  (cache key; written last)
#                         OUTDIR/cache/*.deb    (downloaded kernel package)
#
# No mounts, no loop devices, no root-only tricks: the kernel comes from
# `apt-get download` + `dpkg -x`, the FAT file system is filled with mtools and
# `syslinux --install`, the partition table is written with sfdisk into a file.
# Needs: apt-get, dpkg, depmod (kmod), busybox-static, cpio, gzip, dosfstools,
# mtools, syslinux, syslinux-common, fdisk, qemu-utils, dropbear-bin, gcc (scsi-pr.c, freestanding: no
# libc), xz/zstd (only if the kernel's modules are compressed).
#
# Environment: TESTGUEST_KERNEL_FLAVOR (default cloud-amd64; e.g. "amd64" gives a
# kernel with AHCI, at the price of a 70 MB download).
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
INIT_SRC=$HERE/init
SCSI_PR_SRC=$HERE/scsi-pr.c  # the guest's SCSI persistent reservation (init's scsi-pr mode)
FLAVOR=${TESTGUEST_KERNEL_FLAVOR:-cloud-amd64}
DISK_MIB=64            # virtual disk size
PART_START=2048        # FAT partition start (sectors)
TAIL_MIB=1             # unpartitioned space at the end (for STAMP sectors)
BUSYBOX=/bin/busybox   # from busybox-static
MBR_BIN=/usr/lib/syslinux/mbr/mbr.bin
# Modules wanted in the initramfs, in load order (dependencies are added from
# modules.dep; modules built into the kernel or absent from it are skipped).
WANTED_MODULES=(
    virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci
    virtio_blk
    scsi_common scsi_mod sd_mod cdrom sr_mod isofs
    virtio_scsi
    libata libahci ahci ata_piix ata_generic
    fuse virtiofs
    button evdev
    virtio_rng
    failover net_failover virtio_net
    tpm tpm_tis_core tpm_tis tpm_crb
    efivarfs
)
# The ssh server (dropbear-bin), copied with the libraries it links and its loader.
DROPBEAR=/usr/sbin/dropbear
# The kernel's command line (./cmdline, read by the tests' and benches' -kernel boots too).
# cryptomgr.notests: the kernel's self-tests of its crypto algorithms, which nothing here relies on,
# are a tenth of the guest's boot under TCG. mitigations=off: the speculative-execution workarounds
# (retpolines patched in at boot, barriers on every kernel entry) guard a guest from itself, which
# a test guest has no need of, and cost 5 % of its boot's CPU under TCG.
CMDLINE_SRC=$HERE/cmdline
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1700000000}
export LC_ALL=C TZ=UTC MTOOLS_SKIP_CHECK=1

log() { echo "build.sh: $*" >&2; }

mkdir -p "$1/cache"
OUT=$(cd "$1" && pwd)
CACHE=$OUT/cache

for tool in apt-get dpkg depmod cpio gzip mkfs.vfat mcopy syslinux sfdisk qemu-img gcc; do
    command -v "$tool" >/dev/null || { log "missing tool: $tool"; exit 1; }
done
for f in "$BUSYBOX" "$MBR_BIN" "$INIT_SRC" "$DROPBEAR" "$SCSI_PR_SRC" "$CMDLINE_SRC"; do
    [[ -f $f ]] || { log "missing file: $f"; exit 1; }
done

# --- which kernel package -----------------------------------------------------
KPKG=$(apt-cache depends "linux-image-$FLAVOR" 2>/dev/null |
    awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ {print $2; exit}') || true
DEB= DEB_SHA=
if [[ -n $KPKG ]] && uris=$(apt-get download --print-uris "$KPKG" 2>/dev/null) && [[ -n $uris ]]; then
    read -r _uri DEB _size DEB_SHA <<<"$uris"
    DEB_SHA=${DEB_SHA#SHA256:}
else
    # No apt lists (offline)? Fall back to a previously downloaded package.
    DEB=$(cd "$CACHE" && ls -1 linux-image-*-"$FLAVOR"_*.deb 2>/dev/null | sort -V | tail -n1) || true
    [[ -n $DEB ]] || { log "cannot resolve linux-image-$FLAVOR (run apt-get update?)"; exit 1; }
    log "apt metadata unavailable, using cached $DEB"
fi

# --- cache check ----------------------------------------------------------------
RECIPE=$( { cat "$HERE/build.sh" "$INIT_SRC" "$SCSI_PR_SRC" "$CMDLINE_SRC"; printf '%s\n' "$DEB"; } | sha256sum | cut -d' ' -f1)
if [[ -f $OUT/recipe.sha256 && $(cat "$OUT/recipe.sha256") == "$RECIPE" &&
      -f $OUT/testguest.qcow2 && -f $OUT/testguest-poweroff.qcow2 && -f $OUT/vmlinuz && -f $OUT/initrd.img ]]; then
    log "up to date: $OUT"
    exit 0
fi

WORK=$(mktemp -d "$OUT/.work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# --- kernel package -------------------------------------------------------------
if [[ -f $CACHE/$DEB && -n $DEB_SHA ]] &&
   ! echo "$DEB_SHA  $CACHE/$DEB" | sha256sum --quiet -c - >/dev/null 2>&1; then
    log "cached $DEB has a wrong checksum, downloading again"
    rm -f "$CACHE/$DEB"
fi
if [[ ! -f $CACHE/$DEB ]]; then
    log "downloading $KPKG"
    mkdir "$WORK/dl"
    (cd "$WORK/dl" && apt-get download "$KPKG" 2>&1 | grep -v 'Download is performed unsandboxed' >&2) || true
    [[ -f $WORK/dl/$DEB ]] || { log "apt-get download $KPKG did not produce $DEB"; exit 1; }
    if [[ -n $DEB_SHA ]]; then
        echo "$DEB_SHA  $WORK/dl/$DEB" | sha256sum --quiet -c - || { log "checksum mismatch for $DEB"; exit 1; }
    fi
    mv "$WORK/dl/$DEB" "$CACHE/$DEB.tmp"
    mv "$CACHE/$DEB.tmp" "$CACHE/$DEB"
    # keep only the current package of this flavour
    find "$CACHE" -maxdepth 1 -name "linux-image-*-${FLAVOR}_*.deb" ! -name "$DEB" -delete
fi

log "unpacking $DEB"
KX=$WORK/kernel
dpkg -x "$CACHE/$DEB" "$KX"
if [[ -d $KX/lib/modules ]]; then MODROOT=$KX/lib/modules; else MODROOT=$KX/usr/lib/modules; fi
KVER=$(ls -1 "$MODROOT" | head -n1)
VMLINUZ=$(ls -1 "$KX"/boot/vmlinuz-"$KVER" 2>/dev/null || ls -1 "$KX"/boot/vmlinuz-* | head -n1)
MODDIR=$MODROOT/$KVER
[[ -f $MODDIR/modules.dep ]] || depmod -b "${MODROOT%/lib/modules}" "$KVER"

# --- modules: resolve dependencies ------------------------------------------------
norm() { local b=${1##*/}; b=${b%%.ko*}; echo "${b//-/_}"; }
declare -A DEPLINE=() BUILTIN=() ADDED=()
while IFS= read -r line; do
    DEPLINE[$(norm "${line%%:*}")]=$line
done <"$MODDIR/modules.dep"
if [[ -f $MODDIR/modules.builtin ]]; then
    while IFS= read -r line; do BUILTIN[$(norm "$line")]=1; done <"$MODDIR/modules.builtin"
fi
LOAD_ORDER=() MISSING=() BUILTIN_HIT=()
add_module() {
    local m=$1 line deps i
    [[ -n ${ADDED[$m]:-} ]] && return 0
    ADDED[$m]=1
    if [[ -n ${BUILTIN[$m]:-} ]]; then BUILTIN_HIT+=("$m"); return 0; fi
    line=${DEPLINE[$m]:-}
    if [[ -z $line ]]; then MISSING+=("$m"); return 0; fi
    read -r -a deps <<<"${line#*:}"
    # modules.dep lists the full closure, the deepest dependency last
    for ((i = ${#deps[@]} - 1; i >= 0; i--)); do add_module "$(norm "${deps[i]}")"; done
    LOAD_ORDER+=("${line%%:*}")
}
for m in "${WANTED_MODULES[@]}"; do add_module "$m"; done
((${#BUILTIN_HIT[@]})) && log "built into the kernel: ${BUILTIN_HIT[*]}"
# The cloud kernel leaves AHCI out on purpose: expected, and said as what it means rather than as a
# warning. Anything else missing is one.
NO_AHCI=() UNEXPECTED=()
for m in "${MISSING[@]}"; do
    if [[ $FLAVOR == cloud-* && ($m == ahci || $m == libahci) ]]; then NO_AHCI+=("$m"); else UNEXPECTED+=("$m"); fi
done
((${#NO_AHCI[@]})) && log "note: the $FLAVOR kernel has no AHCI (${NO_AHCI[*]}), as expected: this guest sees no SATA disks or CD-ROMs; its test VMs use virtio (TESTGUEST_KERNEL_FLAVOR=amd64 has AHCI)"
((${#UNEXPECTED[@]})) && log "WARNING: not available in $KPKG: ${UNEXPECTED[*]}"

# --- initramfs ----------------------------------------------------------------------
ROOT=$WORK/initramfs
mkdir -p "$ROOT"/{bin,dev,proc,sys,mnt,tmp,lib/modules}
cp "$BUSYBOX" "$ROOT/bin/busybox"
install -m 0755 "$INIT_SRC" "$ROOT/init"
cp "$DROPBEAR" "$ROOT/bin/dropbear"
gcc -static -nostdlib -ffreestanding -fno-stack-protector -fno-pie -no-pie -Os -s -o "$ROOT/bin/scsi-pr" "$SCSI_PR_SRC"
for lib in $(ldd "$DROPBEAR" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'); do
    mkdir -p "$ROOT$(dirname "$lib")"
    cp -L "$lib" "$ROOT$lib"
done
: >"$ROOT/lib/modules/load.list"
for rel in "${LOAD_ORDER[@]}"; do
    src=$MODDIR/$rel name=$(norm "$rel").ko
    case $rel in
        *.ko.xz) xz -dc "$src" >"$ROOT/lib/modules/$name" ;;
        *.ko.zst) zstd -qdc "$src" >"$ROOT/lib/modules/$name" ;;
        *.ko.gz) gzip -dc "$src" >"$ROOT/lib/modules/$name" ;;
        *) cp "$src" "$ROOT/lib/modules/$name" ;;
    esac
    echo "$name" >>"$ROOT/lib/modules/load.list"
done
log "modules: $(tr '\n' ' ' <"$ROOT/lib/modules/load.list")"
find "$ROOT" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
(cd "$ROOT" && find . -mindepth 1 -print0 | sort -z |
    cpio --null --quiet --reproducible -o -H newc -R 0:0) | gzip -n -9 >"$WORK/initrd.img"
cp "$VMLINUZ" "$WORK/vmlinuz"

# --- one disk per kernel command line: MBR + one bootable FAT partition (syslinux, kernel, initrd),
# the last MiB unpartitioned, as NAME.qcow2 ----------------------------------------------------------
DISK_SECTORS=$((DISK_MIB * 2048))
PART_SECTORS=$((DISK_SECTORS - TAIL_MIB * 2048 - PART_START))
make_disk() {
    local name=$1 append=$2 fat=$WORK/fat.img raw=$WORK/disk.raw
    printf 'DEFAULT linux\nPROMPT 0\nTIMEOUT 0\nLABEL linux\n  KERNEL /vmlinuz\n  INITRD /initrd.img\n  APPEND %s\n' "$append" >"$WORK/syslinux.cfg"
    touch -d "@$SOURCE_DATE_EPOCH" "$WORK/syslinux.cfg" "$WORK/vmlinuz" "$WORK/initrd.img"
    rm -f "$fat" "$raw"
    mkfs.vfat -C --invariant -i 4449534b -n TESTGUEST -h "$PART_START" "$fat" $((PART_SECTORS / 2)) >/dev/null
    syslinux --install "$fat"
    mcopy -m -i "$fat" "$WORK/syslinux.cfg" "$WORK/vmlinuz" "$WORK/initrd.img" ::/
    truncate -s "${DISK_MIB}M" "$raw"
    printf 'label: dos\nlabel-id: 0x4449534b\nunit: sectors\nstart=%s, size=%s, type=c, bootable\n' "$PART_START" "$PART_SECTORS" |
        sfdisk --quiet "$raw"
    dd if="$MBR_BIN" of="$raw" bs=440 count=1 conv=notrunc status=none
    dd if="$fat" of="$raw" bs=512 seek="$PART_START" conv=notrunc,sparse status=none
    qemu-img convert -q -c -f raw -O qcow2 "$raw" "$WORK/$name.qcow2"
}
CMDLINE=$(cat "$CMDLINE_SRC")
make_disk testguest "$CMDLINE"
make_disk testguest-poweroff "$CMDLINE diskkit.poweroff"

# --- publish: outputs first, cache key last ------------------------------------------
rm -f "$OUT/recipe.sha256"
for f in testguest.qcow2 testguest-poweroff.qcow2 vmlinuz initrd.img; do
    mv -f "$WORK/$f" "$OUT/$f"
done
echo "$RECIPE" >"$WORK/recipe.sha256"
mv -f "$WORK/recipe.sha256" "$OUT/recipe.sha256"
log "built $OUT/testguest.qcow2 ($(du -k "$OUT/testguest.qcow2" | cut -f1) KiB) from $DEB"
