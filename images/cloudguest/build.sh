#!/bin/bash
# Build the real cloud test guest: Debian 12 (bookworm) as a cloud provider ships it, lean: systemd,
# cloud-init (NoCloud and ConfigDrive, default user `debian` as in Debian's cloud images),
# openssh-server, qemu-guest-agent and sudo on Debian's cloud kernel, BIOS-bootable, serial console.
#
#   build.sh OUTDIR   ->  OUTDIR/cloudguest.qcow2  (2 GiB virtual, compressed qcow2)
#                         OUTDIR/default-user     (cloud-init's default user, read from the image's cloud.cfg)
#                         OUTDIR/recipe.sha256    (cache key: this file's sha256; written last)
#
# Nothing comes from anywhere but the Debian archive this machine's apt is configured with (its
# sources files naming bookworm, or CLOUDGUEST_MIRROR, e.g. http://deb.debian.org/debian).
# No mounts on the host, no loop devices: mmdebstrap works in a mount namespace of its own (root
# is needed for the tree's owners), the root file system is written from the tree by `mke2fs -d`,
# the FAT boot partition by mtools and `syslinux --install`, the partition table by sfdisk into a file.
# Needs: mmdebstrap, e2fsprogs, dosfstools, mtools, syslinux, syslinux-common, fdisk, qemu-utils.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SUITE=bookworm
DISK_MIB=2048
BOOT_START=2048        # sectors
BOOT_MIB=64            # FAT: syslinux, kernel, initrd
MBR_BIN=/usr/lib/syslinux/mbr/mbr.bin
PACKAGES=(
    linux-image-cloud-amd64 initramfs-tools systemd systemd-sysv udev dbus iproute2
    cloud-init openssh-server qemu-guest-agent sudo
)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1700000000}
export LC_ALL=C TZ=UTC MTOOLS_SKIP_CHECK=1

log() { echo "build.sh: $*" >&2; }

mkdir -p "$1"
OUT=$(cd "$1" && pwd)
RECIPE=$(sha256sum "$HERE/build.sh" | cut -d' ' -f1)
if [[ -f $OUT/recipe.sha256 && $(cat "$OUT/recipe.sha256") == "$RECIPE" && -f $OUT/cloudguest.qcow2 && -f $OUT/default-user ]]; then
    log "up to date: $OUT"
    exit 0
fi
for tool in mmdebstrap mke2fs mkfs.vfat mcopy syslinux sfdisk qemu-img; do
    command -v "$tool" >/dev/null || { log "missing tool: $tool"; exit 1; }
done
[[ -f $MBR_BIN ]] || { log "missing file: $MBR_BIN (syslinux-common)"; exit 1; }
if [[ $(id -u) -ne 0 ]]; then
    log "must run as root (the root file system's files are root's): sudo $0 $1"
    exit 1
fi

# --- where the packages come from: this machine's Debian archive --------------------------------
MIRRORS=()
if [[ -n ${CLOUDGUEST_MIRROR:-} ]]; then
    MIRRORS=("$CLOUDGUEST_MIRROR")
