"""GPUs, host devices and resource claims: admitted as KubeVirt admits them, then refused as a node
without them refuses them (pure).

A GPU or host device reaches a KubeVirt VM from a device plugin (a PCI device, a mediated device, a
USB device the node's admin listed in the KubeVirt CR's permittedHostDevices) or from a DRA resource
claim. This node has neither: no device plugin, no DRA driver, no device passed through, so its
permittedHostDevices is empty. What a cluster does with such a VM, in its words:
- pkg/dra/admitter/dra_admitter.go (virt-api): resourceClaims, and GPUs and host devices that name a
  claim, which need the GPUsWithDRA / HostDevicesWithDRA gates (off by default, as here);
- vmi-create-admitter.go validateMDEVRamFB and validateHostDevicesWithPassthroughEnabled: at most one
  vGPU display with a boot framebuffer; host devices behind the HostDevices gate (off by default, and
  with nothing to pass through here no way to turn it on);
- pkg/virt-controller/services/renderresources.go validatePermittedHostDevices (virt-controller,
  when it renders the VM's pod): a device plugin's GPU not in permittedHostDevices.
"""

from __future__ import annotations

from launcher.spec.fields import SpecError, as_list, as_map, dns_label_problems, dns_subdomain_problems, get_bool, get_str

GPUS, HOST_DEVICES = "gpus", "hostDevices"
_TYPE_NAMES = {GPUS: "GPU", HOST_DEVICES: "HostDevice"}


def _devices(spec: dict, root: str, key: str) -> list[dict]:
    at = f"{root}.domain.devices.{key}"
    devices = as_map(as_map(spec.get("domain"), f"{root}.domain").get("devices"), f"{root}.domain.devices")
    items = [as_map(item, f"{at}[{i}]") for i, item in enumerate(as_list(devices.get(key), at))]
    for i, item in enumerate(items):
        for field in ("name", "deviceName", "claimName", "requestName", "tag"):
            get_str(item, field, f"{at}[{i}]")
    return items


def _is_dra(item: dict) -> bool:
    # The claim request is an inline pointer: any of its keys present allocates it (encoding/json).
    return not item.get("deviceName") and _claim_request(item)


def _claim_request(item: dict) -> bool:
    return item.get("claimName") is not None or item.get("requestName") is not None


def _resource_claims(spec: dict, root: str) -> None:
    """validateResourceClaims: the names, each a DNS label, unique, with one claim or template name."""
    at = f"{root}.resourceClaims"
    names: set[str] = set()
    for i, item in enumerate(as_list(spec.get("resourceClaims"), at)):
        cat = f"{at}[{i}]"
        claim = as_map(item, cat)
        name = get_str(claim, "name", cat)
        if not name:
            raise SpecError(f"{cat}.name", f"{cat}.name is a required field")
        if name in names:
            raise SpecError(f"{cat}.name", f'duplicate resourceClaims name "{name}"')
        problems = dns_label_problems(name)
        if problems:
            raise SpecError(f"{cat}.name", f"{cat}.name does not conform to the kubernetes DNS_LABEL rules: {', '.join(problems)}")
        names.add(name)
        given = [key for key in ("resourceClaimName", "resourceClaimTemplateName") if get_str(claim, key, cat) is not None]
        if len(given) == 2:
            raise SpecError(cat, "at most one of resourceClaimName or resourceClaimTemplateName may be specified")
        if not given:
            raise SpecError(cat, "must specify one of: resourceClaimName, resourceClaimTemplateName")
        for problem in dns_subdomain_problems(claim[given[0]]):
            raise SpecError(f"{cat}.{given[0]}", problem)


def _dra(items: list[dict], root: str, key: str) -> None:
    """validateDRADevices with the DRA gates off: a claim request refused, a device without either refused."""
    at, kind = f"{root}.domain.devices.{key}", _TYPE_NAMES[key]
    dra = [item for item in items if _is_dra(item)]
    if key == GPUS and dra and len(dra) < len(items):
        raise SpecError(at, f"vmi.spec.domain.devices.{key} contains both DRA and non-DRA {kind}s; each {kind} must be either DRA or non-DRA")
    for item in items:
        if _is_dra(item):
            continue
        if not item.get("deviceName"):
            raise SpecError(at, f"vmi.spec.domain.devices.{key} contains {kind}s without deviceName or claimRequest;"
                                f" each {kind} must specify either a deviceName or a claimRequest")
        if _claim_request(item):
            raise SpecError(at, f"vmi.spec.domain.devices.{key} contains {kind}s with both deviceName and claimRequest")
    if dra:
        raise SpecError(at, f"vmi.spec.domain.devices.{key} contains DRA enabled {kind}s but feature gate is not enabled")


def _ramfb_displays(gpus: list[dict], root: str) -> int:
    """vGPU displays with a boot framebuffer: a display is on unless disabled, its ramFB too."""
    count = 0
    for i, gpu in enumerate(gpus):
        gat = f"{root}.domain.devices.gpus[{i}].virtualGPUOptions"
        options = as_map(gpu.get("virtualGPUOptions"), gat)
        if options.get("display") is None:
            continue
        display = as_map(options["display"], f"{gat}.display")
        ramfb = display.get("ramFB")
        if get_bool(display, "enabled", f"{gat}.display", default=True) and (
                ramfb is None or get_bool(as_map(ramfb, f"{gat}.display.ramFB"), "enabled", f"{gat}.display.ramFB", default=True)):
            count += 1
    return count


def admit(spec: dict, root: str) -> None:
    """Refuse the VMI spec at `root` (spec, or spec.template.spec) if it asks for a GPU, a host device or
    a DRA device: this node has none to give. Resource claims no device uses change nothing the guest
    sees and are accepted once valid."""
    _resource_claims(spec, root)
    gpus, host_devices = _devices(spec, root, GPUS), _devices(spec, root, HOST_DEVICES)
    _dra(gpus, root, GPUS)
    _dra(host_devices, root, HOST_DEVICES)  # with the gates off, before the claims they name are looked up
    if _ramfb_displays(gpus, root) > 1:
        raise SpecError(f"{root}.GPUs", "configuring multiple displays with ramfb is not valid")  # its field path, sic
    devices = as_map(as_map(spec.get("domain"), f"{root}.domain").get("devices"), f"{root}.domain.devices")
    if devices.get(HOST_DEVICES) is not None:  # a Go slice decoded from [] is not nil either
        raise SpecError(f"{root}.HostDevices", "Host Devices feature gate is not enabled in kubevirt-config")  # sic
    if gpus:
        # The node permits no device: every GPU fails, in one message as virt-controller joins them.
        refused = " ".join(f"GPU {gpu['deviceName']} is not permitted in permittedHostDevices configuration" for gpu in gpus)
        raise SpecError(f"{root}.domain.devices.gpus[0].deviceName", refused)
