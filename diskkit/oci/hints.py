"""Instance type and preference hints an image carries, as KubeVirt, CDI and kubevirt/containerdisks name them.

An image says which instance type and preference suit it in two ways, and `diskkit build` writes both:
- config labels named as KubeVirt's api/instancetype/register.go names the labels inference reads
  (instancetype.kubevirt.io/default-instancetype, ...-kind, default-preference, ...-kind);
- config ENV, as kubevirt/containerdisks (pkg/common/common.go: INSTANCETYPE_KUBEVIRT_IO_DEFAULT_INSTANCETYPE,
  ..._PREFERENCE) writes them and CDI's importer turns them into the claim's labels
  (containerized-data-importer pkg/importer/util.go envsToLabels: a variable holding KUBEVIRT_IO_ becomes
  a label, the part before it dotted, the part after it dashed, all lower-cased).

Pure: parsing and naming only.
"""

from __future__ import annotations

from diskkit.errors import DiskkitError

INSTANCETYPE_LABEL = "instancetype.kubevirt.io/default-instancetype"
INSTANCETYPE_KIND_LABEL = "instancetype.kubevirt.io/default-instancetype-kind"
PREFERENCE_LABEL = "instancetype.kubevirt.io/default-preference"
PREFERENCE_KIND_LABEL = "instancetype.kubevirt.io/default-preference-kind"

LABELS = {"instancetype": (INSTANCETYPE_LABEL, INSTANCETYPE_KIND_LABEL), "preference": (PREFERENCE_LABEL, PREFERENCE_KIND_LABEL)}

# The kinds a matcher may name (KubeVirt's pkg/instancetype/find: lower-cased, singular or plural).
KINDS = {
    "instancetype": ("VirtualMachineInstancetype", "VirtualMachineClusterInstancetype"),
    "preference": ("VirtualMachinePreference", "VirtualMachineClusterPreference"),
}

_ENV_MARK = "KUBEVIRT_IO_"
_LABEL_MARK = "kubevirt.io/"


def env_name(label: str) -> str:
    """The ENV variable CDI turns into `label` (the inverse of env_label for the hint labels)."""
    before, _, after = label.partition(_LABEL_MARK)
    return (before.removesuffix(".").replace(".", "_") + "_" + _ENV_MARK + after.replace("-", "_")).upper()


def env_label(name: str) -> str | None:
    """CDI's envToLabel: the label a config ENV variable becomes, or None for one without KUBEVIRT_IO_."""
    if _ENV_MARK not in name:
        return None
    before, _, after = name.partition(_ENV_MARK)
    before = before.removesuffix("_")
    head = ".".join(before.split("_")) + "." if before else ""
    return (head + _LABEL_MARK + "-".join(after.split("_"))).lower()


def hint_pairs(what: str, value: str, flag: str) -> dict[str, str]:
    """`NAME[:KIND]` as label -> value pairs (the ENV pairs are their env_name)."""
    name, sep, kind = value.partition(":")
    if not name or (sep and not kind):
        raise DiskkitError(f"{flag} {value}", "must be NAME or NAME:KIND")
    # A matcher's name is an object name: a DNS subdomain (no '/', no ':').
    if "/" in name or len(name) > 253:
        raise DiskkitError(f"{flag} {value}", "NAME must be an object name (a DNS subdomain)")
    name_label, kind_label = LABELS[what]
    out = {name_label: name}
    if sep:
        allowed = KINDS[what]
        canonical = {k.lower(): k for k in allowed} | {k.lower() + "s": k for k in allowed}
        if kind.lower() not in canonical:
            raise DiskkitError(f"{flag} {value}", f"KIND must be {' or '.join(allowed)}")
        out[kind_label] = canonical[kind.lower()]
    return out


def from_config(config: dict) -> dict[str, str]:
    """The hint labels an image config carries: its labels, and its ENV read as CDI reads it (ENV wins,
    as it is what CDI puts on a claim imported from the image)."""
    inner = config.get("config") if isinstance(config.get("config"), dict) else {}
    labels = inner.get("Labels") if isinstance(inner.get("Labels"), dict) else {}
    out = {k: str(v) for k, v in labels.items() if k in (INSTANCETYPE_LABEL, INSTANCETYPE_KIND_LABEL, PREFERENCE_LABEL, PREFERENCE_KIND_LABEL)}
    for entry in inner.get("Env") or []:
        if not isinstance(entry, str):
            continue
        key, sep, value = entry.partition("=")
        label = env_label(key) if sep else None
        if label in (INSTANCETYPE_LABEL, INSTANCETYPE_KIND_LABEL, PREFERENCE_LABEL, PREFERENCE_KIND_LABEL):
            out[label] = value
    return out
