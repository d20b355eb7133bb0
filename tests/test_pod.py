"""The launcher as a pod, for real: its image built offline (images/launcher/build.sh), the example
manifests of examples/kubernetes played by podman, the test guest pulled from a registry on
loopback and booted under TCG, its console read with `podman logs`, the pod torn down with
`podman kube down` and nothing of it left running.

Both a containerDisk pulled whole and a lazy one (booted through the disk server `launcher run`
starts in the pod) are played.

The pod is on its own network, as in a cluster: podman's slirp4netns (`podman kube play --network
slirp4netns:...`), a user-mode stack that changes nothing on the host (no bridge, no firewall rule;
podman's default bridge network would add both). The guest's web page is fetched from the host
through the port the pod publishes, which reaches the guest as KubeVirt's masquerade does: the
launcher forwards the VMI's declared port from the pod's addresses into the guest.

What the test changes in the examples, and why: the containerDisk reference (the loopback
registry, plain HTTP, seen from the pod at slirp4netns's address for the host's loopback), the cache
hostPath (a directory of the test's own), the data disk's serial (`hold-N` keeps the test guest up
instead of powering off at once), the kvm device limit (no /dev/kvm in tests), and a hostPort on
127.0.0.1 for the guest's container port (podman 4.3's kube play has no --publish: a hostPort is how
it publishes a pod's port on the host).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_diskkit, run_launcher
from tests.leftovers import alive
from tests.podhost import Podman, image_tag, launcher_image, version
from tests.testguest import ensure_testguest, parse_console
from tests.vmhost import NOREG

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "kubernetes"
CONTAINER = "testguest-launcher"  # podman names a pod's container <pod>-<container>
READY = "DISKKIT-TESTGUEST v1 READY"
HOLD = 600
GRACE = 30  # the VMI's: KubeVirt's default terminationGracePeriodSeconds, as the example leaves it
# The pod's network: slirp4netns, which needs no bridge or firewall rule on the host. Its address for the
# host's loopback (.2, allow_host_loopback) reaches the test's registry; port_handler=slirp4netns
# publishes the pod's hostPorts through slirp4netns itself, with no helper process of podman's. Its
# subnet is not slirp4netns's default 10.0.2.0/24, which is also masquerade's vmNetworkCIDR: with both
# the same, a connection from the pod's gateway (10.0.2.2) would reach the guest from its own address.
POD_NETWORK = "slirp4netns:allow_host_loopback=true,port_handler=slirp4netns,cidr=10.0.3.0/24"
HOST_LOOPBACK_FROM_POD = "10.0.3.2"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def manifests(image: str, cache: Path, host_port: int) -> tuple[list[dict], dict]:
    """The example PVC, ConfigMap and Pod, pointed at the test's registry and cache, the guest's
    http port published on the host's 127.0.0.1:`host_port`."""
    (pvc,), (configmap,), (pod,) = docs("pvc.yaml"), docs("configmap.yaml"), copy.deepcopy(docs("pod.yaml"))
    vmi = yaml.safe_load(configmap["data"]["vmi.yaml"])
    (root,) = [v for v in vmi["spec"]["volumes"] if v["name"] == "root"]
    assert image.startswith("127.0.0.1:"), image
    root["containerDisk"]["image"] = HOST_LOOPBACK_FROM_POD + image.removeprefix("127.0.0.1")
    (data,) = [d for d in vmi["spec"]["domain"]["devices"]["disks"] if d["name"] == "data"]
    data["serial"] = f"hold-{HOLD}"
    configmap["data"]["vmi.yaml"] = yaml.safe_dump(vmi)
    (container,) = pod["spec"]["containers"]
    container["command"] = [*container["command"], NOREG]
    del container["resources"]["limits"]["devices.kubevirt.io/kvm"]
    (http,) = [p for p in container["ports"] if p["name"] == "http"]
    http.update(hostPort=host_port, hostIP="127.0.0.1")
    (cache_volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "cache"]
    cache_volume["hostPath"]["path"] = str(cache)
    return [pvc, configmap, *podman_secrets(pod), pod], pod


