"""examples/kubernetes: every document valid against Kubernetes' own schemas (strict: unknown fields
are errors), the pod non-root as KubeVirt's qemu user, and the VMI, pod and PVC wired together."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "kubernetes"
K8S_VERSION = "1.37"  # the newest schema set kubernetes-validate 1.37 bundles
VMI_DISKS = "/var/run/kubevirt-private/vmi-disks"

DOCS = [(f"{path.name}#{i}", doc) for path in sorted(EXAMPLES.glob("*.yaml"))
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())) if doc is not None]


# Another way to run the same VM: its documents are checked by their own tests.
VARIANTS = ("pod-imagevolume.yaml#",)
IMAGE_VOLUMES = "/var/run/kubevirt-image-volume"  # pkg/util/util.go VirtImageVolumeDir


def the(kind: str, variant: str | None = None) -> dict:
    (doc,) = [doc for name, doc in DOCS if doc["kind"] == kind and (name.startswith(variant) if variant else not name.startswith(VARIANTS))]
    return doc


def test_examples_exist():
    assert {doc["kind"] for _, doc in DOCS} == {"Pod", "ConfigMap", "PersistentVolumeClaim", "Secret"}


@pytest.mark.parametrize("doc", [doc for _, doc in DOCS], ids=[name for name, _ in DOCS])
def test_document_is_valid_kubernetes(doc):
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


@pytest.mark.parametrize("breakage", ["unknown field", "wrong type", "missing required"])
def test_validator_rejects_broken_pod(breakage):
    pod = copy.deepcopy(the("Pod"))
    container = pod["spec"]["containers"][0]
    if breakage == "unknown field":
        container["securityContex"] = container.pop("securityContext")
    elif breakage == "wrong type":
        pod["spec"]["securityContext"]["runAsUser"] = "107"
    else:
        del container["name"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def pod_problems(pod: dict, command: tuple[str, ...] = ()) -> list[str]:
    """What keeps the pod from running the launcher non-root as 107 with the agreed layout (`command`:
    what follows the agreed one)."""
    problems = []
    spec = pod["spec"]
    sc = spec.get("securityContext", {})
    for key, want in (("runAsNonRoot", True), ("runAsUser", 107), ("runAsGroup", 107), ("fsGroup", 107)):
        if sc.get(key) != want:
            problems.append(f"pod securityContext.{key} is {sc.get(key)!r}, not {want!r}")
    mounts_by_volume = {}
    for c in spec["containers"]:
        csc = c.get("securityContext", {})
        # A container may not override the pod's identity with a different one.
        for key in ("runAsUser", "runAsGroup"):
            if key in csc and csc[key] != 107:
                problems.append(f"{c['name']}: {key} {csc[key]}")
        if csc.get("runAsNonRoot") is False or csc.get("privileged"):
            problems.append(f"{c['name']}: may run as root or privileged")
        if csc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{c['name']}: allowPrivilegeEscalation not false")
        if csc.get("capabilities", {}).get("drop") != ["ALL"] or csc.get("capabilities", {}).get("add"):
            problems.append(f"{c['name']}: capabilities not exactly drop ALL")
        mounts_by_volume.update({m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])})

    (launcher,) = [c for c in spec["containers"] if c["name"] == "launcher"]
    words = launcher.get("command", [])
    if words[:4] != ["launcher", "run", "/etc/vmi/vmi.yaml", "--console"] or any(w not in words for w in command):
        problems.append(f"launcher command {launcher.get('command')}")
    limits = launcher.get("resources", {}).get("limits", {})
    if mebibytes(limits.get("memory", "0")) < 512:  # KubeVirt's 40M sidecar limit OOMs (#2603)
        problems.append(f"memory limit {limits.get('memory')} too small")
    if limits.get("devices.kubevirt.io/kvm") != "1":
        problems.append("no devices.kubevirt.io/kvm limit")
    env = {e["name"]: e.get("value") for e in launcher.get("env", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    cache = [name for name, path in mounts_by_volume.items() if path == "/var/lib/diskkit"]
    # The node cache is the node's (a hostPath), shared by the VM pods on it, as tests/test_pod.py plays it.
    if env.get("DISKKIT_CACHE") != "/var/lib/diskkit" or not cache or "hostPath" not in volumes[cache[0]]:
        problems.append("cache is not a hostPath at $DISKKIT_CACHE=/var/lib/diskkit")
    if not spec.get("imagePullSecrets"):
        problems.append("no imagePullSecrets")
    # The launcher is PID 1 and reaps (launcher.runtime.reaper); the pod is the VM (tests/test_pod.py plays it).
    if spec.get("shareProcessNamespace"):
        problems.append("shareProcessNamespace: the launcher reaps as PID 1 of its own namespace")
    if spec.get("restartPolicy") != "Never":
        problems.append("restartPolicy is not Never")
    if spec.get("terminationGracePeriodSeconds", 30) < 45:
        problems.append("terminationGracePeriodSeconds below the VMI's (30 s by default) plus KubeVirt's 15 s")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = launcher.get(probe, {}).get("exec", {}).get("command", [])
        if command[:2] != ["launcher", "status"]:
            problems.append(f"{probe} does not ask launcher status")
    return problems


def mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 ** 2, "k": 1e3 / 2 ** 20, "M": 1e6 / 2 ** 20, "G": 1e9 / 2 ** 20}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * factor
    return float(quantity) / 2 ** 20


def test_pod_runs_non_root_as_107():
    assert pod_problems(the("Pod")) == []


@pytest.mark.parametrize("path, value", [
    (("spec", "securityContext", "runAsUser"), 0),
    (("spec", "securityContext", "runAsNonRoot"), False),
    (("spec", "containers", 0, "securityContext", "capabilities", "drop"), ["NET_RAW"]),
    (("spec", "containers", 0, "securityContext", "allowPrivilegeEscalation"), True),
    (("spec", "containers", 0, "securityContext", "runAsUser"), 0),
    (("spec", "containers", 0, "resources", "limits", "memory"), "40M"),
    (("spec", "shareProcessNamespace"), True),
    (("spec", "restartPolicy"), "Always"),
    (("spec", "terminationGracePeriodSeconds"), 30),
    (("spec", "containers", 0, "livenessProbe", "exec", "command"), ["true"]),
])
def test_pod_check_catches_regressions(path, value):
    pod = copy.deepcopy(the("Pod"))
    node = pod
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert pod_problems(pod)


def vmi_problems(configmap: dict, pod: dict) -> list[str]:
    """The ConfigMap holds a VMI the pod mounts at /etc/vmi/vmi.yaml, and every PVC volume of the
    VMI is the pod's claim of the same name, mounted at KubeVirt's vmi-disks/<volume> path."""
    problems = []
    vmi = yaml.safe_load(configmap["data"]["vmi.yaml"])
    if (vmi.get("apiVersion"), vmi.get("kind")) != ("kubevirt.io/v1", "VirtualMachineInstance"):
        problems.append(f"ConfigMap holds {vmi.get('apiVersion')} {vmi.get('kind')}")
    spec = pod["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
    if volumes.get(mounts.get("/etc/vmi"), {}).get("configMap", {}).get("name") != configmap["metadata"]["name"]:
        problems.append("the ConfigMap is not mounted at /etc/vmi")
    disks = {d["name"] for d in vmi["spec"]["domain"]["devices"]["disks"]}
    claims = [(v["name"], v["persistentVolumeClaim"]["claimName"]) for v in vmi["spec"]["volumes"] if "persistentVolumeClaim" in v]
    if not claims:
        problems.append("the VMI has no persistentVolumeClaim volume")
    for name, claim in claims:
        mounted = volumes.get(mounts.get(f"{VMI_DISKS}/{name}"), {})
        if mounted.get("persistentVolumeClaim", {}).get("claimName") != claim:
            problems.append(f"claim {claim} is not mounted at {VMI_DISKS}/{name}")
        if name not in disks:
            problems.append(f"volume {name} has no disk")
        # The claim's size, for the disk.img the launcher creates in an empty claim (KubeVirt reads it
        # from the claim: pkg/host-disk/host-disk.go replaceForHostDisk).
        (pvc_size,) = [c["--pvc"][1] for c in _flags(spec) if c.get("--pvc", ("",))[0] == claim] or [None]
        if pvc_size is None:
            problems.append(f"the launcher is not told claim {claim}'s size (--pvc {claim}={VMI_DISKS}/{name}:SIZE)")
    problems += network_problems(vmi, pod)
    return problems


def _flags(spec: dict) -> list[dict]:
    """The launcher command's --pvc CLAIM=DIR:SIZE and --publish-address values, one dict per flag."""
    (launcher,) = [c for c in spec["containers"] if c["name"] == "launcher"]
    command = launcher.get("command", [])
    found = []
    for flag, value in zip(command, command[1:]):
        if flag == "--pvc":
            claim, _, rest = value.partition("=")
            found.append({"--pvc": (claim, rest.rpartition(":")[2])})
        elif flag == "--publish-address":
            found.append({"--publish-address": value})
    return found


