"""CDI DataVolumes: the spec parsed and validated as CDI's admission webhook does, and the phase
rules (pure).

A DataVolume comes from a VM's (or, as an extension, a VMI's) `spec.dataVolumeTemplates`, or from a
`cdi.kubevirt.io/v1beta1` manifest given with `--manifests`. It fills the claim of the same name.
Messages are CDI's where it has one (pkg/apiserver/webhooks/datavolume-validate.go).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from diskkit.errors import DiskkitError
from launcher.spec.fields import SpecError, as_map, get_str, parse_quantity
from launcher.spec.meta import (
    check_annotations,
    check_labels,
    check_namespace,
    check_subdomain,
)

API_VERSION = "cdi.kubevirt.io/v1beta1"
KIND = "DataVolume"
DEFAULT_NAMESPACE = "default"

# status.phase values (CDI's DataVolumePhase), in the order a DataVolume goes through them.
PENDING = "Pending"
WAIT_FOR_FIRST_CONSUMER = "WaitForFirstConsumer"
IMPORT_SCHEDULED = "ImportScheduled"
IMPORT_IN_PROGRESS = "ImportInProgress"
CLONE_SCHEDULED = "CloneScheduled"
CLONE_IN_PROGRESS = "CloneInProgress"
UPLOAD_SCHEDULED = "UploadScheduled"
UPLOAD_READY = "UploadReady"
SUCCEEDED = "Succeeded"
FAILED = "Failed"

SOURCES = ("http", "registry", "blank", "upload", "pvc")
# Valid in CDI, not here: named so they are refused rather than ignored.
UNSUPPORTED_SOURCES = ("s3", "gcs", "imageio", "vddk", "snapshot")
PULL_METHODS = ("pod", "node")
ACCESS_MODES = ("ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod")


@dataclass(frozen=True)
class Source:
    kind: str  # one of SOURCES
    url: str | None = None  # http, registry
    secret_ref: str | None = None  # http: basic auth; registry: registry credentials (accessKeyId, secretKey)
    cert_config_map: str | None = None  # a ConfigMap whose values are PEM CA certificates
    claim: str | None = None  # pvc: the claim to clone
    claim_namespace: str | None = None


@dataclass(frozen=True)
class DataVolume:
    name: str
    namespace: str
    source: Source
    size: int | None  # bytes, resources.requests.storage of spec.storage or spec.pvc
    storage_class: str | None
    volume_mode: str | None
    origin: str  # where it was defined, for error messages
    content_type: str = "kubevirt"  # "archive": a tar whose files fill the claim's filesystem (no disk.img)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def scheduled_phase(self) -> str:
        """The phase once its claim is bound and the work can start."""
        return {"upload": UPLOAD_SCHEDULED, "pvc": CLONE_SCHEDULED}.get(self.source.kind, IMPORT_SCHEDULED)

    @property
    def running_phase(self) -> str:
        return {"upload": UPLOAD_READY, "pvc": CLONE_IN_PROGRESS}.get(self.source.kind, IMPORT_IN_PROGRESS)


def shown_url(url: str) -> str:
    """A source URL as it may be printed or recorded: without `user:pass@` or the query (where tokens
    tend to live). Every message, progress line and state file naming a DataVolume's URL uses this."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.split("?")[0].split("#")[0]
    end = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    path = rest[end:].split("?")[0].split("#")[0]
    return f"{scheme}://{rest[:end].rpartition('@')[2]}{path}"


def _http(doc: dict, at: str) -> Source:
    url = get_str(doc, "url", at, required=True)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SpecError(f"{at}.url", f"{shown_url(url)} is not an http:// or https:// URL")
    # CDI's DataVolumeSourceHTTP fields the importer does not implement, refused rather than ignored:
    # they change what is fetched or whether it is checked
    for key in ("extraHeaders", "secretExtraHeaders", "checksum", "insecureSkipVerify"):
        if doc.get(key):
            raise SpecError(f"{at}.{key}", "not supported by the launcher")
    return Source("http", url, get_str(doc, "secretRef", at), get_str(doc, "certConfigMap", at))


def _registry(doc: dict, at: str) -> Source:
    url, stream = get_str(doc, "url", at), doc.get("imageStream")
    if (url is None) == (stream is None):
        raise SpecError(at, "source registry should have either URL or ImageStream")
    method = get_str(doc, "pullMethod", at) or "pod"
    if method not in PULL_METHODS:
        raise SpecError(f"{at}.pullMethod", f'importMethod {method} is neither pod, node or ""')
    if stream is not None:
        raise SpecError(f"{at}.imageStream", "OpenShift image streams are not supported by the launcher")
    if method != "pod":
        # The node method asks the node's container runtime for the image; the launcher has none
        # and pulls in-process, which is what the pod method does.
        raise SpecError(f"{at}.pullMethod", "only pullMethod pod is supported by the launcher")
    scheme = urlsplit(url).scheme
    if scheme not in ("docker", "oci-archive"):
        raise SpecError(f"{at}.url", f"illegal registry source URL scheme {shown_url(url)}")
    return Source("registry", url, get_str(doc, "secretRef", at), get_str(doc, "certConfigMap", at))