def podman_secrets(pod: dict) -> list[dict]:
    """podman 4.3 cannot mount Secrets (kube play crashes on a secret volume, and refuses a missing
    optional one): each becomes a ConfigMap of the same data, mounted at the same place."""
    secrets_by_name = {d["metadata"]["name"]: d for d in docs("secret.yaml")}
    configmaps = []
    for volume in pod["spec"]["volumes"]:
        if "secret" not in volume:
            continue
        source = volume.pop("secret")
        name = source.pop("secretName")
        volume["configMap"] = {"name": name, **source}
        if name in secrets_by_name:
            secret = secrets_by_name[name]
            data = dict(secret.get("stringData", {}))
            data.update({k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()})
            configmaps.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data})
    return configmaps


def pid_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def processes_in(namespace: str) -> dict[int, tuple[str, str]]:
    """Every host process in a PID namespace: pid -> (state, command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "pid") != namespace:
                continue
            state = (entry / "stat").read_text().rsplit(") ", 1)[1].split()[0]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # gone meanwhile, or not ours to read (the host's own init)
        found[int(entry.name)] = (state, cmdline)
    return found


def podman_exit_code_was_clean(podman: Podman, events: Path) -> bool:
    """The launcher container ended by itself (130: interrupted, its cleanup done), not by SIGKILL (137)."""
    codes = [json.loads(line).get("ContainerExitCode") for line in events.read_text().splitlines()
             if f'"Name":"{CONTAINER}"' in line and '"Status":"died"' in line]
    assert codes and codes[-1] == 130, codes
    return True


def wait_for_logs(podman: Podman, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    logs = ""
    while time.monotonic() < deadline:
        logs = podman("logs", CONTAINER, check=False).stdout
        if text in logs:
            return logs
        state = podman.out("inspect", "--format", "{{.State.Status}}", CONTAINER)
        assert state == "running", f"the launcher container is {state}:\n{logs}\n{podman('logs', CONTAINER, check=False).stderr}"
        time.sleep(1)
    raise AssertionError(f"{text!r} not in the pod's logs after {timeout:g} s:\n{logs}")


@pytest.fixture(params=["full", "lazy"])
def pod_image(request, registry) -> str:
    """The test guest as a containerDisk: pulled whole before the boot, or lazy (`diskkit build
    --lazy`), which `launcher run` boots through a disk server it starts in the pod."""
    ref = f"{registry.host}/pod/guest-{request.param}:v1"
    lazy = ["--lazy"] if request.param == "lazy" else ["--no-lazy"]
    result = run_diskkit("build", NOREG, *lazy, ensure_testguest() / "testguest.qcow2", "-t", ref)
    assert result.code == 0, result.err
    return ref


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slirp4netns_pids() -> set[int]:
    return {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _comm(p) == "slirp4netns"}


def _comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text().strip()
    except OSError:
        return ""


def fetch_page(port: int, timeout: float) -> str:
    """The guest's web page through the pod's published port (slirp4netns -> the pod's IP -> qemu's
    forward -> the guest); the first tries may meet a forward still being set up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as response:
                return response.read().decode()
        except OSError as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"the guest's page did not come through 127.0.0.1:{port}: {exc}") from None
            time.sleep(2)


@pytest.fixture
def podman(tmp_path) -> Podman:
    # podman 4.3's kube play ignores a pod's securityContext.sysctls: the same ones as the containers'
    # defaults (a pod's containers share its network namespace, where these apply).
    (pod,) = docs("pod.yaml")
    sysctls = {s["name"]: s["value"] for s in pod["spec"]["securityContext"].get("sysctls", [])}
    engine = Podman(tmp_path / "podman", sysctls=sysctls)
    yield engine
    # A copy of the image per test (vfs): give the disk back now, not when pytest prunes old runs.
    engine("rm", "--all", "--force", check=False)
    shutil.rmtree(engine.root / "storage", ignore_errors=True)
    engine.close()