def network_problems(vmi: dict, pod: dict) -> list[str]:
    """The pod network, as KubeVirt's masquerade binding serves it: no host network, every port the
    VMI's interfaces declare is a container port of the same name and protocol, the launcher publishes
    them on the pod's addresses, and qemu (107, no capability) may listen on the ones below 1024."""
    problems = []
    spec = pod["spec"]
    if spec.get("hostNetwork"):
        problems.append("hostNetwork: the VM's ports belong on the pod network")
    declared = {(p.get("name"), p["port"], p.get("protocol", "TCP"))
                for i in vmi["spec"]["domain"]["devices"].get("interfaces", []) for p in i.get("ports", [])}
    if not declared:
        problems.append("the VMI's interfaces declare no ports")
    (launcher,) = [c for c in spec["containers"] if c["name"] == "launcher"]
    exposed = {(p.get("name"), p["containerPort"], p.get("protocol", "TCP")) for p in launcher.get("ports", [])}
    if declared != exposed:
        problems.append(f"container ports {sorted(exposed)} are not the VMI's {sorted(declared)}")
    if {"--publish-address": "0.0.0.0"} not in _flags(spec):
        problems.append("the launcher does not publish the ports on the pod's addresses (--publish-address 0.0.0.0)")
    sysctls = {s["name"]: s["value"] for s in spec.get("securityContext", {}).get("sysctls", [])}
    low = [port for _, port, _ in declared if port < 1024]
    if low and int(sysctls.get("net.ipv4.ip_unprivileged_port_start", 1024)) > min(low):
        problems.append(f"port {min(low)} is privileged in the pod: net.ipv4.ip_unprivileged_port_start is not lowered")
    return problems