def _pvc(doc: dict, at: str, namespace: str) -> Source:
    return Source("pvc", claim=get_str(doc, "name", at, required=True), claim_namespace=get_str(doc, "namespace", at) or namespace)


def _source(spec: dict, at: str, namespace: str, template: bool) -> Source:
    if spec.get("sourceRef") is not None:
        raise SpecError(f"{at}.sourceRef", "DataSource references are not supported by the launcher")
    if spec.get("source") is None:
        raise SpecError(f"{at}.source", "Data volume should have either Source, SourceRef, or be externally populated" if template
                        else "Data volume should have either Source or SourceRef, or be externally populated")
    source = as_map(spec.get("source"), f"{at}.source")
    kinds = [k for k in (*SOURCES, *UNSUPPORTED_SOURCES) if source.get(k) is not None]
    # data-volume-template.go validateNumberOfSources (KubeVirt) / webhooks/util.go (CDI)
    if not kinds:
        raise SpecError(f"{at}.source", "Missing dataVolume valid source" if template else "Missing Data volume source")
    if len(kinds) > 1:
        raise SpecError(f"{at}.source", "Multiple dataVolume sources" if template else "Multiple Data volume sources")
    kind = kinds[0]
    sat = f"{at}.source.{kind}"
    if kind in UNSUPPORTED_SOURCES:
        raise SpecError(sat, "this DataVolume source is not supported by the launcher")
    doc = as_map(source[kind], sat)
    if kind == "http":
        return _http(doc, sat)
    if kind == "registry":
        return _registry(doc, sat)
    if kind == "pvc":
        return _pvc(doc, sat, namespace)
    return Source(kind)


def _size(requests: dict, at: str, what: str) -> int | None:
    if requests.get("storage") is None:
        return None
    size = math.floor(parse_quantity(requests["storage"], f"{at}.storage"))
    if size <= 0:
        raise SpecError(f"{at}.storage", f"{what} size can't be equal or less than zero")
    if size < 2**20:  # datavolume-validate.go validateStorageSize: KubeVirt takes no disk under 1MiB
        raise SpecError(f"{at}.storage", f"{what} size should be at least 1MiB")
    return size


def parse_data_volume(doc: Any, at: str, default_namespace: str = DEFAULT_NAMESPACE, template: bool = False) -> DataVolume:
    """A DataVolume manifest, or (with `template`) one entry of dataVolumeTemplates; `at` is its field path."""
    doc = as_map(doc, at)
    if not template:
        if doc.get("kind") != KIND:
            raise SpecError(f"{at}.kind", f"must be {KIND}, not {doc.get('kind')!r}")
        if doc.get("apiVersion") != API_VERSION:
            raise SpecError(f"{at}.apiVersion", f"must be {API_VERSION}, not {doc.get('apiVersion')!r}")
    metadata = as_map(doc.get("metadata"), f"{at}.metadata")
    if template and not metadata.get("name"):  # KubeVirt's storage/admitters/data-volume-template.go
        raise SpecError(f"{at}.metadata.name", f"'name' field must not be empty for DataVolumeTemplate entry {at}.metadata.name.")
    name = get_str(metadata, "name", f"{at}.metadata", required=True)
    # The claim's directory and the state file beside it are named after it: nothing else may pass.
    check_subdomain(name, f"{at}.metadata.name")
    namespace = get_str(metadata, "namespace", f"{at}.metadata") or default_namespace
    if template and namespace != default_namespace:
        raise SpecError(at, f"Embedded DataVolume namespace {namespace} differs from VM namespace {default_namespace}")
    check_namespace(namespace, f"{at}.metadata.namespace")
    check_labels(metadata.get("labels"), f"{at}.metadata.labels")
    check_annotations(metadata.get("annotations"), f"{at}.metadata.annotations")
    sat = f"{at}.spec"
    spec = as_map(doc.get("spec"), sat)
    # The target before the source, in CDI's webhook and in KubeVirt's template admitter alike; their
    # words differ, so a template gets KubeVirt's.
    pvc, storage = spec.get("pvc"), spec.get("storage")
    if pvc is None and storage is None:
        raise SpecError(sat, "Missing Data volume PVC or Storage" if template else "Missing Data volume PVC")
    if pvc is not None and storage is not None:
        raise SpecError(sat, "Duplicate storage definition, both target storage and target pvc defined")
    source = _source(spec, sat, namespace, template)
    content_type = _content_type(spec.get("contentType"), source, sat)
    what, key = ("PVC", "pvc") if pvc is not None else ("Storage", "storage")
    target_at = f"{sat}.{key}"
    target = as_map(pvc if pvc is not None else storage, target_at)
    requests = as_map(as_map(target.get("resources"), f"{target_at}.resources").get("requests"), f"{target_at}.resources.requests")
    size = _size(requests, f"{target_at}.resources.requests", what)
    if size is None and pvc is not None:
        # spec.storage may leave it out (CDI then takes the clone source's size); spec.pvc may not.
        raise SpecError(f"{target_at}.resources.requests.storage", f"{what} size is missing")
    modes = target.get("accessModes") or []
    if not isinstance(modes, list):
        raise SpecError(f"{target_at}.accessModes", "must be a list")
    if pvc is not None and not modes:  # datavolume-validate.go: spec.pvc takes exactly one, spec.storage any
        raise SpecError(f"{target_at}.accessModes", "Required value: at least 1 access mode is required")
    if pvc is not None and len(modes) > 1:
        raise SpecError(f"{target_at}.accessModes", "PVC multiple accessModes")
    for mode in modes:
        if mode not in ACCESS_MODES:
            raise SpecError(f"{target_at}.accessModes", f'Unsupported value: "{mode}": supported values: '
                                                         + ", ".join(f'"{m}"' for m in sorted(ACCESS_MODES)))
    volume_mode = get_str(target, "volumeMode", target_at)
    if volume_mode not in (None, "Filesystem", "Block"):
        raise SpecError(f"{target_at}.volumeMode", f'Unsupported value: "{volume_mode}": supported values: "Block", "Filesystem"')
    if content_type == "archive" and volume_mode == "Block":
        raise SpecError(f"{target_at}.volumeMode", "contentType archive needs a Filesystem claim to unpack into")
    return DataVolume(name, namespace, source, size, get_str(target, "storageClassName", target_at), volume_mode, at,
                      content_type)


