"""Options saying where `launcher run` and `launcher domain` take containerDisk images from: the
digests a VirtualMachine pinned or its tags anew, the registry or the pod's image volumes."""

from __future__ import annotations

from pathlib import Path

import click


def update_option(command):
    return click.option("--update", is_flag=True,
                        help="A VirtualMachine's containerDisk tags are resolved again instead of booting the digests its earlier"
                             " runs pinned; `launcher run` pins the new ones once the VM starts (a dry run pins nothing).")(command)


def container_disk_dir_option(command):
    command = click.option("--kernel-boot-dir", type=click.Path(file_okay=False, exists=True, path_type=Path), metavar="DIR",
                           help="Take kernelBoot.container's kernelPath and initrdPath from the image the pod mounts at DIR"
                                " (KubeVirt's layout: /var/run/kubevirt-kernel-boot) instead of pulling it.")(command)
    return click.option("--container-disk-dir", type=click.Path(file_okay=False, exists=True, path_type=Path), metavar="DIR",
                        help="Use the containerDisks the pod mounts as image volumes, DIR/disk_<index in spec.volumes>"
                             " (KubeVirt's layout: /var/run/kubevirt-image-volume), instead of pulling them.")(command)


PULL_POLICIES = ("Always", "IfNotPresent", "Never")


def pull_policy_option(command):
    return click.option("--pull-policy", type=click.Choice(PULL_POLICIES),
                        help="Every containerDisk's and kernelBoot container's imagePullPolicy for this run, in place of the spec's"
                             " (as the kubelet reads it: Always asks the registry where each tag is now, IfNotPresent boots what"
                             " the node has, Never never pulls; default: the spec's, else Always for :latest, else IfNotPresent).")(command)


def accel_option(command):
    return click.option("--accel", type=click.Choice(["auto", "kvm", "qemu", "tcg"]), default="auto", show_default=True,
                        help="Accelerator (libvirt domain type; tcg is qemu's software emulation). auto: KVM when /dev/kvm"
                             " exists and a probe guest makes progress under it, else TCG; $DISKKIT_ACCEL sets the same."
                             " The choice and its reason are said in one line.")(command)
