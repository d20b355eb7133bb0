"""The launcher as a pod, for real, as examples/kubernetes/README.md tells a user to run it under
podman: its image built offline (images/launcher/build.sh) and loaded, then the README's podman block
run line by line as written (examples/kubernetes/podman-play.sh, which converts the shipped
pod.yaml, configmap.yaml, secret.yaml and pvc.yaml, and podman-down.sh), only its inputs given the
test's values (the image, the node cache, the host port). The guest is the test guest as a lazy
containerDisk (`diskkit build`'s default), pulled from a plain-HTTP registry on loopback and booted
under TCG; it stays up until podman-down.sh, which stops it through its ACPI power button.

One boot: a lazy image covers what a pulled one does in the pod (the pull into the hostPath cache
under 107, its locks, the overlay) and also the disk server `launcher run` starts and ends in it.

The pod is on its own network, as in a cluster: slirp4netns, a user-mode stack that changes nothing
on the host. The guest's web page is fetched from the host through the port the pod publishes, which
reaches the guest as KubeVirt's masquerade does: the launcher forwards the VMI's declared port from
the pod's addresses into the guest.

The machine's own podman settings (private storage, rlimits runc can set here, cgroupfs, a file
events log) and the README's containers.conf set-up step are tests/podhost.py's containers.conf.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_diskkit, run_launcher
from tests.distribution import free_port
from tests.leftovers import alive
from tests.podhost import Podman, image_tag, launcher_image, version
from tests.testguest import ensure_testguest, parse_console

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "kubernetes"
PLAY = "examples/kubernetes/podman-play.sh"
DOWN = "examples/kubernetes/podman-down.sh"
READY = "DISKKIT-TESTGUEST v1 READY"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


(POD,) = docs("pod.yaml")
POD_NAME = POD["metadata"]["name"]
CONTAINER = f"{POD_NAME}-launcher"  # podman names a pod's container <pod>-<container>
VMI = yaml.safe_load(docs("configmap.yaml")[0]["data"]["vmi.yaml"])
GRACE = VMI["spec"].get("terminationGracePeriodSeconds", 30)  # KubeVirt's default when unset


def readme_block(name: str) -> list[str]:
    """The command lines of a marked block of examples/kubernetes/README.md."""
    found = re.search(rf"<!-- {name} -->\n```sh\n(.*?)```\n<!-- /{name} -->", (EXAMPLES / "README.md").read_text(), re.S)
    assert found, f"examples/kubernetes/README.md has no {name} block"
    return [line for line in found.group(1).splitlines() if line.strip() and not line.startswith("#")]


def command(line: str) -> str:
    return line.split("#", 1)[0].strip()


class Block:
    """The README's podman block, each line run once, in order, as written after the block's first
    line (its inputs), which the test gives its own values."""

    def __init__(self, podman: Podman, inputs: dict[str, str]):
        first, *self.lines = readme_block("podman")
        assert sorted(re.findall(r"(\w+)=", first)) == sorted(inputs), first
        self.prefix = " ".join(f"{k}={v}" for k, v in inputs.items())
        self.podman = podman

    def take(self, start: str) -> str:
        assert self.lines and self.lines[0].startswith(start), f"the README's next podman line is not {start!r}: {self.lines[:1]}"
        return self.lines.pop(0)

    def run(self, start: str, timeout: float = 300) -> subprocess.CompletedProcess:
        line = self.take(start)
        return subprocess.run(["bash", "-euc", f"{self.prefix}\n{line}"], cwd=REPO, env=self.podman.env,
                              capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def podman(tmp_path_factory) -> Podman:
    """A private rootful podman with the launcher's image loaded, as the README's set-up does; the
    pod's sysctls in its containers.conf, the README's step for podman before 4.6."""
    setup = readme_block("podman-setup")
    assert "bash images/launcher/build.sh launcher.tar && podman load -i launcher.tar" in " ".join(setup), setup
    sysctls = {s["name"]: s["value"] for s in POD["spec"]["securityContext"]["sysctls"]}
    assert sysctls == {"net.ipv4.ip_unprivileged_port_start": "0"}, sysctls  # what the README's containers.conf lists
    engine = Podman(tmp_path_factory.mktemp("podman"), sysctls=sysctls)
    (line,) = [line for line in (engine.root / "containers.conf").read_text().splitlines() if line.startswith("default_sysctls")]
    assert f"[containers]\n{line}\n" in (EXAMPLES / "README.md").read_text(), line  # the README's containers.conf step
    engine("load", "--quiet", "-i", launcher_image())  # build.sh's archive, cached per inputs (tests/podhost.py)
    yield engine
    # A copy of the image per container (vfs): give the disk back now, not when pytest prunes old runs.
    engine("pod", "rm", "--all", "--force", check=False)
    engine("rm", "--all", "--force", check=False)
    shutil.rmtree(engine.root / "storage", ignore_errors=True)
    engine.close()


@pytest.fixture
def pod_image(registry) -> str:
    """The test guest as a lazy containerDisk (diskkit build's default), which `launcher run` boots
    through a disk server it starts in the pod. It stays up until its power button is pressed."""
    ref = f"{registry.host}/pod/guest:v1"
    result = run_diskkit("build", "--tls-verify=false", ensure_testguest() / "testguest.qcow2", "-t", ref)
    assert result.code == 0, result.err
    return ref


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


def exit_code_was_clean(podman: Podman) -> bool:
    """The launcher container ended by itself (130: interrupted, its cleanup done), not by SIGKILL (137)."""
    codes = [json.loads(line).get("ContainerExitCode") for line in (podman.root / "events.log").read_text().splitlines()
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


def slirp4netns_pids() -> set[int]:
    return {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _comm(p) == "slirp4netns"}


def _comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text().strip()
    except OSError:
        return ""


# The launcher image is rebuilt (minutes) whenever its inputs changed, then a TCG boot in a pod and the
# vfs storage's removal: more than the suite's 600 s on a busy machine.
@pytest.mark.timeout(1800)
def test_the_readme_plays_the_example_pod_which_stays_up_until_podman_down(tmp_path, podman, pod_image):
    cache, port = tmp_path / "node-cache", free_port()
    block = Block(podman, {"IMAGE": pod_image, "CACHE": str(cache), "PORT": str(port)})
    slirps = slirp4netns_pids()
    try:
        made = block.run("install -d -o 107 -g 107 $CACHE")
        assert made.returncode == 0, made.stderr
        check_the_pod(podman, block, cache, port)
    finally:
        podman("pod", "rm", "--force", POD_NAME, check=False)  # after a failure: no VM left running
    # The pod's network goes with it (slirp4netns ends by itself once the pod's namespace is gone).
    deadline = time.monotonic() + 60
    while (left := {pid for pid in slirp4netns_pids() - slirps if alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"slirp4netns still running: {left}"


def check_the_pod(podman: Podman, block: Block, cache: Path, port: int) -> None:
    started = time.monotonic()
    played = block.run(PLAY)
    assert played.returncode == 0, played.stderr
    # A registry on the host's loopback is the pod's 10.0.3.2, and the script says what that opens.
    assert "the pod, and its guest, can reach every service on this host's loopback" in played.stderr, played.stderr
    assert command(block.take("podman logs -f")) == f"podman logs -f {CONTAINER}"  # followed here by polling it
    logs = wait_for_logs(podman, "HOLD seconds=forever", 600)  # the guest waits, as a real one does
    print(f"pod played to guest ready in {time.monotonic() - started:.1f} s")

    console = parse_console(logs)
    assert console["ready"], logs
    disks = console["disks"]
    assert disks["vda"]["size"] == 64 << 20 and disks["vda"]["head"].startswith("33c0"), disks  # the guest's MBR
    # The empty claim's disk.img, created by the launcher at the claim's request (pvc.yaml: 2Gi), sparse
    # and qemu's (KubeVirt: pkg/host-disk/host-disk.go).
    (pvc,) = docs("pvc.yaml")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert disks["vdb"]["size"] == 2 << 30 and set(disks["vdb"]["head"]) == {"0"}, disks
    claim = Path(podman.out("volume", "inspect", "--format", "{{.Mountpoint}}", pvc["metadata"]["name"]))
    image = os.stat(claim / "disk.img")
    assert (image.st_size, image.st_uid, image.st_gid) == (2 << 30, 107, 107)
    assert image.st_blocks * 512 < 1 << 20  # sparse
    # secret.yaml's user data, played as a ConfigMap, reached the guest as its cloud-init disk.
    (secret,) = docs("secret.yaml")
    userdata = secret["stringData"]["userdata"]
    assert "hostname: testguest" in userdata
    assert any("hostname: testguest" in "".join(iso["files"].values()) for iso in console["isos"].values()), console["isos"]

    # The pod network: the declared port published on the pod's addresses, as KubeVirt's masquerade
    # forwards it, and the guest's page fetched from the host through the pod's published port.
    said = podman("logs", CONTAINER).stderr  # the launcher's own lines
    ((interface,),) = [VMI["spec"]["domain"]["devices"]["interfaces"]]
    assert [p["port"] for p in interface["ports"]] == [80]
    assert "0.0.0.0:80/TCP -> default port 80" in said, said
    logs = wait_for_logs(podman, "NET-HTTPD port=80", 300)
    assert "NET-LEASE iface=eth0 ip=" in logs, logs
    page = fetch(block, port)
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
    # The lazy image is read over NBD from the disk server `launcher run` started in the pod.
    assert "launcher serve" in commands, commands
    assert not [p for p, (state, _) in inside.items() if state == "Z"], inside

    # Still up after all that: the guest waits for its power button, as a user expects of a VM.
    logs = podman("logs", CONTAINER).stdout
    assert "ACPI-POWEROFF" not in logs and podman.out("inspect", "--format", "{{.State.Status}}", CONTAINER) == "running", logs

    # The documented stop: SIGTERM and the pod's grace period, as the kubelet stops a pod; it prints
    # what the pod said meanwhile, then removes it.
    down = block.run(DOWN, timeout=POD["spec"]["terminationGracePeriodSeconds"] + 120)
    assert down.returncode == 0, down.stderr
    said = down.stdout + down.stderr
    print(f"{DOWN} said:\n{said}")
    assert block.lines == [], f"README podman lines this test does not run: {block.lines}"
    assert exit_code_was_clean(podman)
    # The guest was asked to power off (ACPI), did so by itself within the VMI's grace period, and the
    # pod's last lines show both sides.
    assert f"default_testguest: shutting down (up to {GRACE} s)" in said, said
    assert "DISKKIT-TESTGUEST ACPI-POWEROFF" in said and "default_testguest: the guest powered off" in said, said
    assert "destroying it" not in said and "level=error" not in said, said
    assert podman("pod", "exists", POD_NAME, check=False).returncode == 1
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


def fetch(block: Block, port: int) -> str:
    """The README's curl line: the guest's web page through the pod's published port (slirp4netns ->
    the pod's IP -> qemu's forward -> the guest); the first tries may meet a forward still being set up."""
    line = block.take("curl ")
    assert command(line) == "curl http://127.0.0.1:$PORT/", line
    deadline = time.monotonic() + 120
    while True:
        got = subprocess.run(["bash", "-euc", f"{block.prefix}\n{line}"], capture_output=True, text=True, timeout=60)
        if got.returncode == 0:
            return got.stdout
        assert time.monotonic() < deadline, f"the guest's page did not come through 127.0.0.1:{port}: {got.stderr}"
        time.sleep(2)


@pytest.fixture
def tiny_podman(tmp_path) -> Podman:
    """A podman without the pod's sysctls in its containers.conf (podman 4.3 ignores the pod's own),
    and a tiny image in place of the launcher's: the pod is made but its containers never start."""
    engine = Podman(tmp_path / "podman")
    rootfs = tmp_path / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    shutil.copy("/bin/busybox", rootfs / "bin" / "busybox")
    subprocess.run(["tar", "-C", rootfs, "-cf", tmp_path / "tiny.tar", "."], check=True)
    engine("import", "--quiet", tmp_path / "tiny.tar", "localhost/tiny:1")
    yield engine
    engine("pod", "rm", "--all", "--force", check=False)
    engine.close()