def test_configmap_holds_the_vmi_and_the_pod_mounts_its_claim():
    assert vmi_problems(the("ConfigMap"), the("Pod")) == []
    pvc = the("PersistentVolumeClaim")
    assert pvc["metadata"]["name"] in the("ConfigMap")["data"]["vmi.yaml"]


@pytest.mark.parametrize("breakage", ["kind", "claim", "mount", "size", "hostNetwork", "port", "publish", "sysctl"])
def test_vmi_check_catches_regressions(breakage):
    configmap, pod = copy.deepcopy(the("ConfigMap")), copy.deepcopy(the("Pod"))
    (launcher,) = pod["spec"]["containers"]
    if breakage == "kind":
        configmap["data"]["vmi.yaml"] = configmap["data"]["vmi.yaml"].replace("kind: VirtualMachineInstance", "kind: VirtualMachine")
    elif breakage == "claim":
        configmap["data"]["vmi.yaml"] = configmap["data"]["vmi.yaml"].replace("claimName: testguest-data", "claimName: other")
    elif breakage == "mount":
        for mount in pod["spec"]["containers"][0]["volumeMounts"]:
            mount["mountPath"] = mount["mountPath"].replace("vmi-disks/data", "vmi-disks/root")
    elif breakage == "size":
        at = launcher["command"].index("--pvc")
        del launcher["command"][at:at + 2]
    elif breakage == "hostNetwork":
        pod["spec"]["hostNetwork"] = True
    elif breakage == "port":
        launcher["ports"][0]["containerPort"] = 8080
    elif breakage == "publish":
        at = launcher["command"].index("--publish-address")
        del launcher["command"][at:at + 2]
    else:
        del pod["spec"]["securityContext"]["sysctls"]
    assert vmi_problems(configmap, pod)


def image_volume_problems(configmap: dict, pod: dict) -> list[str]:
    """Each containerDisk of the VMI (spec.volumes[i]) is an image volume of the same image mounted
    read-only at KubeVirt's path for it, disk_<i> (pkg/virt-controller/services/rendervolumes.go
    addContainerDiskVolumeMount), where `launcher run --container-disk-dir` looks."""
    problems = []
    vmi = yaml.safe_load(configmap["data"]["vmi.yaml"])
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for c in pod["spec"]["containers"] for m in c.get("volumeMounts", [])}
    disks = [(i, v) for i, v in enumerate(vmi["spec"]["volumes"]) if "containerDisk" in v]
    if not disks:
        problems.append("the VMI has no containerDisk")
    for i, volume in disks:
        mount = mounts.get(f"{IMAGE_VOLUMES}/disk_{i}")
        if mount is None or not mount.get("readOnly"):
            problems.append(f"no read-only mount at {IMAGE_VOLUMES}/disk_{i}")
            continue
        image = volumes.get(mount["name"], {}).get("image", {})
        if image.get("reference") != volume["containerDisk"]["image"]:
            problems.append(f"{IMAGE_VOLUMES}/disk_{i} mounts {image.get('reference')!r}, not {volume['containerDisk']['image']!r}")
    return problems


def test_the_image_volume_pod_mounts_each_containerdisk_where_kubevirt_does():
    pod = the("Pod", "pod-imagevolume.yaml#")
    assert pod_problems(pod, ("--container-disk-dir", IMAGE_VOLUMES)) == []
    assert image_volume_problems(the("ConfigMap"), pod) == []
    assert vmi_problems(the("ConfigMap"), pod) == []


@pytest.mark.parametrize("breakage", ["index", "image", "writable"])
def test_image_volume_check_catches_regressions(breakage):
    pod = copy.deepcopy(the("Pod", "pod-imagevolume.yaml#"))
    (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"].startswith(IMAGE_VOLUMES)]
    if breakage == "index":
        mount["mountPath"] = f"{IMAGE_VOLUMES}/disk_1"
    elif breakage == "image":
        (volume,) = [v for v in pod["spec"]["volumes"] if "image" in v]
        volume["image"]["reference"] = "registry.example.com/disks/other:v1"
    else:
        mount["readOnly"] = False
    assert image_volume_problems(the("ConfigMap"), pod)