# The launcher image is rebuilt (minutes) whenever its inputs changed, then a TCG boot in a pod and the
# vfs storage's removal: more than the suite's 600 s on a busy machine.
@pytest.mark.timeout(1800)
def test_the_example_pod_boots_the_guest_reads_its_claim_and_leaves_nothing(tmp_path, podman, pod_image):
    guest_image = pod_image
    archive = launcher_image()
    podman("load", "--quiet", "-i", archive)
    host_port = free_port()
    documents, pod = manifests(guest_image, tmp_path / "node-cache", host_port)
    podman("tag", image_tag(), pod["spec"]["containers"][0]["image"])

    # The node's cache belongs to 107 (fsGroup does not reach a hostPath).
    cache = tmp_path / "node-cache"
    cache.mkdir()
    os.chown(cache, 107, 107)
    # The claim first, as a cluster binds it before the pod starts: podman makes it a named volume,
    # empty, as a new claim is: the launcher creates its disk.img. fsGroup does not reach a podman
    # volume; a cluster's would make it writable by 107.
    pvc_file = tmp_path / "pvc.yaml"
    pvc_file.write_text(yaml.safe_dump(documents[0]))
    podman("kube", "play", "--quiet", pvc_file)
    claim = Path(podman.out("volume", "inspect", "--format", "{{.Mountpoint}}", "testguest-data"))
    assert list(claim.iterdir()) == []
    os.chown(claim, 107, 107)

    kube = tmp_path / "testguest.yaml"
    kube.write_text(yaml.safe_dump_all(documents[1:]))
    slirps = slirp4netns_pids()
    try:
        check_the_pod(podman, kube, pod, cache, claim, host_port, lazy="/guest-lazy:" in guest_image)
    finally:
        podman("kube", "down", kube, check=False)  # after a failure: no VM left running
    # The pod's network goes with it (slirp4netns ends by itself once the pod's namespace is gone).
    deadline = time.monotonic() + 60
    while (left := {pid for pid in slirp4netns_pids() - slirps if alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"slirp4netns still running: {left}"


def check_the_pod(podman: Podman, kube: Path, pod: dict, cache: Path, claim: Path, host_port: int, lazy: bool) -> None:
    started = time.monotonic()
    podman("kube", "play", "--quiet", "--network", POD_NETWORK, kube, timeout=300)
    logs = wait_for_logs(podman, f"HOLD seconds={HOLD}", 600)
    booted = time.monotonic() - started
    print(f"pod played to guest ready in {booted:.1f} s")

    console = parse_console(logs)
    assert console["ready"], logs
    disks = console["disks"]
    assert disks["vda"]["size"] == 64 << 20 and disks["vda"]["head"].startswith("33c0"), disks  # the guest's MBR
    # The empty claim's disk.img, created by the launcher at the claim's request (pvc.yaml: 2Gi), sparse
    # and qemu's (KubeVirt: pkg/host-disk/host-disk.go).
    assert disks["vdb"]["size"] == 2 << 30 and set(disks["vdb"]["head"]) == {"0"}, disks
    image = os.stat(claim / "disk.img")
    assert (image.st_size, image.st_uid, image.st_gid) == (2 << 30, 107, 107)
    assert image.st_blocks * 512 < 1 << 20  # sparse
    assert any("hostname: testguest" in "".join(iso["files"].values()) for iso in console["isos"].values()), console["isos"]

    # The pod network: the declared port published on the pod's addresses, as KubeVirt's masquerade
    # forwards it, and the guest's page fetched from the host through the pod's published port.
    said = podman("logs", CONTAINER).stderr  # the launcher's own lines
    assert "0.0.0.0:80/TCP -> default port 80" in said, said
    logs = wait_for_logs(podman, "NET-HTTPD port=80", 300)
    assert "NET-LEASE iface=eth0 ip=" in logs, logs
    page = fetch_page(host_port, 120)
    assert page.startswith("DISKKIT-TESTGUEST vm="), page

    # Identity and confinement as the manifest asks, read from the launcher's own /proc.
    status = podman.out("exec", CONTAINER, "cat", "/proc/1/status")
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["Uid"].split()[0] == "107" and fields["Gid"].split()[0] == "107", status
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0, status
    assert fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2", status
    assert not podman("exec", CONTAINER, "test", "-e", "/dev/kvm", check=False).returncode == 0

    # The probes' command: ready while libvirt runs the guest. podman runs the liveness probe as the
    # container's healthcheck (on a systemd timer where there is systemd: here, on demand).
    probe = podman("exec", CONTAINER, "launcher", "status", "testguest", check=False)
    assert (probe.returncode, probe.stdout.strip()) == (0, "running"), probe
    health = podman("healthcheck", "run", CONTAINER, check=False)
    assert health.returncode == 0, health

    # The launcher is PID 1 of its own namespace (shareProcessNamespace: false) and lets nothing rot.
    pid = int(podman.out("inspect", "--format", "{{.State.Pid}}", CONTAINER))
    namespace = pid_namespace(pid)
    inside = processes_in(namespace)
    commands = " | ".join(cmd for _, cmd in inside.values())
    assert "qemu-system-x86_64" in commands and "launcher run" in commands, commands
    # A lazy image is read over NBD from the disk server `launcher run` started in the pod.
    assert ("launcher serve" in commands) == lazy, commands
    assert not [p for p, (state, _) in inside.items() if state == "Z"], inside

    # podman 4.3's `kube down` SIGKILLs at once (podman issue #22397, fixed in 5.1): stop the pod
    # first, which sends SIGTERM and waits the pod's grace period, as the kubelet does.
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    started = time.monotonic()
    podman("pod", "stop", "--time", str(grace), pod["metadata"]["name"], timeout=grace + 60)
    stopped = time.monotonic() - started
    # The stopped container's whole log, read before `kube down` removes it (a `logs --follow` can
    # end with the container before it has read the last lines).
    logs = podman("logs", CONTAINER)
    said = logs.stdout + logs.stderr
    podman("kube", "down", kube, timeout=120)
    print(f"pod down in {stopped:.1f} s")
    assert stopped < GRACE, "the guest did not power off within the VMI's grace period"
    assert podman_exit_code_was_clean(podman, kube.parent / "podman" / "events.log")
    # The guest was asked to power off (ACPI), did so by itself, and the pod's log shows both sides.
    assert f"default_testguest: shutting down (up to {GRACE} s)" in said, said
    assert "DISKKIT-TESTGUEST ACPI-POWEROFF" in said and "default_testguest: the guest powered off" in said, said
    assert "destroying it" not in said, said
    assert processes_in(namespace) == {}
    # The VM's record, run directory and the cache's locks are free for the next pod.
    assert list((cache / "vms").glob("*.json")) == []
    assert not (cache / "run").exists() or list((cache / "run").iterdir()) == []
    locks = list((cache / "locks").glob("*.lock"))
    assert locks  # the run took some: each is free now
    for lock in locks:
        check = subprocess.run(["flock", "--nonblock", "--exclusive", lock, "true"])
        assert check.returncode == 0, f"{lock} is still held"
    # The claim outlives the pod, as a PVC does.
    assert os.stat(claim / "disk.img").st_ino == image.st_ino


def test_the_image_runs_as_107_and_carries_its_bill_of_materials(podman):
    podman("load", "--quiet", "-i", launcher_image())
    config = json.loads(podman.out("image", "inspect", image_tag()))[0]
    print(f"launcher image: {config['Size'] / 2**20:.0f} MiB")
    assert config["Config"]["User"] == "107:107"
    labels = config["Config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == labels["io.diskkit.version"] == version()
    debs = dict(entry.split("=", 1) for entry in labels["io.diskkit.sbom.debian"].split())
    assert {"qemu-system-x86", "qemu-utils", "libvirt-daemon", "python3"} <= debs.keys(), debs
    assert not {"gcc", "libvirt-dev", "python3-dev", "libvirt-daemon-system"} & debs.keys()  # build deps stayed in the builder
    pythons = dict(entry.split("==", 1) for entry in labels["io.diskkit.sbom.python"].split())
    assert pythons["diskkit"] == version() and pythons["libvirt-python"].startswith("9.0"), pythons
    # What the labels list is what the image holds.
    installed = podman.out("run", "--rm", "--network", "none", "--entrypoint", "dpkg-query", image_tag(), "-W", "-f", "${Package} ")
    assert set(installed.split()) == debs.keys()


def test_the_probe_command_fails_without_a_running_vm(tmp_path):
    # Before the launcher has recorded its VM (the pull) and after it is gone, probes fail.
    result = run_launcher("status", "testguest", "--cache-dir", tmp_path)
    assert result.code == 5  # Exit.NOT_FOUND; a probe only asks for non-zero
    assert result.err.strip() == "launcher: testguest: no VM of this name was started from this cache (yet)"