else
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] && grep -Eq "^[^#]*\b$SUITE(-updates|-security)?\b" "$f" && MIRRORS+=("$f")
    done
    ((${#MIRRORS[@]})) || { log "no apt sources for $SUITE on this machine: set CLOUDGUEST_MIRROR"; exit 1; }
fi

WORK=$(mktemp -d "$OUT/.work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ROOT_UUID=$(cat /proc/sys/kernel/random/uuid)
CMDLINE="root=UUID=$ROOT_UUID ro console=ttyS0,115200 quiet"

# Written into the tree before the packages are installed, so the kernel's first initramfs is the
# lean one and every package sees the final fstab.
cat >"$WORK/essential.sh" <<EOF
#!/bin/sh
set -e
root=\$1
mkdir -p "\$root/etc/initramfs-tools/conf.d" "\$root/etc/initramfs-tools/hooks"
# Only what finds the root disk (virtio; ext4 is built in), not most of the kernel's modules.
printf 'MODULES=list\nCOMPRESS=gzip\nRESUME=none\n' >"\$root/etc/initramfs-tools/conf.d/cloudguest.conf"
cat >"\$root/etc/initramfs-tools/hooks/cloudguest" <<'HOOK'
#!/bin/sh
[ "\$1" = prereqs ] && exit 0
. /usr/share/initramfs-tools/hook-functions
force_load virtio_pci
force_load virtio_blk
force_load virtio_scsi
force_load sd_mod
HOOK
chmod 0755 "\$root/etc/initramfs-tools/hooks/cloudguest"
echo "UUID=$ROOT_UUID / ext4 rw,errors=remount-ro 0 1" >"\$root/etc/fstab"
EOF

# The guest's own configuration, once everything is installed.
cat >"$WORK/customize.sh" <<'EOF'
#!/bin/sh
set -e
root=$1
echo debian >"$root/etc/hostname"
printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
: >"$root/etc/resolv.conf"
# Each VM makes its own host keys at first boot (cloud-init's ssh module), and its own machine id.
rm -f "$root"/etc/ssh/ssh_host_*
: >"$root/etc/machine-id"
# A guest on KubeVirt's pod network is told its address by DHCP; cloud-init writes the networkd
# configuration of the NIC it finds (its networkd renderer).
mkdir -p "$root/etc/cloud/cloud.cfg.d"
cat >"$root/etc/cloud/cloud.cfg.d/90_cloudguest.cfg" <<'CFG'
# KubeVirt's cloud-init volumes, nothing else: no probing of metadata services.
datasource_list: [NoCloud, ConfigDrive, None]
# The instance's host name resolves (sudo asks), as in Debian's cloud images.
manage_etc_hosts: true
system_info:
  network:
    renderers: [networkd]
# Host keys made at first boot: the two types OpenSSH prefers (RSA's takes seconds under emulation).
ssh_genkeytypes: [ed25519, ecdsa]
# Debian's module lists without what this image has no use for and no package for (snaps, locales,
# grub, apt mirrors, configuration managers); each module costs its import at every boot.
cloud_config_modules: [set-passwords, timezone, runcmd]
cloud_final_modules: [write-files-deferred, scripts-vendor, scripts-per-once, scripts-per-boot,
  scripts-per-instance, scripts-user, ssh-authkey-fingerprints, keys-to-console, phone-home,
  final-message, power-state-change]
CFG
chroot "$root" systemctl enable systemd-networkd.service >/dev/null 2>&1
# network-online.target waits for a NIC to be configured; a VM with no NIC (autoattachPodInterface:
# false) would wait two minutes for nothing. PCI devices are all in sysfs before init starts.
mkdir -p "$root/etc/systemd/system/systemd-networkd-wait-online.service.d"
cat >"$root/etc/systemd/system/systemd-networkd-wait-online.service.d/cloudguest.conf" <<'UNIT'
[Service]
ExecCondition=/bin/sh -c 'grep -qs "^0x02" /sys/bus/pci/devices/*/class'
UNIT
# Nothing scheduled in a test guest's minute of life.
for unit in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service fstrim.timer; do
    chroot "$root" systemctl disable "$unit" >/dev/null 2>&1 || true
done
EOF
chmod 0755 "$WORK/essential.sh" "$WORK/customize.sh"

# --- the root tree ---------------------------------------------------------------------------------
log "mmdebstrap $SUITE from ${MIRRORS[*]}"
TREE=$WORK/tree
mkdir "$TREE"
mmdebstrap --mode=unshare --variant=minbase --format=directory \
    --include="$(IFS=,; echo "${PACKAGES[*]}")" \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt=force-unsafe-io \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --essential-hook="$WORK/essential.sh \"\$1\"" \
    --customize-hook="$WORK/customize.sh \"\$1\"" \
    "$SUITE" "$TREE" "${MIRRORS[@]}" 2>"$WORK/mmdebstrap.log" || {
    tail -n 40 "$WORK/mmdebstrap.log" >&2
    log "mmdebstrap failed"
    exit 1
}

# cloud-init's default user, as the image's own configuration names it (for `launcher test`).
USER_NAME=$(awk '/^ *default_user:/ {on = 1; next} on && /^ *name:/ {print $2; exit}' "$TREE/etc/cloud/cloud.cfg")
[[ -n $USER_NAME ]] || { log "no default_user in the image's /etc/cloud/cloud.cfg"; exit 1; }
VMLINUZ=$(ls -1 "$TREE"/boot/vmlinuz-* | sort -V | tail -n1)
INITRD=$TREE/boot/initrd.img-${VMLINUZ##*/vmlinuz-}
[[ -f $INITRD ]] || { log "no initramfs for ${VMLINUZ##*/}"; exit 1; }

# --- boot partition: FAT + syslinux ------------------------------------------------------------------
cat >"$WORK/syslinux.cfg" <<EOF
DEFAULT linux
PROMPT 0
TIMEOUT 0
LABEL linux
  KERNEL /vmlinuz
  INITRD /initrd.img
  APPEND $CMDLINE
EOF
cp "$VMLINUZ" "$WORK/vmlinuz"
cp "$INITRD" "$WORK/initrd.img"
touch -d "@$SOURCE_DATE_EPOCH" "$WORK/syslinux.cfg" "$WORK/vmlinuz" "$WORK/initrd.img"
BOOT_SECTORS=$((BOOT_MIB * 2048))
FAT=$WORK/boot.img
mkfs.vfat -C --invariant -n BOOT -h "$BOOT_START" "$FAT" $((BOOT_SECTORS / 2)) >/dev/null
syslinux --install "$FAT"
mcopy -m -i "$FAT" "$WORK/syslinux.cfg" "$WORK/vmlinuz" "$WORK/initrd.img" ::/

# --- root partition: ext4 from the tree ---------------------------------------------------------------
ROOT_START=$((BOOT_START + BOOT_SECTORS))
ROOT_SECTORS=$((DISK_MIB * 2048 - ROOT_START))
ROOTFS=$WORK/root.img
rm -f "$TREE/etc/initramfs-tools/hooks/cloudguest"  # the build's, not the guest's
truncate -s $((ROOT_SECTORS / 2))k "$ROOTFS"
mke2fs -q -t ext4 -L root -U "$ROOT_UUID" -E root_owner=0:0 -d "$TREE" "$ROOTFS" $((ROOT_SECTORS / 2))k

# --- the disk: MBR, bootable FAT, ext4 root ---------------------------------------------------------
RAW=$WORK/disk.raw
truncate -s "${DISK_MIB}M" "$RAW"
sfdisk --quiet "$RAW" <<EOF
label: dos
label-id: 0x434c4f55
unit: sectors
start=$BOOT_START, size=$BOOT_SECTORS, type=c, bootable
start=$ROOT_START, size=$ROOT_SECTORS, type=83
EOF
dd if="$MBR_BIN" of="$RAW" bs=440 count=1 conv=notrunc status=none
dd if="$FAT" of="$RAW" bs=512 seek="$BOOT_START" conv=notrunc,sparse status=none
dd if="$ROOTFS" of="$RAW" bs=1M seek=$((ROOT_START / 2048)) conv=notrunc,sparse status=none
qemu-img convert -q -c -f raw -O qcow2 "$RAW" "$WORK/cloudguest.qcow2"

# --- publish: outputs first, cache key last ---------------------------------------------------------
rm -f "$OUT/recipe.sha256"
echo "$USER_NAME" >"$WORK/default-user"
mv -f "$WORK/cloudguest.qcow2" "$OUT/cloudguest.qcow2"
mv -f "$WORK/default-user" "$OUT/default-user"
echo "$RECIPE" >"$WORK/recipe.sha256"
mv -f "$WORK/recipe.sha256" "$OUT/recipe.sha256"
log "built $OUT/cloudguest.qcow2 ($(du -k "$OUT/cloudguest.qcow2" | cut -f1) KiB, ${VMLINUZ##*/}, default user $USER_NAME)"
