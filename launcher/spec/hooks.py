"""Hook sidecars (pure): KubeVirt's `hooks.kubevirt.io/hookSidecars` annotation, admitted as KubeVirt
admits it and read as its sidecar-shim runs it.

KubeVirt (pkg/hooks/hooks.go) reads the annotation as a JSON list of sidecars; each runs in a
container of the VM's pod beside virt-launcher. The one kind a node can run without a registry and a
container engine is the default image, KubeVirt's sidecar-shim (cmd/sidecars/sidecar_shim.go), with a
script from a ConfigMap mounted at `hookPath` (pkg/virt-controller/services/template.go, mode 0755):
the shim runs `onDefineDomain --vmi JSON --domain XML` and `preCloudInitIso --vmi JSON --cloud-init
JSON` when it finds them in its PATH, and hands their standard output back. Those are the hooks the
launcher runs (launcher.runtime.hooks); a sidecar image or command of the user's own is refused in one
line, as is anything the shim would never run, which KubeVirt drops unsaid.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

from launcher.spec.fields import SpecError, as_map, get_str
from launcher.spec.gates import SIDECAR, FeatureGates

ANNOTATION = "hooks.kubevirt.io/hookSidecars"
ON_DEFINE_DOMAIN, PRE_CLOUD_INIT_ISO = "onDefineDomain", "preCloudInitIso"
VERSIONS = ("v1alpha1", "v1alpha2", "v1alpha3")  # sidecar_shim.go parseCommandLineArgs
# Where the shim's exec.LookPath finds a script: the PATH of its image (a distroless base).
SHIM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
ANNOTATION_MAX = 256 << 10  # the API server's whole annotation budget is 256 KiB


@dataclass(frozen=True)
class Hook:
    """One script the sidecar-shim would run: its hook point, the shim's --version and where it comes from."""

    point: str  # ON_DEFINE_DOMAIN or PRE_CLOUD_INIT_ISO
    version: str
    config_map: str
    key: str
    where: str  # the annotation entry, for messages


def _at(vm: bool) -> str:
    return f"{'spec.template.' if vm else ''}metadata.annotations[{ANNOTATION}]"


def sidecars(annotations: dict, gates: FeatureGates, vm: bool = False) -> tuple[Hook, ...]:
    """The hooks the annotation asks for, admitted as KubeVirt admits them; () without the annotation."""
    raw = annotations.get(ANNOTATION)
    at = _at(vm)
    if raw is None or raw == "":
        return ()
    if not gates.on(SIDECAR):
        # vmi-create-admitter.go ValidateVirtualMachineInstanceMetadata
        raise SpecError(f"{'spec.template.' if vm else ''}metadata.annotations",
                        f"sidecar feature gate is not enabled in kubevirt-config, invalid entry {at}")
    if not isinstance(raw, str) or len(raw) > ANNOTATION_MAX:
        raise SpecError(at, "must be a JSON list of hook sidecars")
    try:
        entries = json.loads(raw)
    except ValueError as exc:
        raise SpecError(at, f"not a JSON list of hook sidecars: {exc}") from None
    if not isinstance(entries, list):
        raise SpecError(at, "not a JSON list of hook sidecars")
    hooks = []
    for i, entry in enumerate(entries):
        hook = _entry(as_map(entry, f"{at}[{i}]"), f"{at}[{i}]")
        if hook is not None:
            hooks.append(hook)
    # Each sidecar is a shim of its own, called in turn (pkg/hooks/manager.go): several scripts of one
    # hook point chain, each given the previous one's output.
    return tuple(hooks)


def _entry(doc: dict, at: str) -> Hook | None:
    for key in ("image", "command", "pvc"):
        if doc.get(key) not in (None, "", []):
            what = {"image": "a sidecar image other than KubeVirt's sidecar-shim",
                    "command": "a sidecar command other than the sidecar-shim's",
                    "pvc": "a hook sidecar's claim"}[key]
            raise SpecError(f"{at}.{key}", f"{what} is not supported by the launcher (it runs ConfigMap scripts as the sidecar-shim does)")
    args = doc.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise SpecError(f"{at}.args", "must be a list of strings")
    version = _version(args, f"{at}.args")
    config_map = doc.get("configMap")
    if config_map is None:
        return None  # a shim with no script answers no hook point
    cm = as_map(config_map, f"{at}.configMap")
    name = get_str(cm, "name", f"{at}.configMap", required=True)
    key = get_str(cm, "key", f"{at}.configMap", required=True)
    hook_path = get_str(cm, "hookPath", f"{at}.configMap", required=True)
    point = posixpath.basename(hook_path)
    if point not in (ON_DEFINE_DOMAIN, PRE_CLOUD_INIT_ISO) or posixpath.dirname(posixpath.normpath(hook_path)) not in SHIM_PATH:
        raise SpecError(f"{at}.configMap.hookPath", f"{hook_path}: the sidecar-shim runs only {ON_DEFINE_DOMAIN} and {PRE_CLOUD_INIT_ISO}"
                                                    f" from its PATH (/usr/bin/{ON_DEFINE_DOMAIN}, /usr/bin/{PRE_CLOUD_INIT_ISO}): this script would never run")
    if point == PRE_CLOUD_INIT_ISO and version == "v1alpha1":
        # v1alpha1's callbacks have no PreCloudInitIso: pkg/hooks/manager.go skips the hook unsaid
        raise SpecError(f"{at}.args", f"{PRE_CLOUD_INIT_ISO} needs --version v1alpha2 or v1alpha3: KubeVirt never calls it under v1alpha1")
    if point == PRE_CLOUD_INIT_ISO:
        # the cloud-init data it would change reaches the guest: never dropped unsaid
        raise SpecError(f"{at}.configMap.hookPath", f"{PRE_CLOUD_INIT_ISO} hooks are not supported by the launcher (it runs {ON_DEFINE_DOMAIN} hooks)")
    return Hook(point, version, name, key, at)


def _version(args: list[str], at: str) -> str:
    """The shim's own flag parsing (pflag): --version V or --version=V, the last one counts."""
    version = ""
    for i, arg in enumerate(args):
        if arg == "--version" and i + 1 < len(args):
            version = args[i + 1]
        elif arg.startswith("--version="):
            version = arg.split("=", 1)[1]
    supported = "[" + " ".join(VERSIONS) + "]"
    if not version:
        raise SpecError(at, f"Missing --version parameter. Supported options are {supported}.")
    if version not in VERSIONS:
        raise SpecError(at, f"Version {version} is not supported. Supported options are {supported}.")
    return version


def vmi_document(name: str, namespace: str, uid: str | None, labels: dict, annotations: dict, spec: dict) -> dict:
    """The VirtualMachineInstance KubeVirt hands a hook as --vmi (json.Marshal of the VMI)."""
    metadata = {"name": name, "namespace": namespace, **({"uid": uid} if uid else {}),
                **({"labels": labels} if labels else {}), **({"annotations": annotations} if annotations else {})}
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": metadata, "spec": spec}
