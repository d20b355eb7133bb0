"""The launcher as a pod, for real: its image built offline (images/launcher/build.sh), the example
manifests of examples/kubernetes played by podman, the test guest pulled from a registry on
loopback and booted under TCG, its console read with `podman logs`, the pod torn down with
`podman kube down` and nothing of it left running.

Both a containerDisk pulled whole and a lazy one (booted through the disk server `launcher run`
starts in the pod) are played.

What the test changes in the examples, and why: the containerDisk reference (the loopback
registry, plain HTTP), the cache hostPath (a directory of the test's own), the data disk's serial
(`hold-N` keeps the test guest up instead of powering off at once) and the kvm device limit (no
/dev/kvm in tests).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_diskkit, run_launcher
from tests.podhost import Podman, image_tag, launcher_image, version
from tests.testguest import ensure_testguest, parse_console
from tests.vmhost import NOREG

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "kubernetes"
CONTAINER = "testguest-launcher"  # podman names a pod's container <pod>-<container>
READY = "DISKKIT-TESTGUEST v1 READY"
HOLD = 600
GRACE = 30  # the VMI's: KubeVirt's default terminationGracePeriodSeconds, as the example leaves it


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def manifests(image: str, cache: Path) -> tuple[list[dict], dict]:
    """The example PVC, ConfigMap and Pod, pointed at the test's registry and cache."""
    (pvc,), (configmap,), (pod,) = docs("pvc.yaml"), docs("configmap.yaml"), copy.deepcopy(docs("pod.yaml"))
    vmi = yaml.safe_load(configmap["data"]["vmi.yaml"])
    (root,) = [v for v in vmi["spec"]["volumes"] if v["name"] == "root"]
    root["containerDisk"]["image"] = image
    (data,) = [d for d in vmi["spec"]["domain"]["devices"]["disks"] if d["name"] == "data"]
    data["serial"] = f"hold-{HOLD}"
    configmap["data"]["vmi.yaml"] = yaml.safe_dump(vmi)
    (container,) = pod["spec"]["containers"]
    container["command"] = [*container["command"], NOREG]
    del container["resources"]["limits"]["devices.kubevirt.io/kvm"]
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


@pytest.fixture
def podman(tmp_path) -> Podman:
    engine = Podman(tmp_path / "podman")
    yield engine
    # A copy of the image per test (vfs): give the disk back now, not when pytest prunes old runs.
    engine("rm", "--all", "--force", check=False)
    shutil.rmtree(engine.root / "storage", ignore_errors=True)


def test_the_example_pod_boots_the_guest_reads_its_claim_and_leaves_nothing(tmp_path, podman, pod_image):
    guest_image = pod_image
    archive = launcher_image()
    podman("load", "--quiet", "-i", archive)
    documents, pod = manifests(guest_image, tmp_path / "node-cache")
    podman("tag", image_tag(), pod["spec"]["containers"][0]["image"])

    # The node's cache belongs to 107 (fsGroup does not reach a hostPath).
    cache = tmp_path / "node-cache"
    cache.mkdir()
    os.chown(cache, 107, 107)
    # The claim's disk.img, with a header the guest must print back.
    header = b"DISKKIT-PVC-" + secrets.token_bytes(4)
    # The claim first, as a cluster binds it before the pod starts: podman makes it a named volume.
    pvc_file = tmp_path / "pvc.yaml"
    pvc_file.write_text(yaml.safe_dump(documents[0]))
    podman("kube", "play", "--quiet", pvc_file)
    claim = Path(podman.out("volume", "inspect", "--format", "{{.Mountpoint}}", "testguest-data"))
    with open(claim / "disk.img", "wb") as disk:
        disk.write(header)
        disk.truncate(32 << 20)
    os.chown(claim, 107, 107)
    os.chown(claim / "disk.img", 107, 107)

    kube = tmp_path / "testguest.yaml"
    kube.write_text(yaml.safe_dump_all(documents[1:]))
    try:
        check_the_pod(podman, kube, pod, cache, claim, header, lazy="/guest-lazy:" in guest_image)
    finally:
        podman("kube", "down", kube, check=False)  # after a failure: no VM left running


def check_the_pod(podman: Podman, kube: Path, pod: dict, cache: Path, claim: Path, header: bytes, lazy: bool) -> None:
    started = time.monotonic()
    podman("kube", "play", "--quiet", kube, timeout=300)
    logs = wait_for_logs(podman, f"HOLD seconds={HOLD}", 600)
    booted = time.monotonic() - started
    print(f"pod played to guest ready in {booted:.1f} s")

    console = parse_console(logs)
    assert console["ready"], logs
    disks = console["disks"]
    assert disks["vda"]["size"] == 64 << 20 and disks["vda"]["head"].startswith("33c0"), disks  # the guest's MBR
    assert disks["vdb"]["head"] == header.hex(), disks  # the claim's own bytes
    assert disks["vdb"]["size"] == 32 << 20, disks
    assert any("hostname: testguest" in "".join(iso["files"].values()) for iso in console["isos"].values()), console["isos"]

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
    assert (claim / "disk.img").read_bytes()[:16] == header


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
