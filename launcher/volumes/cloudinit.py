"""What KubeVirt puts on its cloud-init disks (pure): NoCloud and ConfigDrive file sets from a VMI.

Follows pkg/cloud-init/cloud-init.go: meta-data is JSON (valid YAML), its instance-id the firmware
UUID for NoCloud and `<name>.<namespace>` for ConfigDrive; the hostname is spec.hostname, else the
VMI name up to its first dot, cut to 63 characters (pkg/util/net/dns SanitizeHostname); user-data is
always written, network-config only when there is network data. spec.accessCredentials' ssh keys go
into the meta data (`public-keys` for NoCloud, `public_keys` for ConfigDrive), a map Go writes sorted
by key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

from diskkit.errors import DiskkitError
from launcher.spec.vmi import VMI, CloudInitSource

NOCLOUD = "cloudInitNoCloud"
CONFIGDRIVE = "cloudInitConfigDrive"
# Volume ids and image names (GenerateLocalData, GetIsoFilePath).
VOLUME_IDS = {NOCLOUD: "cidata", CONFIGDRIVE: "config-2"}
ISO_NAMES = {NOCLOUD: "noCloud.iso", CONFIGDRIVE: "configdrive.iso"}
# staging/src/kubevirt.io/api/core/v1: ClusterInstancetypeAnnotation wins over InstancetypeAnnotation.
INSTANCETYPE_ANNOTATIONS = ("kubevirt.io/cluster-instancetype-name", "kubevirt.io/instancetype-name")
# resolveNoCloudSecrets / resolveConfigDriveSecrets: the first key found wins.
USER_DATA_KEYS = ("userdata", "userData")
NETWORK_DATA_KEYS = ("networkdata", "networkData")
_DNS1123_LABEL_MAX = 63


@dataclass(frozen=True)
class CloudInitData:
    user_data: bytes
    network_data: bytes


def hostname(vmi: VMI) -> str:
    if vmi.hostname:
        return vmi.hostname
    return vmi.name.split(".")[0][:_DNS1123_LABEL_MAX]


def instance_type(vmi: VMI) -> str | None:
    for key in INSTANCETYPE_ANNOTATIONS:
        if vmi.annotations.get(key):
            return str(vmi.annotations[key])
    return None


def go_json(value) -> bytes:
    """encoding/json.Marshal's bytes: compact, and <, >, & (and U+2028/9) escaped as Go does."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text.encode()


def _first(data: Mapping[str, bytes] | None, keys: tuple[str, ...]) -> bytes | None:
    return next((data[k] for k in keys if k in data), None) if data is not None else None


def resolve(volume_name: str, source: CloudInitSource, user_secret: Mapping[str, bytes] | None = None,
            network_secret: Mapping[str, bytes] | None = None) -> CloudInitData:
    """The user and network data of a cloud-init volume; `user_secret` / `network_secret` are the
    data of the Secrets its secretRef / networkDataSecretRef name (None without a ref)."""
    user, network = source.user_data, source.network_data
    if source.user_data_secret:
        user = _first(user_secret, USER_DATA_KEYS)
    if source.network_data_secret:
        network = _first(network_secret, NETWORK_DATA_KEYS)
    if (source.user_data_secret or source.network_data_secret) and user is None and network is None:
        keys = ", ".join(USER_DATA_KEYS if source.user_data_secret else NETWORK_DATA_KEYS)
        raise DiskkitError(volume_name, f"no cloud-init data-source found at volume: {volume_name} (the secret has no key {keys})")
    if not user and not network:
        raise DiskkitError(volume_name, "UserData or NetworkData is required for cloud-init data source")
    return CloudInitData(user or b"", network or b"")


def _go_map(keys: Mapping[str, str]) -> dict[str, str]:
    return dict(sorted(keys.items()))


def nocloud_files(vmi: VMI, data: CloudInitData, keys: Mapping[str, str] | None = None) -> dict[str, bytes]:
    meta = {}
    if instance_type(vmi):
        meta["instance-type"] = instance_type(vmi)
    meta["instance-id"] = vmi.uuid
    meta["local-hostname"] = hostname(vmi)
    if keys:
        meta["public-keys"] = _go_map(keys)
    files = {"meta-data": go_json(meta), "user-data": data.user_data}
    if data.network_data:
        files["network-config"] = data.network_data
    return files


def configdrive_files(vmi: VMI, data: CloudInitData, keys: Mapping[str, str] | None = None) -> dict[str, bytes]:
    meta = {}
    if instance_type(vmi):
        meta["instance_type"] = instance_type(vmi)
    meta["instance_id"] = f"{vmi.name}.{vmi.namespace}"
    meta["hostname"] = hostname(vmi)
    meta["uuid"] = vmi.uuid
    if keys:
        meta["public_keys"] = _go_map(keys)
    base = "openstack/latest"
    files = {f"{base}/meta_data.json": go_json(meta), f"{base}/user_data": data.user_data}
    if data.network_data:
        files[f"{base}/network_data.json"] = data.network_data
    return files


def files_for(kind: str, vmi: VMI, data: CloudInitData, keys: Mapping[str, str] | None = None) -> dict[str, bytes]:
    return nocloud_files(vmi, data, keys) if kind == NOCLOUD else configdrive_files(vmi, data, keys)