def _content_type(value: Any, source: Source, at: str) -> str:
    """CDI's webhook (pkg/apiserver/webhooks/util.go): kubevirt or archive; not archive for blank or registry."""
    if value in (None, ""):
        return "kubevirt"
    if value not in ("kubevirt", "archive"):
        raise SpecError(f"{at}.contentType", "ContentType not one of: kubevirt, archive")
    if value == "archive" and source.kind == "blank":
        raise SpecError(f"{at}.contentType", "SourceType cannot be blank and the contentType be archive")
    if value == "archive" and source.kind == "registry":
        raise SpecError(f"{at}.contentType", "ContentType must be kubevirt when Source is Registry")
    if value == "archive" and source.kind == "pvc":
        raise SpecError(f"{at}.contentType", "cloning an archive claim is not supported by the launcher")
    return value


def templates(items: Any, at: str, namespace: str) -> tuple[DataVolume, ...]:
    """dataVolumeTemplates of a VirtualMachine (or VMI): every entry parsed, names unique."""
    if items is None:
        return ()
    if not isinstance(items, list):
        raise SpecError(at, "must be a list")
    out, seen = [], {}
    for index, item in enumerate(items):
        dv = parse_data_volume(item, f"{at}[{index}]", namespace, template=True)
        if dv.name in seen:
            raise SpecError(f"{at}[{index}].metadata.name", f"{dv.name} is already the name of {at}[{seen[dv.name]}]")
        seen[dv.name] = index
        out.append(dv)
    return tuple(out)


def from_manifest(doc: dict, origin: str) -> DataVolume:
    try:
        return replace(parse_data_volume(doc, "DataVolume"), origin=origin)
    except SpecError as err:
        raise DiskkitError(origin, f"{err.subject}: {err.rule}") from None


# ---------------------------------------------------------------- phases

@dataclass(frozen=True)
class Status:
    """What the state file next to the claim's disk.img records (all optional until work starts)."""

    phase: str | None = None
    progress: str | None = None  # "45.67%", as CDI's status.progress
    message: str | None = None
    consumer: str | None = None  # the first VM that used the claim: binds it under WaitForFirstConsumer

    @classmethod
    def from_json(cls, obj: dict | None) -> Status:
        obj = obj or {}
        return cls(obj.get("phase"), obj.get("progress"), obj.get("message"), obj.get("consumer"))


def phase(dv: DataVolume, status: Status, wait_for_first_consumer: bool, worker_alive: bool = True) -> str:
    """The phase `launcher dv ls` shows: the recorded one, with what no state file can know laid over it.

    A claim under a WaitForFirstConsumer storage class stays unbound, and the DataVolume waits, until
    a VM starts with it. A recorded *InProgress or *Scheduled whose worker died is Pending again (CDI
    restarts the importer pod; here the next importer picks it up).
    """
    if status.phase in (SUCCEEDED, FAILED):
        return status.phase
    if wait_for_first_consumer and not status.consumer:
        return WAIT_FOR_FIRST_CONSUMER
    if status.phase in (IMPORT_IN_PROGRESS, CLONE_IN_PROGRESS) and not worker_alive:
        return PENDING
    if dv.source.kind == "upload":
        return status.phase if status.phase in (UPLOAD_SCHEDULED, UPLOAD_READY) else UPLOAD_SCHEDULED
    return status.phase or PENDING


def can_upload(current: str) -> str | None:
    """Why an upload is refused in this phase (virtctl's wording), or None when it may go ahead."""
    if current == WAIT_FOR_FIRST_CONSUMER:
        return f"cannot upload to DataVolume in state {current}"
    if current == SUCCEEDED:
        return "the DataVolume has already Succeeded; its claim holds the uploaded disk"
    if current != UPLOAD_READY:
        return f"the DataVolume is not ready for an upload (phase {current})"
    return None
