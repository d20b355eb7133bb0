"""spec.domain.features.hyperv and hypervPassthrough (pure): parsed, defaulted and validated as KubeVirt does.

Defaulting is the API's (staging/src/kubevirt.io/api/core/v1/defaults.go: every enlightenment given
is enabled unless it says otherwise, spinlocks retry 4096 times) and then the mutating webhook's
(pkg/defaults/hyperv.go SetHypervFeatureDependencies: an enabled enlightenment turns on what it
requires when the user left that unset, and evmcs requires the vmx CPU feature); validation is
pkg/virt-api/webhooks/hyperv.go. What libvirt refuses of what KubeVirt passes on (a retry count
below 4095, a vendor id over 12 characters or none) is refused here in libvirt's words.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.spec.fields import SpecError, as_map, get_bool, get_int, get_str

# KubeVirt's fields, in the order its api.FeatureHyperv marshals them into <hyperv>
NAMES = ("relaxed", "vapic", "spinlocks", "vpindex", "runtime", "synic", "synictimer", "reset", "vendorid",
         "frequencies", "reenlightenment", "tlbflush", "ipi", "evmcs")
# pkg/defaults/hyperv.go getHypervFeatureDependencies, leaves first: each enables what it requires
REQUIRES = (("evmcs", "vapic"), ("ipi", "vpindex"), ("tlbflush", "vpindex"), ("synictimer", "synic"), ("synic", "vpindex"))
# libvirt's limits (src/conf/domain_conf.c), which KubeVirt leaves to it
MIN_RETRIES = 4095
MAX_VENDOR_ID = 12
UINT32_MAX = 2**32 - 1
PASSTHROUGH_AND_CUSTOM = ("Cannot explicitly set hyperV features if HypervPassthrough is being used."
                          " Please use either HyperV or HypervPassthrough.")


@dataclass(frozen=True)
class Enlightenment:
    name: str  # KubeVirt's field, one of NAMES
    enabled: bool
    retries: int | None = None  # spinlocks
    vendor_id: str | None = None  # vendorid
    direct: bool | None = None  # synictimer: None when not given


@dataclass(frozen=True)
class Hyperv:
    """The enlightenments given (or turned on as requirements), in NAMES' order."""

    enlightenments: tuple[Enlightenment, ...] = ()

    def get(self, name: str) -> Enlightenment | None:
        return next((e for e in self.enlightenments if e.name == name), None)

    @property
    def enabled(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.enlightenments if e.enabled)


def _sub_state(doc: dict, key: str, at: str) -> bool | None:
    if doc.get(key) is None:
        return None
    return get_bool(as_map(doc[key], f"{at}.{key}"), "enabled", f"{at}.{key}", default=True)


def _enlightenment(name: str, doc: dict, at: str) -> Enlightenment:
    enabled = get_bool(doc, "enabled", at, default=True)
    if name == "spinlocks":
        retries = get_int(doc, "spinlocks", at)
        if retries is not None and retries > UINT32_MAX:
            raise SpecError(f"{at}.spinlocks", f"must be at most {UINT32_MAX} (an unsigned 32-bit count)")
        if enabled and retries is None:
            retries = 4096  # api SetDefaults_FeatureSpinlocks
        if enabled and retries < MIN_RETRIES:
            raise SpecError(f"{at}.spinlocks", f"HyperV spinlock retry count must be at least {MIN_RETRIES}")
        return Enlightenment(name, enabled, retries=retries)
    if name == "vendorid":
        vendor = get_str(doc, "vendorid", at)
        if enabled and vendor is None:
            raise SpecError(f"{at}.vendorid", "missing 'value' attribute for HyperV feature 'vendor_id'")
        if vendor is not None and len(vendor) > MAX_VENDOR_ID:
            raise SpecError(f"{at}.vendorid", f"HyperV vendor_id value must not be more than {MAX_VENDOR_ID} characters.")
        return Enlightenment(name, enabled, vendor_id=vendor)
    if name == "synictimer":
        return Enlightenment(name, enabled, direct=_sub_state(doc, "direct", at))
    return Enlightenment(name, enabled)


def parse_hyperv(doc: dict, at: str) -> Hyperv:
    """features.hyperv at `at`, with the requirements KubeVirt's webhook turns on; a requirement the user
    turned off is refused in the validating webhook's words."""
    given = {}
    for name in NAMES:
        if doc.get(name) is not None:
            given[name] = _enlightenment(name, as_map(doc[name], f"{at}.{name}"), f"{at}.{name}")
    for name, required in REQUIRES:
        feature = given.get(name)
        if feature is None or not feature.enabled:
            continue
        needed = given.get(required)
        if needed is None:
            given[required] = Enlightenment(required, True)
        elif not needed.enabled:
            # webhooks.ValidateVirtualMachineInstanceHypervFeatureDependencies (KubeVirt's own field path
            # repeats the prefix, domain.features.hyperv twice; the words are the same)
            raise SpecError(f"{at}.{name}", f"'{at}.{name}' requires '{at}.{required}', which was disabled.")
    return Hyperv(tuple(given[name] for name in NAMES if name in given))


def parse_passthrough(doc: dict, at: str) -> bool:
    """hypervPassthrough: KubeVirt's converter reads its `enabled` without a default (a nil pointer there
    stops virt-launcher), so it must be given."""
    enabled = get_bool(doc, "enabled", at, default=None)
    if enabled is None:
        raise SpecError(f"{at}.enabled", "required: KubeVirt's converter reads it without a default")
    return enabled


def with_evmcs_cpu_feature(hyperv: Hyperv | None, features: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """pkg/defaults/hyperv.go setEVMCSDependency: an enabled evmcs needs the vmx CPU feature, required."""
    evmcs = hyperv.get("evmcs") if hyperv is not None else None
    if evmcs is None or not evmcs.enabled:
        return features
    if any(name == "vmx" for name, _ in features):
        return tuple((name, "require" if name == "vmx" else policy) for name, policy in features)
    return (*features, ("vmx", "require"))

