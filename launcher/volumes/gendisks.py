"""The disks KubeVirt generates for a VM: cloud-init, config and sysprep ISOs and the downwardMetrics disk.

Content comes from the VMI (cloudinit, configdisks: pure) and from Kubernetes objects: `--manifests`
first, else the volume as the kubelet mounted it into virt-launcher's pod. Images are written under
the VM's run directory with virt-launcher's layout and names, each atomically; in a dry run
(`create` false) only their paths are planned, but every object is still looked up and checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from diskkit.errors import DiskkitError
from launcher.node.cache import private_dirs, within
from launcher.spec import credentials
from launcher.spec.k8s import Objects
from launcher.spec.vmi import VMI, Volume
from launcher.volumes import cloudinit, configdisks, iso, vhostmd
from launcher.volumes.storage import POD_CONFIG, SERVICE_ACCOUNT_MOUNT

K8S_KINDS = {"configMap": ("ConfigMap", "configmaps"), "secret": ("Secret", "secrets")}


@dataclass
class Sources:
    """Where objects come from: manifests, else pod mounts (configurable for tests)."""

    objects: Objects | None = None
    pod_config: Path = POD_CONFIG
    service_account_dir: Path = SERVICE_ACCOUNT_MOUNT


@dataclass
class Planned:
    path: Path
    volume_id: str | None = None  # None: not an ISO (the metrics disk)
    files: dict[str, bytes] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)


def read_mount(directory: Path) -> dict[str, bytes]:
    """The files of a volume the kubelet mounted: keys are symlinks into `..data`, which is skipped."""
    files: dict[str, bytes] = {}
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith(".."):
            continue
        if entry.is_dir():
            files.update({f"{entry.name}/{k}": v for k, v in read_mount(entry).items()})
        elif entry.is_file():
            files[entry.name] = entry.read_bytes()
    return files


def object_files(objects: Objects | None, namespace: str, kind: str, name: str, mount: Path, optional: bool,
                 where: str) -> dict[str, bytes]:
    """The files of a ConfigMap or Secret: from the manifests, else its pod mount; a missing
    optional one is empty, as the kubelet mounts it."""
    k8s_kind, resource = K8S_KINDS[kind]
    if objects is not None:
        doc = objects.get(k8s_kind, namespace, name)
        if doc is not None:
            return configdisks.configmap_files(doc) if kind == "configMap" else configdisks.secret_files(doc)
    if mount.is_dir():
        return read_mount(mount)
    if optional:
        return {}
    if objects is None:
        raise DiskkitError(where, f"{k8s_kind} {name}: give --manifests DIR holding it, or mount it at {mount}")
    raise DiskkitError(where, f'{resource} "{name}" not found in namespace {namespace}')


def access_credential_mount(pod_config: Path, secret: str) -> Path:
    """Where virt-launcher's pod has an access credential's Secret: <secretName>-access-cred."""
    return pod_config / configdisks.SOURCE_DIRS["secret"] / f"{secret}-access-cred"


class Generator:
    def __init__(self, vmi: VMI, run_dir: Path, sources: Sources):
        self.vmi, self.run_dir, self.sources = vmi, run_dir, sources

    # --- lookups ----------------------------------------------------------------------------

    def _object(self, kind: str, name: str, mount: Path, optional: bool, where: str) -> dict[str, bytes]:
        return object_files(self.sources.objects, self.vmi.namespace, kind, name, mount, optional, where)

    # --- the disks ----------------------------------------------------------------------------

    def cloud_init(self, volume: Volume, where: str) -> Planned:
        # virt-launcher writes one image per kind, from the first such volume, and points every disk of
        # that kind at it (converter testdata/domain_x86_64.xml has two cloudInitNoCloud disks).
        first = next(v for v in self.vmi.volumes if v.kind == volume.kind)
        if first.name != volume.name:
            volume, where = first, f"spec.volumes[{first.index}].{first.kind}"
        kind, source = volume.kind, volume.source
        mount = self.sources.pod_config / configdisks.SOURCE_DIRS["secret"] / volume.name
        user = network = None
        if source.user_data_secret:
            user = self._object("secret", source.user_data_secret, mount, False, f"{where}.secretRef")
        if source.network_data_secret:
            network = self._object("secret", source.network_data_secret, mount, False, f"{where}.networkDataSecretRef")
        try:
            data = cloudinit.resolve(volume.name, source, user, network)
        except DiskkitError as err:
            raise DiskkitError(where, err.rule) from None
        path = within(self.run_dir, "cloud-init-data", self.vmi.namespace, self.vmi.name, cloudinit.ISO_NAMES[kind])
        return Planned(path, cloudinit.VOLUME_IDS[kind], cloudinit.files_for(kind, self.vmi, data, self._ssh_keys(kind)))

    def _ssh_keys(self, kind: str) -> dict[str, str]:
        """spec.accessCredentials' keys for this cloud-init kind; virt-launcher reads each Secret where its
        pod mounts it, <secretName>-access-cred (pkg/cloud-init/cloud-init.go resolveSSHPublicKeys)."""
        method = next(m for m, k in credentials.VOLUME_KINDS.items() if k == kind)
        secrets = {}
        for idx, cred in enumerate(self.vmi.access_credentials):
            if cred.method == method and cred.secret_name and cred.secret_name not in secrets:
                mount = access_credential_mount(self.sources.pod_config, cred.secret_name)
                secrets[cred.secret_name] = self._object("secret", cred.secret_name, mount, False,
                                                         f"spec.accessCredentials[{idx}].sshPublicKey.source.secret")
        return credentials.public_keys(self.vmi.access_credentials, method, secrets)

    def config(self, volume: Volume, where: str) -> Planned:
        kind, source = volume.kind, volume.source
        name = source.name if kind == "configMap" else source.secret_name
        mount = self.sources.pod_config / configdisks.SOURCE_DIRS[kind] / volume.name
        files = self._object(kind, name, mount, source.optional, where)
        path = within(self.run_dir, configdisks.DISK_DIRS[kind], f"{volume.name}.iso")
        return Planned(path, source.volume_label or configdisks.DEFAULT_LABEL, files)

    def service_account(self, volume: Volume, where: str) -> Planned:
        account = volume.source.service_account_name
        objects, mount = self.sources.objects, self.sources.service_account_dir
        doc = None
        if objects is not None:
            doc = configdisks.service_account_token_secret(objects.of_kind("Secret", self.vmi.namespace), account)
        if doc is not None:
            files = configdisks.service_account_files(doc, self.vmi.namespace)
        elif (mount / "token").is_file():
            files = {name: (mount / name).read_bytes() for name in configdisks.SERVICE_ACCOUNT_FILES if (mount / name).is_file()}
        else:
            raise DiskkitError(where, f"serviceAccount {account}: no token Secret for it in namespace {self.vmi.namespace}"
                                      f" (type {configdisks.SERVICE_ACCOUNT_TOKEN_TYPE}, annotation"
                                      f" {configdisks.SERVICE_ACCOUNT_NAME_ANNOTATION}: {account}) in --manifests, and no token in {mount}")
        return Planned(within(self.run_dir, configdisks.SERVICE_ACCOUNT_DISK), configdisks.DEFAULT_LABEL, files)

    def downward_api(self, volume: Volume, where: str) -> Planned:
        files, modes = configdisks.downward_api_files(self.vmi, volume.source.fields)
        path = within(self.run_dir, configdisks.DISK_DIRS["downwardAPI"], f"{volume.name}.iso")
        return Planned(path, volume.source.volume_label or configdisks.DEFAULT_LABEL, files, modes)

    def sysprep(self, volume: Volume, where: str) -> Planned:
        """pkg/config/sysprep.go: every key of the Secret (else the ConfigMap) on a CD-ROM labelled
        unattendCD, which must hold an answer file."""
        source = volume.source
        kind, name = ("secret", source.secret) if source.secret else ("configMap", source.config_map)
        mount = self.sources.pod_config / configdisks.SOURCE_DIRS["sysprep"] / volume.name
        files = self._object(kind, name, mount, False, f"{where}.{kind}")
        problem = configdisks.sysprep_problem(files)
        if problem:
            raise DiskkitError(f"{where}.{kind}", problem)
        path = within(self.run_dir, configdisks.DISK_DIRS["sysprep"], f"{volume.name}.iso")
        return Planned(path, configdisks.SYSPREP_LABEL, files)

    def downward_metrics(self, volume: Volume, where: str) -> Planned:
        return Planned(within(self.run_dir, vhostmd.DISK_PATH))


def make(planned: Planned, run_dir: Path, finish: Callable[[Path], None] | None = None) -> Path:
    """Write the disk; its directories, like the run directory, are for its owner and qemu only."""
    private_dirs(run_dir, planned.path.parent)
    if planned.volume_id is None:
        return vhostmd.create(planned.path, finish)
    return iso.write_iso(planned.path, planned.volume_id, planned.files, planned.modes, finish)