def test_play_refuses_a_pod_where_qemu_cannot_take_the_guests_port_and_leaves_nothing(tmp_path, tiny_podman):
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chown(cache, 107, 107)
    played = subprocess.run([REPO / PLAY, "--cache", cache, "--launcher-image", "localhost/tiny:1"], env=tiny_podman.env,
                            capture_output=True, text=True, timeout=300)
    assert played.returncode == 1, played
    assert played.stderr.splitlines()[-1] == (
        "podman-play.sh: the pod's net.ipv4.ip_unprivileged_port_start is 1024, so qemu (107, no capability) cannot take "
        "port 80: podman before 4.6 ignores a pod's sysctls; add \"net.ipv4.ip_unprivileged_port_start=0\" to default_sysctls "
        "in the [containers] table of containers.conf"), played.stderr
    assert tiny_podman.out("pod", "ls", "--quiet") == "" and tiny_podman.out("ps", "--all", "--quiet") == ""
    assert "testguest-data" not in tiny_podman.out("volume", "ls", "--quiet").split()  # nor the claim it made first


@pytest.mark.parametrize("case", ["missing", "root's"])
def test_play_refuses_a_cache_the_launcher_cannot_use_before_anything_is_made(tmp_path, case):
    cache = tmp_path / "cache"
    if case == "root's":
        cache.mkdir()
    engine = Podman(tmp_path / "podman")
    try:
        played = subprocess.run([REPO / PLAY, "--cache", cache], env=engine.env, capture_output=True, text=True, timeout=60)
    finally:
        engine.close()
    assert played.returncode == 1, played
    fix = f"install -d -o 107 -g 107 {cache}" if case == "missing" else f"chown 107:107 {cache}"
    assert played.stderr.startswith(f"podman-play.sh: --cache {cache}: ") and played.stderr.rstrip().endswith(fix), played.stderr
    assert len(played.stderr.splitlines()) == 1
    assert not (engine.root / "storage").exists()  # podman was never asked for anything


