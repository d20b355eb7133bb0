"""What goes on KubeVirt's config disks (pure): the files of a ConfigMap, a Secret, a ServiceAccount
token or a downwardAPI volume, as the kubelet would have mounted them for virt-launcher.

KubeVirt (pkg/config) turns each mounted volume directory into an ISO whose root holds one file per
key; the volume id is `volumeLabel` (KubeVirt passes it to xorrisofs as given, so unset means an
empty volume id), the service account's has none. The kubelet's own bookkeeping (`..data` and the
timestamped directory it points to) is left out: it holds the same files again.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Iterable

from diskkit.errors import DiskkitError
from launcher.spec.vmi import VMI, DownwardAPIFile

# Where virt-launcher finds each volume and writes each image, relative to /var/run/kubevirt-private
# (pkg/config/config.go); the launcher keeps the same layout under a VM's run directory.
SOURCE_DIRS = {"configMap": "config-map", "secret": "secret", "downwardAPI": "downwardapi", "sysprep": "sysprep"}
DISK_DIRS = {"configMap": "config-map-disks", "secret": "secret-disks", "downwardAPI": "downwardapi-disks", "sysprep": "sysprep-disks"}
SERVICE_ACCOUNT_DISK = "service-account-disk/service-account.iso"
# KubeVirt passes an unset volumeLabel to xorrisofs as an empty volume id, which no guest can mount by
# label; ours is `cfgdata` then (the serviceAccount disk, which has no volumeLabel field, too).
DEFAULT_LABEL = "cfgdata"
SERVICE_ACCOUNT_FILES = ("ca.crt", "namespace", "token")
SERVICE_ACCOUNT_TOKEN_TYPE = "kubernetes.io/service-account-token"
SERVICE_ACCOUNT_NAME_ANNOTATION = "kubernetes.io/service-account.name"
# pkg/config/sysprep.go: the answer file's CD-ROM ("assuming windows does not care what's the exact label"),
# which must hold one of Windows Setup's answer files, whatever their case
SYSPREP_LABEL = "unattendCD"
ANSWER_FILES = ("autounattend.xml", "unattend.xml")
# k8s.io/apimachinery validation.IsConfigMapKey
_KEY = re.compile(r"[-._a-zA-Z0-9]+")
KEY_MAX = 253


def _check_key(key: str, where: str) -> None:
    if len(key) > KEY_MAX or not _KEY.fullmatch(key) or key in (".", "..") or key.startswith(".."):
        raise DiskkitError(where, f"{key!r}: a valid config key must consist of alphanumeric characters, '-', '_' or '.'")


def _describe(doc: dict) -> str:
    meta = doc.get("metadata") or {}
    return f"{doc.get('kind', 'object')} {meta.get('namespace') or 'default'}/{meta.get('name')}"


def configmap_files(doc: dict) -> dict[str, bytes]:
    """data (UTF-8 text) and binaryData (base64) of a ConfigMap, one file per key."""
    what = _describe(doc)
    data, binary = doc.get("data") or {}, doc.get("binaryData") or {}
    if not isinstance(data, dict) or not isinstance(binary, dict):
        raise DiskkitError(what, "data and binaryData must be mappings")
    files: dict[str, bytes] = {}
    for key, value in data.items():
        _check_key(str(key), f"{what} data")
        files[str(key)] = str(value).encode()
    for key, value in binary.items():
        _check_key(str(key), f"{what} binaryData")
        if key in files:
            raise DiskkitError(what, f"key {key} is in both data and binaryData")
        files[str(key)] = _b64(value, f"{what} binaryData.{key}")
    return files


def secret_files(doc: dict) -> dict[str, bytes]:
    """data (base64) with stringData over it, as the API server merges them, one file per key."""
    what = _describe(doc)
    data, plain = doc.get("data") or {}, doc.get("stringData") or {}
    if not isinstance(data, dict) or not isinstance(plain, dict):
        raise DiskkitError(what, "data and stringData must be mappings")
    files = {}
    for key, value in data.items():
        _check_key(str(key), f"{what} data")
        files[str(key)] = _b64(value, f"{what} data.{key}")
    for key, value in plain.items():
        _check_key(str(key), f"{what} stringData")
        files[str(key)] = str(value).encode()
    return files


def sysprep_problem(files: dict[str, bytes]) -> str | None:
    """validateUnattendPresence, in its words."""
    if any(name.lower() in ANSWER_FILES for name in files):
        return None
    return f"Sysprep drive should contain {ANSWER_FILES[0]} or {ANSWER_FILES[1]} but neither were found."


def _b64(value, where: str) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except binascii.Error:
        raise DiskkitError(where, "is not valid base64") from None


def service_account_token_secret(secrets: Iterable[dict], account: str) -> dict | None:
    """The token Secret of a ServiceAccount: type kubernetes.io/service-account-token, annotated
    with the account's name (what the token controller made, or `kubectl create token` users add)."""
    for doc in sorted(secrets, key=lambda d: str((d.get("metadata") or {}).get("name"))):
        annotations = (doc.get("metadata") or {}).get("annotations") or {}
        if doc.get("type") == SERVICE_ACCOUNT_TOKEN_TYPE and annotations.get(SERVICE_ACCOUNT_NAME_ANNOTATION) == account:
            return doc
    return None


