"""Options and output shared by the launcher's commands: the cache, where claims live, sizes, messages."""

from __future__ import annotations

import os
import re
from pathlib import Path

import click

from diskkit.errors import DiskkitError
from launcher.node.cache import Cache

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, option: str) -> int:
    """Sizes as users write them: 500M, 10G, 1.5Gi, 2T, 4096 (binary units throughout); errors name `option`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB]?)\s*", text)
    if not match:
        raise DiskkitError(option, "must be a size such as 500M, 10G or 1.5Ti")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def node_cache(cache_dir: str | None) -> Cache:
    return Cache(cache_dir)


def warn_if_open(cache: Cache) -> None:
    """One line on stderr for a cache made before caches were private (issue 26)."""
    wide = cache.too_open()
    if wide:
        click.echo(f"launcher: warning: {', '.join(wide)}: readable by other local users; "
                   f"a new cache is private (chmod go-rwx, as root 0711 for the top and run/)", err=True)


CACHE_HELP = "Node cache (default: $DISKKIT_CACHE, else /var/lib/diskkit as root, else ~/.cache/diskkit)."


def cache_option(command):
    return click.option("--cache-dir", type=click.Path(file_okay=False), help=CACHE_HELP)(command)


def storage_options(command):
    """--pvc, --manifests, --pvc-tolerance, --feature-gates and --host-disk-dir: where claims live outside
    a pod and which host disks may be used. Folded into `store`."""
    import functools

    @functools.wraps(command)
    def wrapper(*args, pvc, manifests, kube_api, pvc_tolerance, feature_gates, host_disk_dir, **kwargs):
        from diskkit.errors import DiskkitError
        from launcher.spec.gates import parse_gates
        from launcher.spec.k8s import Objects
        from launcher.volumes.storage import LocalClaim, Storage

        claims = {}
        for value in pvc:
            name, sep, where = value.partition("=")
            if not sep or not name or not where:
                raise DiskkitError(f"--pvc {value}", "must be CLAIM=PATH or CLAIM=DIR:SIZE")
            path, _, size = where.partition(":")
            claims[name] = LocalClaim(Path(path), parse_size(size, f"--pvc {value}") if size else None)
        if manifests and kube_api:
            raise DiskkitError("--kube-api", "give either --manifests or --kube-api, not both")
        objects = Objects.load(Path(manifests)) if manifests else None
        if kube_api:
            from launcher.spec.kubeapi import ClusterObjects

            objects = ClusterObjects()
        gates = parse_gates(feature_gates, host_disk_dir)
        return command(*args, store=Storage(claims, objects, pvc_tolerance, gates=gates,
                                            manifests=Path(manifests).resolve() if manifests else None, kube_api=bool(kube_api)), **kwargs)

    options = [
        click.option("--pvc", multiple=True, metavar="CLAIM=PATH[:SIZE]", help="Where a claim lives here: a directory (its disk.img, created sparse with SIZE when missing) or a block device. Repeatable."),
        click.option("--manifests", type=click.Path(file_okay=False, exists=True), help="Directory of Kubernetes manifests: claims resolve to their bound PV (iSCSI and RBD PVs become network disks); ConfigMaps, Secrets and service account tokens fill configMap, secret, serviceAccount and cloud-init secretRef disks; a VirtualMachine's instance type and preference come from here, and the NetworkAttachmentDefinitions of Multus networks."),
        click.option("--kube-api", is_flag=True, help="Read claims, PVs, ConfigMaps, Secrets, instance types, preferences and NetworkAttachmentDefinitions from the Kubernetes API: in a pod through its service account, elsewhere through KUBECONFIG."),
        click.option("--feature-gates", multiple=True, metavar="GATE[,GATE]", help="KubeVirt feature gates the node's admin turns on (KubeVirt's names; off by default as in KubeVirt): HostDisk, Sidecar (hook sidecars: ConfigMap scripts run as the VM's own user), DownwardMetrics (the metrics disk), PersistentReservation (lun.reservation: an iSCSI lun on bus scsi only)."),
        click.option("--host-disk-dir", multiple=True, metavar="DIR", help="A directory hostDisk volumes may use (with --feature-gates HostDisk); nothing outside one, and no symbolic link below it, is attached. Repeatable."),
        click.option("--pvc-tolerance", type=click.IntRange(0, 100), default=10, show_default=True, metavar="PERCENT", help="How much smaller than requested a new disk.img may be (KubeVirt's pvcTolerateLessSpaceUpToPercent)."),
    ]
    for option in options:
        wrapper = option(wrapper)
    return wrapper


def trust_options(command):
    """--signature-policy and --registries.d, as skopeo takes them, and --require-boot-test-key /
    --require-boot-test-gpg-key (verify-attestation's --key / --gpg-key), folded into the `registry`
    options that `registry_options` (above this decorator) made: every read of the command, the disk
    server's included, answers to that policy."""
    import functools
    from dataclasses import replace

    @functools.wraps(command)
    def wrapper(*args, registry, signature_policy, registries_d, require_boot_test_key, require_boot_test_gpg_key, **kwargs):
        # Absolute: the disk server this command may start reads them from another directory.
        keys = tuple(os.path.abspath(k) for k in require_boot_test_key)
        gpg_keys = tuple(os.path.abspath(k) for k in require_boot_test_gpg_key)
        return command(*args, registry=replace(registry, signature_policy=signature_policy, registries_d=registries_d,
                                               boot_test_keys=keys, boot_test_gpg_keys=gpg_keys), **kwargs)

    options = [
        click.option("--require-boot-test-gpg-key", multiple=True, type=click.Path(exists=True, dir_okay=False),
                     help="As --require-boot-test-key, for an attestation signed with GnuPG: a keyring file (gpg --export) of accepted keys (repeatable)."),
        click.option("--require-boot-test-key", multiple=True, type=click.Path(exists=True, dir_okay=False),
                     help="Read only images with a passed boot-test attestation (launcher test --attest-*) of the exact manifest"
                          " read, signed by this sigstore public key (repeatable: any one of them)."),
        click.option("--registries.d", "registries_d", type=click.Path(file_okay=False),
                     help="registries.d directory: where use-sigstore-attachments is set (default: ~/.config/containers/registries.d, else /etc/containers/registries.d)."),
        click.option("--signature-policy", type=click.Path(dir_okay=False),
                     help="policy.json every image must pass (default: ~/.config/containers/policy.json, else /etc/containers/policy.json; with neither, everything is accepted)."),
    ]
    for option in options:
        wrapper = option(wrapper)
    return wrapper


def say(text: str) -> None:
    click.echo(f"launcher: {text}", err=True)


def ignore_unsupported_option(command):
    return click.option("--ignore-unsupported", is_flag=True,
                        help="Run without the fields the launcher does not implement (a watchdog, a sound card, NUMA...) instead of"
                             " refusing the VM; each one is named as it is dropped.")(command)


def load_vmi_file(path: str, ignore_unsupported: bool, objects=None):
    """The VMI of a file (instance types and preferences from `objects`), naming each field
    `--ignore-unsupported` dropped."""
    from launcher.spec.vmi import load_vmi

    vmi = load_vmi(path, ignore_unsupported, objects=objects)
    for field, why in vmi.ignored:
        say(f"ignoring {field}: {why.partition(';')[0]}")
    return vmi
