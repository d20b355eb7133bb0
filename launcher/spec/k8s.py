"""Kubernetes objects given as manifests: claims resolved to their bound PersistentVolumes, and iSCSI or
RBD volumes turned into libvirt network disk sources (pure, but for `Objects.load`).

The launcher runs without an API server, so a directory of manifests (`kubectl get -o yaml` output, or
a ConfigMap mounted into the pod) stands in for one. Field rules and defaults are Kubernetes' own
(core/v1 types, pkg/volume/iscsi, pkg/volume/rbd); the network disks are KubeVirt's 2017 proposal for
PV-backed disks, which qemu reaches directly instead of through a node-side mount.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diskkit.errors import DiskkitError
from launcher.spec.fields import SpecError, dig, parse_quantity
from launcher.spec.meta import (
    check_annotations,
    check_labels,
    check_namespace,
    check_subdomain,
    check_xml_text,
    load_documents,
)

# Kinds without a namespace; everything else is namespaced, "default" when the manifest names none
# (what `kubectl apply` does with the default context).
CLUSTER_SCOPED = frozenset({"PersistentVolume", "StorageClass", "Namespace", "Node", "CSIDriver", "VolumeAttachment",
                            "VirtualMachineClusterInstancetype", "VirtualMachineClusterPreference"})
DEFAULT_NAMESPACE = "default"
VOLUME_MODES = ("Filesystem", "Block")
ISCSI_PORT = 3260
CEPH_MON_PORT = 6789
CHAP_USERNAME = "node.session.auth.username"
CHAP_PASSWORD = "node.session.auth.password"
# PersistentVolumeSpec fields that are not the volume source; whatever else is set names the PV's type.
# ConfigMap and Secret contents: they become files in generated disks, never part of the domain XML.
PAYLOAD_FIELDS = frozenset({"data", "stringData", "binaryData"})
_PV_COMMON = frozenset({"accessModes", "capacity", "claimRef", "mountOptions", "nodeAffinity",
                        "persistentVolumeReclaimPolicy", "storageClassName", "volumeMode", "volumeAttributesClassName"})
# librbd's own fallbacks, which qemu gets when libvirt passes no cephx key (and Kubernetes' defaults).
_RBD_DEFAULT_USER = "admin"
_RBD_DEFAULT_KEYRING = "/etc/ceph/keyring"



# ---------------------------------------------------------------- objects

class Objects:
    """Manifests indexed by (kind, namespace, name)."""

    def __init__(self, documents: Iterable[dict] = (), origin: str = "manifests"):
        self._items: dict[tuple[str, str | None, str], dict] = {}
        self._origins: dict[tuple[str, str | None, str], str] = {}
        for number, doc in enumerate(documents, 1):
            self._add(doc, f"{origin} document {number}")

    @classmethod
    def load(cls, directory: Path) -> Objects:
        """Every document of the *.yaml, *.yml and *.json files directly in `directory`."""
        directory = Path(directory)
        if not directory.is_dir():
            raise DiskkitError(directory, "not a directory of Kubernetes manifests")
        objects = cls()
        # Dot files are skipped: a ConfigMap mounted as a volume also holds ..data and ..<timestamp>
        # entries, and its real files are symlinks next to them.
        files = sorted(p for p in directory.iterdir()
                       if p.suffix in (".yaml", ".yml", ".json") and not p.name.startswith(".") and p.is_file())
        for path in files:
            for number, doc in enumerate(load_documents(path), 1):
                if doc is not None:  # an empty document between two `---`
                    objects._add(doc, f"{path} document {number}")
        return objects

    def add(self, doc: dict, origin: str) -> None:
        """One more object (one a command makes in memory, e.g. `launcher test`'s key Secret)."""
        self._add(doc, origin)

    def _add(self, doc: Any, origin: str) -> None:
        if not isinstance(doc, dict):
            raise DiskkitError(origin, "a Kubernetes object must be a mapping")
        kind = doc.get("kind")
        if kind == "List":
            items = doc.get("items") or []
            if not isinstance(items, list):
                raise DiskkitError(origin, "items of a List must be a list")
            for number, item in enumerate(items):
                self._add(item, f"{origin} items[{number}]")
            return
        name, namespace = dig(doc, "metadata", "name"), dig(doc, "metadata", "namespace")
        if not isinstance(kind, str) or not kind:
            raise DiskkitError(origin, "kind is required")
        if not isinstance(name, str) or not name:
            raise DiskkitError(origin, f"{kind}: metadata.name is required")
        if namespace is not None and not isinstance(namespace, str):
            raise DiskkitError(origin, f"{kind} {name}: metadata.namespace must be a string")
        try:
            _check_meta(doc, kind, name, namespace)
        except SpecError as err:
            raise DiskkitError(origin, f"{kind}: {err.subject}: {err.rule}") from None
        key = (kind, None if kind in CLUSTER_SCOPED else namespace or DEFAULT_NAMESPACE, name)
        if key in self._items:
            # Two versions of one object: which one the cluster holds is anybody's guess.
            raise DiskkitError(origin, f"{describe_object(*key)} is already defined in {self._origins[key]}")
        self._items[key] = doc
        self._origins[key] = origin

    def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        return self._items.get((kind, None if kind in CLUSTER_SCOPED else namespace or DEFAULT_NAMESPACE, name))

    def of_kind(self, kind: str, namespace: str | None) -> list[dict]:
        """Every object of `kind` in `namespace` (cluster-scoped kinds: every one), in name order."""
        ns = None if kind in CLUSTER_SCOPED else namespace or DEFAULT_NAMESPACE
        return [doc for (k, n, _), doc in sorted(self._items.items(), key=lambda kv: kv[0][2]) if k == kind and n == ns]

    def __len__(self) -> int:
        return len(self._items)

    def documents(self, kind: str) -> list[tuple[str, dict]]:
        """(origin, document) of every object of `kind`, in the order they were read."""
        return [(self._origins[key], doc) for key, doc in self._items.items() if key[0] == kind]


def _check_meta(doc: dict, kind: str, name: str, namespace: str | None) -> None:
    """ValidateObjectMeta, and no string libvirt's XML could not carry (payloads aside)."""
    # pkg/apis/core/validation: Namespace names are DNS labels, every other kind here a DNS subdomain.
    (check_namespace if kind == "Namespace" else check_subdomain)(name, "metadata.name")
    if namespace:
        check_namespace(namespace, "metadata.namespace")
    metadata = doc.get("metadata")
    check_labels(metadata.get("labels"), "metadata.labels")
    check_annotations(metadata.get("annotations"), "metadata.annotations")
    check_xml_text(doc, "", skip=PAYLOAD_FIELDS)


def describe_object(kind: str, namespace: str | None, name: str) -> str:
    return f"{kind} {name}" if namespace is None else f"{kind} {namespace}/{name}"


# ---------------------------------------------------------------- claims

@dataclass(frozen=True)
class Claim:
    name: str
    namespace: str
    volume_mode: str  # "Filesystem" | "Block"
    request: int | None  # bytes, spec.resources.requests.storage
    capacity: int | None  # bytes, the PV's spec.capacity.storage, else the claim's status.capacity.storage
    access_modes: tuple[str, ...]
    read_only: bool  # ReadOnlyMany is the only access mode
    pv: dict | None = field(default=None, hash=False)
    shareable: bool = False  # ReadWriteMany: other nodes may write at the same time


def _bytes(value: Any, where: str, what: str) -> int | None:
    if value is None:
        return None
    try:
        return math.floor(parse_quantity(value, what))
    except SpecError as err:
        raise DiskkitError(where, f"{err.subject}: {err.rule}") from None


def claim_sizes(objects: Objects, namespace: str, claim_name: str, where: str) -> tuple[int | None, int | None] | None:
    """A claim object's spec.resources.requests.storage and status.capacity.storage, bound or not (a
    claim mounted on this node is bound wherever it came from): what KubeVirt's
    PersistentVolumeClaimInfo carries to size a disk.img. None when the manifests hold no such claim."""
    pvc = objects.get("PersistentVolumeClaim", namespace, claim_name)
    if pvc is None:
        return None
    return (_bytes(dig(pvc, "spec", "resources", "requests", "storage"), where, f"claim {claim_name} spec.resources.requests.storage"),
            _bytes(dig(pvc, "status", "capacity", "storage"), where, f"claim {claim_name} status.capacity.storage"))


def resolve_claim(objects: Objects, namespace: str, claim_name: str, where: str) -> Claim:
    """The claim `claim_name` and the PersistentVolume it is bound to; `where` is the field to blame."""
    pvc = objects.get("PersistentVolumeClaim", namespace, claim_name)
    if pvc is None:
        raise DiskkitError(where, f'persistentvolumeclaims "{claim_name}" not found in namespace {namespace}')
    unbound = f"claim {claim_name} is not bound to a PersistentVolume"
    phase = dig(pvc, "status", "phase") or "Pending"  # what the API server sets on a new claim
    pv_name = dig(pvc, "spec", "volumeName")
    if phase != "Bound" or not pv_name:
        missing = ", no spec.volumeName" if phase == "Bound" else ""
        raise DiskkitError(where, f"{unbound} (phase {phase}{missing})")
    pv = objects.get("PersistentVolume", None, pv_name)
    if pv is None:
        raise DiskkitError(where, f'{unbound} (persistentvolumes "{pv_name}" not found)')
    ref = dig(pv, "spec", "claimRef") or {}
    claim_uid, ref_uid = dig(pvc, "metadata", "uid"), dig(ref, "uid")
    # A Released PV still names its old claim; the uid tells a recreated claim of the same name apart.
    if (ref.get("name"), ref.get("namespace") or DEFAULT_NAMESPACE) != (claim_name, namespace) or (
            claim_uid and ref_uid and claim_uid != ref_uid):
        owner = f"{ref.get('namespace') or DEFAULT_NAMESPACE}/{ref['name']}" if ref.get("name") else "no claim"
        raise DiskkitError(where, f'{unbound} (persistentvolumes "{pv_name}" is bound to {owner})')

    volume_mode = dig(pvc, "spec", "volumeMode") or "Filesystem"
    if volume_mode not in VOLUME_MODES:
        raise DiskkitError(where, f"claim {claim_name}: spec.volumeMode {volume_mode!r} is neither Filesystem nor Block")
    modes = dig(pvc, "status", "accessModes") or dig(pvc, "spec", "accessModes") or dig(pv, "spec", "accessModes") or []
    if not isinstance(modes, list) or not all(isinstance(m, str) for m in modes):
        raise DiskkitError(where, f"claim {claim_name}: accessModes must be a list of strings")
    capacity = dig(pv, "spec", "capacity", "storage")
    capacity_at = f"persistentvolumes {pv_name} spec.capacity.storage"
    if capacity is None:
        capacity, capacity_at = dig(pvc, "status", "capacity", "storage"), f"claim {claim_name} status.capacity.storage"
    return Claim(
        name=claim_name, namespace=namespace, volume_mode=volume_mode,
        request=_bytes(dig(pvc, "spec", "resources", "requests", "storage"), where,
                       f"claim {claim_name} spec.resources.requests.storage"),
        capacity=_bytes(capacity, where, capacity_at),
        access_modes=tuple(modes), read_only=set(modes) == {"ReadOnlyMany"}, pv=pv, shareable="ReadWriteMany" in modes,
    )


# ---------------------------------------------------------------- network disks

@dataclass(frozen=True)
class NetworkSource:
    protocol: str  # "iscsi" | "rbd"
    name: str  # iSCSI "<iqn>/<lun>", RBD "<pool>/<image>"
    hosts: tuple[tuple[str, int | None], ...]  # iSCSI targetPortal then portals; RBD monitors
    auth_username: str | None = None
    secret_type: str | None = None  # libvirt secret usage type: "iscsi" | "ceph"
    secret_usage: str | None = None  # libvirt secret usage id the domain refers to
    initiator: str | None = None  # iSCSI initiatorName, for targets whose ACLs name their initiators
    socket: str | None = None  # NBD over a unix socket (the node's disk server): no hosts then


@dataclass(frozen=True)
class NetworkDisk:
    source: NetworkSource
    secret_value: bytes | None  # what the libvirt secret holds: the CHAP password, or the raw cephx key
    read_only: bool


def _host_port(text: Any, default_port: int, where: str, what: str) -> tuple[str, int]:
    """`host`, `host:port`, `[v6]`, `[v6]:port` (libvirt wants IPv6 addresses without brackets)."""
    if not isinstance(text, str) or not text.strip():
        raise DiskkitError(where, f"{what} must be a host or host:port")
    text = text.strip()
    host, port = text, None
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise DiskkitError(where, f"{what} {text!r} is not a host or host:port")
            port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    if port is None:
        return host, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise DiskkitError(where, f"{what} {text!r} has an invalid port")
    return host, int(port)


def _required(src: dict, key: str, where: str, at: str) -> str:
    value = src.get(key)
    if not isinstance(value, str) or not value:
        raise DiskkitError(where, f"{at}.{key} is required")
    return value


def read_secret(objects: Objects, ref: Any, default_namespace: str, where: str, at: str) -> tuple[str, dict[str, bytes]]:
    """(namespace/name, data) of the secret `ref` points to: data base64-decoded, stringData over it as
    the API server merges them. An empty ref namespace is the claim's, as the kubelet's plugins read it."""
    name = dig(ref, "name")
    if not isinstance(name, str) or not name:
        raise DiskkitError(where, f"{at}.secretRef.name is required")
    namespace = dig(ref, "namespace") or default_namespace
    secret = objects.get("Secret", namespace, name)
    if secret is None:
        raise DiskkitError(where, f'secrets "{name}" not found in namespace {namespace} (the {at}.secretRef)')
    encoded, plain = secret.get("data") or {}, secret.get("stringData") or {}
    if not isinstance(encoded, dict) or not isinstance(plain, dict):
        raise DiskkitError(where, f"secret {namespace}/{name}: data and stringData must be mappings")
    data: dict[str, bytes] = {}
    for key, value in encoded.items():
        try:
            data[key] = base64.b64decode(str(value), validate=True)
        except binascii.Error:
            raise DiskkitError(where, f"secret {namespace}/{name}: data.{key} is not valid base64") from None
    data.update({key: str(value).encode() for key, value in plain.items()})
    return f"{namespace}/{name}", data


def _secret_key(data: dict[str, bytes], key: str, secret: str, where: str, purpose: str) -> bytes:
    value = data.get(key)
    if not value:
        raise DiskkitError(where, f"secret {secret} has no {key} ({purpose})")
    return value


def _secret_text(value: bytes, secret: str, key: str, where: str) -> str:
    """A secret's value that goes into the domain XML (the CHAP user name): UTF-8 that XML can carry."""
    try:
        text = value.decode()
        check_xml_text(text, f"secret {secret} data.{key}")
    except UnicodeDecodeError:
        raise DiskkitError(where, f"secret {secret}: data.{key} is not UTF-8 text") from None
    except SpecError as err:
        raise DiskkitError(where, f"{err.subject}: {err.rule}") from None
    return text


def _iscsi(objects: Objects, claim: Claim, pv_name: str, src: dict, where: str) -> NetworkDisk:
    at = f"persistentvolumes {pv_name} spec.iscsi"
    iqn = _required(src, "iqn", where, at)
    if not iqn.startswith(("iqn.", "eui.", "naa.")):  # core/v1 validation, its wording
        raise DiskkitError(where, f"{at}.iqn {iqn!r}: must be valid format starting with iqn, eui, or naa")
    lun = src.get("lun", 0)
    if isinstance(lun, bool) or not isinstance(lun, int) or not 0 <= lun <= 255:
        raise DiskkitError(where, f"{at}.lun: must be between 0 and 255")
    portals = src.get("portals") or []
    if not isinstance(portals, list):
        raise DiskkitError(where, f"{at}.portals must be a list")
    hosts = [_host_port(src.get("targetPortal"), ISCSI_PORT, where, f"{at}.targetPortal")]
    hosts += [_host_port(p, ISCSI_PORT, where, f"{at}.portals[{i}]") for i, p in enumerate(portals)]
    initiator = src.get("initiatorName") or None
    # Only session CHAP matters: qemu logs in to the target directly, with no SendTargets discovery,
    # so chapAuthDiscovery has nothing to authenticate. fsType and iscsiInterface are for the node's
    # own initiator, which the guest's raw disk bypasses.
    username = usage = secret_type = password = None
    if src.get("chapAuthSession"):
        if src.get("secretRef") is None:
            raise DiskkitError(where, f"{at}.chapAuthSession needs {at}.secretRef")
        secret, data = read_secret(objects, src["secretRef"], claim.namespace, where, at)
        if data.get(CHAP_USERNAME + "_in"):
            raise DiskkitError(where, f"secret {secret}: mutual CHAP ({CHAP_USERNAME}_in) is not supported by qemu's iSCSI initiator")
        purpose = f"session CHAP of persistentvolumes {pv_name}"
        username = _secret_text(_secret_key(data, CHAP_USERNAME, secret, where, purpose), secret, CHAP_USERNAME, where)
        password = _secret_key(data, CHAP_PASSWORD, secret, where, purpose)
        usage, secret_type = f"diskkit-{claim.namespace}-{pv_name}", "iscsi"
    source = NetworkSource("iscsi", f"{iqn}/{lun}", tuple(dict.fromkeys(hosts)), username, secret_type, usage, initiator)
    return NetworkDisk(source, password, bool(src.get("readOnly")) or claim.read_only)


def _rbd(objects: Objects, claim: Claim, pv_name: str, src: dict, where: str) -> NetworkDisk:
    at = f"persistentvolumes {pv_name} spec.rbd"
    monitors = src.get("monitors")
    if not isinstance(monitors, list) or not monitors:
        raise DiskkitError(where, f"{at}.monitors is required")
    hosts = tuple(dict.fromkeys(_host_port(m, CEPH_MON_PORT, where, f"{at}.monitors[{i}]") for i, m in enumerate(monitors)))
    image = _required(src, "image", where, at)
    pool = src.get("pool") or "rbd"
    user = src.get("user") or _RBD_DEFAULT_USER
    read_only = bool(src.get("readOnly")) or claim.read_only
    if src.get("secretRef") is None:
        # libvirt hands qemu a user name only together with a key secret; without one, librbd falls
        # back to client.admin and the node's default keyrings, which covers Kubernetes' defaults only.
        keyring = src.get("keyring") or _RBD_DEFAULT_KEYRING
        if user != _RBD_DEFAULT_USER or keyring != _RBD_DEFAULT_KEYRING:
            raise DiskkitError(where, f"{at}: user {user} with keyring {keyring} needs a secretRef holding the cephx key"
                                      f" (without one only user {_RBD_DEFAULT_USER} with {_RBD_DEFAULT_KEYRING} works)")
        return NetworkDisk(NetworkSource("rbd", f"{pool}/{image}", hosts), None, read_only)
    secret, data = read_secret(objects, src["secretRef"], claim.namespace, where, at)
    # Kubernetes' rbd plugin takes any value of the secret; `key` is what its docs create.
    text = data.get("key") or (next(iter(data.values())) if len(data) == 1 else None)
    if not text:
        raise DiskkitError(where, f"secret {secret} has no key (the cephx key of client.{user} for persistentvolumes {pv_name})")
    try:
        # A cephx key is base64 text (`ceph auth get-key`); libvirt stores the bytes it encodes.
        key = base64.b64decode(text.strip(), validate=True)
    except binascii.Error:
        key = b""
    if not key:
        raise DiskkitError(where, f"secret {secret}: key is not a cephx key (base64 text as `ceph auth get-key` prints it)")
    source = NetworkSource("rbd", f"{pool}/{image}", hosts, user, "ceph", f"diskkit-{claim.namespace}-{pv_name}")
    return NetworkDisk(source, key, read_only)


def pv_type(pv: dict) -> str:
    """The volume source a PersistentVolume uses: iscsi, rbd, nfs, csi, hostPath, local..."""
    spec = dig(pv, "spec") or {}
    kinds = sorted(k for k, v in spec.items() if k not in _PV_COMMON and v is not None) if isinstance(spec, dict) else []
    return kinds[0] if kinds else "unknown"


def network_disk(objects: Objects, claim: Claim, where: str, *, required: bool = False) -> NetworkDisk | None:
    """The claim's iSCSI or RBD volume as a disk qemu connects to itself; None for other volume types
    (the caller then needs the volume at a local path), or an error when `required`."""
    if claim.pv is None:
        raise DiskkitError(where, f"claim {claim.name} is not bound to a PersistentVolume")
    pv_name = dig(claim.pv, "metadata", "name")
    spec = dig(claim.pv, "spec") or {}
    for kind, convert in (("iscsi", _iscsi), ("rbd", _rbd)):
        src = spec.get(kind)
        if src is not None:
            if not isinstance(src, dict):
                raise DiskkitError(where, f"persistentvolumes {pv_name} spec.{kind} must be a mapping")
            return convert(objects, claim, pv_name, src, where)
    if required:
        raise DiskkitError(where, f"persistentvolumes {pv_name} (of claim {claim.name}) has volume type {pv_type(claim.pv)};"
                                  " only iscsi and rbd volumes can be attached as network disks")
    return None


DOCKER_CONFIG_JSON = ("kubernetes.io/dockerconfigjson", ".dockerconfigjson")
DOCKER_CFG = ("kubernetes.io/dockercfg", ".dockercfg")


def pull_secret_config(objects: Objects | None, namespace: str, name: str, at: str) -> tuple[dict | None, str | None]:
    """The docker config an image pull Secret holds, or (None, why not) where the kubelet would warn and
    pull without it (kubernetes pkg/credentialprovider/secrets: a Secret of another type is skipped)."""
    secret = objects.get("Secret", namespace, name) if objects is not None else None
    if secret is None:
        where = "in --manifests" if objects is not None else "(no --manifests given)"
        return None, f'{at}: secrets "{name}" not found in namespace {namespace} {where}; pulling with this node\'s credentials'
    kind = secret.get("type")
    _, data = read_secret(objects, {"name": name, "namespace": namespace}, namespace, f"secret {namespace}/{name}", at)
    for secret_type, key in (DOCKER_CONFIG_JSON, DOCKER_CFG):
        if kind == secret_type and data.get(key):
            import json

            try:
                config = json.loads(data[key])
            except ValueError:
                raise DiskkitError(f"secret {namespace}/{name}", f"data.{key} is not JSON") from None
            if not isinstance(config, dict):
                raise DiskkitError(f"secret {namespace}/{name}", f"data.{key} is not a JSON object")
            return (config if key == ".dockerconfigjson" else {"auths": config}), None
    return None, f"{at}: secret {namespace}/{name} is not of type kubernetes.io/dockerconfigjson (data .dockerconfigjson) or kubernetes.io/dockercfg (data .dockercfg); ignored, as the kubelet does"