def service_account_files(doc: dict, namespace: str) -> dict[str, bytes]:
    """ca.crt, namespace and token, the files of /var/run/secrets/kubernetes.io/serviceaccount."""
    data = secret_files(doc)
    if not data.get("token"):
        raise DiskkitError(_describe(doc), "has no token (data.token)")
    files = {"namespace": data.get("namespace") or namespace.encode(), "token": data["token"]}
    if "ca.crt" in data:
        files["ca.crt"] = data["ca.crt"]
    return files


# ---------------------------------------------------------------- downward API

def go_quote(text: str) -> str:
    """strconv.Quote: how the kubelet writes label and annotation values (fmt %q)."""
    out = ['"']
    named = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v",
             "\\": "\\\\", '"': '\\"'}
    for char in text:
        code = ord(char)
        if char in named:
            out.append(named[char])
        elif char.isprintable():  # Python and Go agree: letters, marks, numbers, punctuation, symbols, ASCII space
            out.append(char)
        elif code < 0x80:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def format_map(values: dict) -> str:
    """k8s.io/kubernetes pkg/fieldpath FormatMap: sorted `key="value"` lines, no final newline."""
    return "\n".join(f"{key}={go_quote(str(values[key]))}" for key in sorted(values))


_SUBSCRIPT = re.compile(r"metadata\.(labels|annotations)\['([^']*)'\]")


def field_value(vmi: VMI, field_path: str) -> str:
    """fieldpath.ExtractFieldPathAsString over the VMI's own metadata."""
    match = _SUBSCRIPT.fullmatch(field_path)
    if match:
        values = vmi.labels if match[1] == "labels" else vmi.annotations
        return str(values.get(match[2], ""))
    simple = {
        "metadata.name": lambda: vmi.name,
        "metadata.namespace": lambda: vmi.namespace,
        "metadata.uid": lambda: vmi.uid or "",
        "metadata.labels": lambda: format_map(vmi.labels),
        "metadata.annotations": lambda: format_map(vmi.annotations),
    }
    if field_path not in simple:
        raise DiskkitError(field_path, "is not a field the downward API can expose in a volume")
    return simple[field_path]()


def downward_api_files(vmi: VMI, fields: Iterable[DownwardAPIFile]) -> tuple[dict[str, bytes], dict[str, int]]:
    """(files, modes): one file per field, at its path (subdirectories allowed); mode 0644 unless given."""
    files, modes = {}, {}
    for item in fields:
        files[item.path] = field_value(vmi, item.field_path).encode()
        if item.mode is not None:
            modes[item.path] = item.mode
    return files, modes