@pytest.mark.slow  # its engine loads the launcher's image (built once per machine: minutes)
def test_the_image_runs_as_107_and_carries_its_bill_of_materials(podman):
    config = json.loads(podman.out("image", "inspect", image_tag()))[0]
    print(f"launcher image: {config['Size'] / 2**20:.0f} MiB")
    assert config["Config"]["User"] == "107:107"
    labels = config["Config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == labels["io.diskkit.version"] == version()
    debs = dict(entry.split("=", 1) for entry in labels["io.diskkit.sbom.debian"].split())
    assert {"qemu-system-x86", "qemu-utils", "libvirt-daemon", "python3"} <= debs.keys(), debs
    assert not {"gcc", "libvirt-dev", "python3-dev", "libvirt-daemon-system"} & debs.keys()  # no compiler: libvirt-python is Debian's
    pythons = dict(entry.split("==", 1) for entry in labels["io.diskkit.sbom.python"].split())
    assert pythons["diskkit"] == version() and pythons["libvirt-python"].startswith("9.0"), pythons
    # What the labels list is what the image holds.
    installed = podman.out("run", "--rm", "--network", "none", "--entrypoint", "dpkg-query", image_tag(), "-W", "-f", "${Package} ")
    assert set(installed.split()) == debs.keys()
    # The tag podman-play.sh gives the pod by default is the one build.sh names the image.
    assert image_tag() == f"localhost/diskkit-launcher:{POD['spec']['containers'][0]['image'].rpartition(':')[2]}"


def test_the_probe_command_fails_without_a_running_vm(tmp_path):
    # Before the launcher has recorded its VM (the pull) and after it is gone, probes fail.
    result = run_launcher("status", "testguest", "--cache-dir", tmp_path)
    assert result.code == 5  # Exit.NOT_FOUND; a probe only asks for non-zero
    assert result.err.strip() == "launcher: testguest: no VM of this name was started from this cache (yet)"
