"""One VM, one view: each qemu a root launcher runs reaches its own disks and monitor, and nothing of
another VM's.

Every VM's qemu used to run as KubeVirt's qemu user (107), so a process of uid 107 (a local user, or
a guest that escaped into its qemu) read every disk in the node cache, every VM's overlay, and every
root-started VM's monitor and memory. Here a root launcher on a host with no system libvirt daemon runs
two VMs at once, from two images; the attacker is uid 107 outside any VM, and the qemu of VM a (a
process in its user and mount namespaces, as its uid). Neither reaches VM b's pulled disk, its overlay,
its libvirt or monitor socket, its qemu's memory or its qemu's view of the filesystem
(/proc/PID/root); each VM boots and reads its own disks, and stopping one gives its uid back.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from diskkit.errors import DiskkitError
from launcher.node.cache import Cache
from launcher.render.domain import ResolvedDisk
from launcher.runtime import diskfds, vmuser
from launcher.runtime.vmuser import BLOCK, VMS_DIR
from tests.conftest import run_diskkit
from tests.test_launcher_console import processes_of_uid, root_launcher
from tests.testguest import KERNEL_CMDLINE, ensure_testguest, parse_console
from tests.vmhost import DONE, NOREG, QEMU_UID, qemu_scratch

HOLD = "hold-900"
KERNEL_DIR = "/boot"
CONNECT = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1]); "
           "print('CONNECTED')")
READ = "import sys; f = open(sys.argv[1], 'rb'); f.read(512); print('READ')"


@dataclass
class Vm:
    name: str
    record: dict
    qemu_pid: int
    console: dict

    @property
    def socket(self) -> Path:
        return Path(self.record["uri"].split("socket=", 1)[1])

    @property
    def home(self) -> Path:
        return self.socket.parents[2]  # HOME/.cache/libvirt/libvirt-sock

    @property
    def monitor(self) -> Path:
        [found] = self.home.glob(f".config/libvirt/qemu/lib/domain-*-default_{self.name}/monitor.sock")
        return found

    def pulled_disk(self, cache: Path) -> Path:
        """The containerDisk's disk in the node cache (not the kernelBoot files beside it)."""
        [entry] = [Path(e) for e in self.record["entries"] if Path(e).is_relative_to(cache / "disks")
                   and json.loads((Path(e) / "meta.json").read_text())["member"].startswith("disk/")]
        return entry / "disk.img"

    def overlay(self, cache: Path) -> Path:
        return cache / "run" / f"default_{self.name}" / "root" / "disk.qcow2"


def qemu_of(domain: str) -> int:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline[0].endswith(b"qemu-system-x86_64") and f"guest={domain},debug-threads=on".encode() in cmdline:
            return int(pid)
    raise AssertionError(f"no qemu runs {domain}")


def ids(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    uid = next(line for line in status if line.startswith("Uid:")).split()[1]
    gid = next(line for line in status if line.startswith("Gid:")).split()[1]
    return int(uid), int(gid)


@pytest.fixture(scope="module")
def images(registry) -> dict[str, str]:
    """Two images with disks of their own (b's is a MiB longer, so no layer is shared); b's also
    carries the guest's kernel and initrd, which its VM boots (kernelBoot)."""
    guest = ensure_testguest()
    with qemu_scratch("diskkit-vmview-img-") as scratch:
        other = scratch / "other.qcow2"
        shutil.copy(guest / "testguest.qcow2", other)
        subprocess.run(["qemu-img", "resize", "-q", other, "+1M"], check=True)
        refs = {"a": f"{registry.host}/vmview/a:v1", "b": f"{registry.host}/vmview/b:v1"}
        for name, disk, extra in (("a", guest / "testguest.qcow2", []),
                                  ("b", other, ["--kernel", guest / "vmlinuz", "--initrd", f"{KERNEL_DIR}/initrd.img={guest / 'initrd.img'}"])):
            built = run_diskkit("build", NOREG, "--no-lazy", disk, *extra, "-t", refs[name])
            assert built.code == 0, built.err
    return refs


def write_vmi(scratch: Path, name: str, image: str) -> tuple[Path, list[str]]:
    """A VMI booting `image`; a's also has a claim as a disk, and a claim and a ConfigMap shared over
    virtiofs (every kind of file qemu reaches otherwise than through its run directory)."""
    vmi = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": name},
           "spec": {"domain": {"resources": {"requests": {"memory": "128Mi"}},
                               "devices": {"disks": [{"name": "root", "serial": HOLD, "disk": {"bus": "virtio"}}]}},
                    "volumes": [{"name": "root", "containerDisk": {"image": image}}]}}
    args: list[str] = []
    if name == "b":
        vmi["spec"]["domain"]["firmware"] = {"kernelBoot": {"kernelArgs": KERNEL_CMDLINE, "container": {
            "image": image, "kernelPath": f"{KERNEL_DIR}/vmlinuz", "initrdPath": f"{KERNEL_DIR}/initrd.img"}}}
    if name == "a":
        data, shared, manifests = scratch / "data-claim", scratch / "shared-claim", scratch / "manifests"
        for directory in (data, shared, manifests):
            directory.mkdir()
        (shared / "hello.txt").write_text("hello from the claim\n")
        (manifests / "cm.json").write_text(json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app-config"},
                                                       "data": {"greeting": "hi over virtiofs"}}))
        spec = vmi["spec"]
        spec["domain"]["devices"]["disks"].append({"name": "data", "serial": "claim-data", "disk": {"bus": "virtio"}})
        spec["domain"]["devices"]["filesystems"] = [{"name": "fs0", "virtiofs": {}}, {"name": "fs1", "virtiofs": {}}]
        spec["volumes"] += [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                            {"name": "fs0", "persistentVolumeClaim": {"claimName": "shared"}},
                            {"name": "fs1", "configMap": {"name": "app-config"}}]
        args = ["--pvc", f"data={data}:16Mi", "--pvc", f"shared={shared}", "--manifests", str(manifests)]
    path = scratch / f"{name}.json"
    path.write_text(json.dumps(vmi))
    return path, args


@pytest.fixture(scope="module")
def pair(images):
    """VMs a and b, started by a root launcher with no system daemon around, both running."""
    with qemu_scratch("diskkit-vmview-") as scratch:
        cache = scratch / "cache"
        vms: dict[str, Vm] = {}
        try:
            for name in ("a", "b"):
                path, args = write_vmi(scratch, name, images[name])
                started = root_launcher(cache, "run", NOREG, *args, "--detach", "--wait-for", "HOLD seconds", "--timeout", "300", path)
                assert started.returncode == 0, started.stderr
                record = json.loads((cache / "vms" / f"default_{name}.json").read_text())
                logs = root_launcher(cache, "logs", name)
                vms[name] = Vm(name, record, qemu_of(f"default_{name}"), parse_console(logs.stdout))
            yield cache, vms
        finally:
            for name in ("a", "b"):
                root_launcher(cache, "stop", name)


def as_107(*cmd) -> list[str]:
    """A process of uid 107 outside any VM: KubeVirt's qemu user and group (107:107), as qemu ran."""
    return ["setpriv", f"--reuid={QEMU_UID}", f"--regid={QEMU_UID}", "--clear-groups", "--", *cmd]


def as_qemu_of(pid: int, *cmd) -> list[str]:
    """A process in the namespaces of the qemu `pid`, as the user it runs as (107 in its namespace)."""
    joins = [flag for flag, ns in (("-U", "user"), ("-m", "mnt")) if os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")]
    return ["nsenter", "-t", str(pid), *joins, "-S", str(QEMU_UID), "-G", str(QEMU_UID), "--", *cmd]


def attacker(who: str, vms: dict[str, Vm]):
    return as_107 if who == "uid-107" else (lambda *cmd: as_qemu_of(vms["a"].qemu_pid, *cmd))


def test_each_vm_boots_and_reads_its_own_disks(pair):
    cache, vms = pair
    for vm in vms.values():
        assert vm.console["done"], vm.console
        assert vm.console["disks"]["vda"]["serial"] == HOLD and vm.console["disks"]["vda"]["head"].startswith("33c0"), vm.console
    assert vms["b"].console["disks"]["vda"]["size"] == vms["a"].console["disks"]["vda"]["size"] + (1 << 20)
    assert vms["a"].pulled_disk(cache) != vms["b"].pulled_disk(cache)
    # b booted its image's kernel, from a copy in its run directory (qemu opens -kernel by name)
    run_b = cache / "run" / "default_b"
    kernel = ET.fromstring((run_b / "domain.xml").read_text()).find("os/kernel").text
    assert kernel == str(run_b / "kernel-boot" / "kernel") and vms["b"].console["ready"]
    # a's claim, written through the open file root handed qemu, and its shares, through virtiofsd
    a = vms["a"].console
    (claim,) = [d for d in a["disks"] if a["disks"][d]["serial"] == "claim-data"]
    assert a["stamps"][claim] == (0, 1), a["stamps"]
    assert a["filesystems"]["fs0"]["files"]["/hello.txt"] == "hello from the claim\n" and a["filesystems"]["fs0"]["wrote"]
    assert a["filesystems"]["fs1"]["files"]["/greeting"] == "hi over virtiofs\n" and not a["filesystems"]["fs1"]["wrote"]


DUMP_NAME = re.compile(r"a-dumps-\d{8}-\d{6}\.memory\.dump")


def test_a_memory_dump_of_a_running_vm_is_an_elf_core_in_the_claim(pair):
    """`launcher memory-dump get a --claim-name dumps --create-claim` (virtctl memory-dump get): the VM's
    own libvirt (its uid) writes the dump, which ends up in the claim as the claim's owner's file, named
    as virt-handler names it; the claim stays associated until `memory-dump remove`
    (tests/test_memory_dump.py has the rules)."""
    cache, _ = pair
    claim = cache.parent / "dump-claim"
    dumped = root_launcher(cache, "memory-dump", "get", "a", "--claim-name", "dumps", "--create-claim", "--pvc", f"dumps={claim}")
    assert dumped.returncode == 0, dumped.stderr
    assert "PVC default/dumps created" in dumped.stderr and "dumps: InProgress" in dumped.stderr, dumped.stderr
    path = Path(dumped.stdout.strip())
    assert path.parent == claim and DUMP_NAME.fullmatch(path.name), path
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_size > 128 << 20 and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    with open(path, "rb") as dump:
        header = dump.read(20)
    assert header[:4] == b"\x7fELF" and struct.unpack_from("<H", header, 16)[0] == 4, header  # ET_CORE
    assert not (cache / "run" / "default_a" / "memory-dump").exists()  # the VM's uid's staging directory went
    request = json.loads(root_launcher(cache, "status", "--json", "a").stdout)["memoryDumpRequest"]
    assert (request["claimName"], request["phase"], request["fileName"]) == ("dumps", "Completed", path.name), request
    # associated: the claim is used again without naming it, another one is refused in virt-api's words
    again = root_launcher(cache, "memory-dump", "get", "a", "--pvc", f"dumps={claim}")
    assert again.returncode == 0, again.stderr
    assert [p.name for p in claim.iterdir()] == [Path(again.stdout.strip()).name]  # the earlier dump was removed
    other = root_launcher(cache, "memory-dump", "get", "a", "--claim-name", "other", "--pvc", f"other={claim}")
    assert other.returncode != 0 and "can't request memory dump for pvc [other] while pvc [dumps] is still associated" in other.stderr
    removed = root_launcher(cache, "memory-dump", "remove", "a")
    assert (removed.returncode, removed.stdout.strip()) == (0, "Successfully submitted remove memory dump association of VM a"), removed.stderr
    gone = root_launcher(cache, "memory-dump", "remove", "a")
    assert gone.returncode != 0 and "can't remove memory dump association for vm a, no association found" in gone.stderr


def test_a_memory_dump_downloads_as_virtctls_archive_of_the_core(pair):
    """`launcher memory-dump get a ... --output FILE` (virtctl memory-dump get --output, which downloads
    once the dump completes, pkg/virtctl/memorydump/memorydump.go): FILE is the claim export's archive,
    a gzipped tar, holding the ELF core under the dump's name; `memory-dump download --format raw` gives
    the tar itself (tests/test_memory_dump.py has the rules, and the download after the VM stops)."""
    cache, _ = pair
    claim, out = cache.parent / "download-claim", cache.parent / "memoryDump.dump.gz"
    dumped = root_launcher(cache, "memory-dump", "get", "a", "--claim-name", "fetched", "--create-claim", "--pvc", f"fetched={claim}",
                           "--output", str(out))
    assert dumped.returncode == 0, dumped.stderr
    assert "Memory dump completed successfully" in dumped.stderr and "Download finished successfully" in dumped.stderr, dumped.stderr
    path = Path(dumped.stdout.strip())
    raw = cache.parent / "memoryDump.tar"
    again = root_launcher(cache, "memory-dump", "download", "a", "--output", str(raw), "--format", "raw")
    assert again.returncode == 0, again.stderr
    for archive, mode in [(out, "r:gz"), (raw, "r:")]:
        with tarfile.open(archive, mode) as tar:
            (member,) = tar.getmembers()
            assert (member.name, member.size) == (f"./{path.name}", path.stat().st_size), member
            header = tar.extractfile(member).read(20)
        assert header[:4] == b"\x7fELF" and struct.unpack_from("<H", header, 16)[0] == 4, header  # ET_CORE
    assert root_launcher(cache, "memory-dump", "remove", "a").returncode == 0


def test_a_memory_dump_into_a_claim_with_links_planted_writes_through_none(pair):
    """The claim's owner (uid 107 here: a user, or a guest the claim was shared with) plants links under
    every name the dump could get in the next minute, to a file of root's: none is written through,
    and the dump is a file of its own."""
    cache, _ = pair
    claim = cache.parent / "planted-claim"
    claim.mkdir()
    os.chown(claim, QEMU_UID, QEMU_UID)
    victim = cache.parent / "victim"
    victim.write_text("root's own\n")
    now = datetime.now()
    for second in range(-5, 60):
        name = f"a-planted-{(now + timedelta(seconds=second)).strftime('%Y%m%d-%H%M%S')}.memory.dump"
        subprocess.run(as_107("ln", "-s", str(victim), str(claim / name)), check=True)
    dumped = root_launcher(cache, "memory-dump", "get", "a", "--claim-name", "planted", "--pvc", f"planted={claim}")
    assert dumped.returncode == 0, dumped.stderr
    path = Path(dumped.stdout.strip())
    assert victim.read_text() == "root's own\n"
    assert stat.S_ISREG(os.lstat(path).st_mode) and os.lstat(path).st_uid == QEMU_UID  # the claim owner's
    assert [p.name for p in claim.iterdir()] == [path.name]  # the planted links went as earlier dumps do
    assert root_launcher(cache, "memory-dump", "remove", "a").returncode == 0


def test_each_qemu_runs_as_107_in_a_user_namespace_of_its_own_and_as_a_uid_of_its_own_outside(pair):
    """As a pod with a user namespace (the kubelet's pkg/kubelet/userns_manager.go: blocks of 65536 ids,
    the first the host's): qemu is 107 inside, slot * 65536 + 107 outside, and no two VMs share a uid."""
    _, vms = pair
    outside = {name: ids(vm.qemu_pid) for name, vm in vms.items()}
    assert outside["a"] != outside["b"], outside
    for name, vm in vms.items():
        uid, gid = outside[name]
        assert uid == gid and uid % BLOCK == QEMU_UID and uid != QEMU_UID, outside
        assert Path(f"/proc/{vm.qemu_pid}/uid_map").read_text().split() == [str(QEMU_UID), str(uid), "1"]
        assert vm.record["vmUser"]["uid"] == uid and vm.home == VMS_DIR / str(uid)
        st = vm.home.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (uid, 0o700)


def test_uid_107_lists_nothing_of_the_cache(pair):
    cache, _ = pair
    for sub in ("disks", "run", "exports"):
        listed = subprocess.run(as_107("ls", cache / sub), capture_output=True, text=True)
        assert listed.returncode != 0 and "Permission denied" in listed.stderr, (sub, listed.stdout)


TARGETS = ("pulled-disk", "overlay", "libvirt-socket", "monitor-socket", "qemu-memory", "qemu-root")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("who", ["uid-107", "qemu-of-a"])
def test_nothing_of_another_vm_is_reached(pair, who, target):
    """Attack: read VM b's pulled disk (another image's) and its overlay, connect to its session daemon's
    socket and its qemu's monitor (which dumped the guest's RAM), open its qemu's memory, and read its
    overlay through its qemu's root (/proc/PID/root, what a mount namespace alone leaves open to the
    same uid). Before, every one succeeded for both attackers; now each is refused by the kernel."""
    cache, vms = pair
    b = vms["b"]
    code, path = {
        "pulled-disk": (READ, b.pulled_disk(cache)),
        "overlay": (READ, b.overlay(cache)),
        "libvirt-socket": (CONNECT, b.socket),
        "monitor-socket": (CONNECT, b.monitor),
        "qemu-memory": (READ.replace("f.read(512)", "f.seek(0)"), Path(f"/proc/{b.qemu_pid}/mem")),
        "qemu-root": (READ, Path(f"/proc/{b.qemu_pid}/root") / str(b.overlay(cache)).lstrip("/")),
    }[target]
    assert path.exists(), path  # the target is there, for root
    tried = subprocess.run(attacker(who, vms)(sys.executable, "-c", code, str(path)), capture_output=True, text=True)
    assert tried.returncode != 0 and "PermissionError" in tried.stderr, (who, target, tried.stdout, tried.stderr[-500:])


@pytest.mark.parametrize("what", ["pulled-disk", "overlay"])
def test_the_qemu_of_a_still_reaches_its_own_files(pair, what):
    """The attacker above is no weaker than qemu itself: in a's namespaces as a's uid, a's own overlay
    opens; its pulled disk does not (qemu was handed it open, by root)."""
    cache, vms = pair
    a = vms["a"]
    path = a.overlay(cache) if what == "overlay" else a.pulled_disk(cache)
    tried = subprocess.run(as_qemu_of(a.qemu_pid, sys.executable, "-c", READ, str(path)), capture_output=True, text=True)
    if what == "overlay":
        assert tried.returncode == 0 and "READ" in tried.stdout, tried.stderr
    else:
        assert tried.returncode != 0 and "PermissionError" in tried.stderr, tried.stderr


def test_a_vms_own_daemon_killed_under_it_is_started_again(pair):
    """A VM's daemon killed while its qemu runs (an OOM kill, say): the next verb starts it again in the
    VM's HOME, as the VM's uid in a user namespace of its own, and it finds the running guest."""
    cache, vms = pair
    a = vms["a"]
    uid = a.record["vmUser"]["uid"]

    def daemon() -> int:
        return int((a.home / ".cache" / "libvirt" / "libvirtd.pid").read_text())

    killed = daemon()
    assert _uid_of(str(killed)) == uid and _comm(str(killed)) == "libvirtd"
    os.kill(killed, 9)
    status = root_launcher(cache, "status", "a")
    assert (status.returncode, status.stdout.strip()) == (0, "running"), status.stderr
    again = daemon()
    assert again != killed and _uid_of(str(again)) == uid and _comm(str(again)) == "libvirtd"
    assert Path(f"/proc/{again}/uid_map").read_text().split() == [str(QEMU_UID), str(uid), "1"]
    assert ids(a.qemu_pid)[0] == uid  # the same qemu, still running


def test_stopping_a_vm_gives_its_uid_back(pair):
    cache, vms = pair
    b = vms["b"]
    uid = b.record["vmUser"]["uid"]
    stopped = root_launcher(cache, "stop", "b")
    assert stopped.returncode == 0 and stopped.stdout.strip() == "VM b was stopped", stopped.stderr
    assert not b.home.exists() and not (VMS_DIR / f"{uid}.json").exists()
    assert processes_of_uid(uid) == []
    assert DONE in root_launcher(cache, "logs", "a").stdout  # the other VM goes on


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _uid_of(pid: str) -> int | None:
    try:
        return ids(int(pid))[0]
    except (OSError, StopIteration):
        return None


# ---------------------------------------------------------------- the pieces, without a VM

def test_a_slot_is_never_one_a_user_a_group_or_a_subordinate_range_names():
    """Whoever holds a slot's ids could act as its VM: a user or group with the uid, or a subordinate
    range (a rootless container's ids) over any of the slot's block."""
    assert vmuser.host_uid(1) == 65536 + QEMU_UID and vmuser.host_uid(2) == 2 * 65536 + QEMU_UID
    ranges = vmuser.subordinate_ranges("alice:100000:65536\n# comment\nbob:165536:65536\nbroken:x:1\n")
    assert ranges == [(100000, 65536), (165536, 65536)]
    assert not vmuser.usable(1, set(), set(), ranges)  # 65536..131071: alice's from 100000
    assert not vmuser.usable(2, set(), set(), ranges)  # 131072..196607: alice's and bob's ids
    assert not vmuser.usable(3, set(), set(), ranges)  # 196608..262143: bob's up to 231071
    assert vmuser.usable(4, set(), set(), ranges) and vmuser.usable(1, set(), set(), [])
    assert not vmuser.usable(4, {vmuser.host_uid(4)}, set(), [])
    assert not vmuser.usable(4, set(), {vmuser.host_uid(4)}, [])


def test_disks_from_outside_the_run_directory_are_handed_open(tmp_path):
    """What qemu opens by name stays in its run directory; every other disk file is opened by root, read-
    only unless the guest writes it, a link in its directory refused; a block device gets a node of the
    VM's own, the kernel a copy."""
    run_dir, outside = tmp_path / "run", tmp_path / "claims"
    run_dir.mkdir()
    outside.mkdir()
    for name in ("base.img", "claim.img", "ro.img", "vmlinuz"):
        (outside / name).write_bytes(name.encode())
    (run_dir / "root").mkdir()
    disks = {
        "root": ResolvedDisk(str(run_dir / "root" / "disk.qcow2"), "qcow2", backing=(str(outside / "base.img"), "qcow2")),
        "data": ResolvedDisk(str(outside / "claim.img"), "raw", relabel=False),
        "ro": ResolvedDisk(str(outside / "ro.img"), "raw"),
    }
    block = next(p for p in Path("/dev").iterdir() if stat.S_ISBLK(p.stat().st_mode))
    disks["blk"] = ResolvedDisk(str(block), "raw", type="block")
    handed = diskfds.hand_over(disks, run_dir, kernel=str(outside / "vmlinuz"), read_only={"ro"})
    try:
        modes = {group: [fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE for fd in fds] for group, fds in handed.fds.items()}
        assert modes == {"root-base": [os.O_RDONLY], "data": [os.O_RDWR], "ro": [os.O_RDONLY]}
        assert os.read(handed.fds["data"][0], 9) == b"claim.img"
        root = handed.disks["root"]
        assert (root.path, root.fd_group, root.backing_fd_group) == (disks["root"].path, None, "root-base")
        assert handed.disks["data"].fd_group == "data" and handed.disks["ro"].fd_group == "ro"
        node = Path(handed.disks["blk"].path)
        assert node.parent == run_dir / diskfds.DEVICES_DIR and handed.disks["blk"].fd_group is None
        st = node.lstat()
        assert stat.S_ISBLK(st.st_mode) and st.st_rdev == block.stat().st_rdev and stat.S_IMODE(st.st_mode) == 0o600
        assert Path(handed.kernel).parent == run_dir / diskfds.KERNEL_DIR and Path(handed.kernel).read_bytes() == b"vmlinuz"
    finally:
        handed.close()
    # A link where a claim's disk.img was: refused, its target never opened.
    (outside / "claim.img").unlink()
    (outside / "claim.img").symlink_to("/etc/shadow")
    with pytest.raises(DiskkitError, match="symbolic link"):
        diskfds.hand_over({"data": disks["data"]}, tmp_path / "run2")


def test_a_root_cache_made_before_lets_each_vm_through_its_run_directory(tmp_path):
    """A root cache made when every qemu was 107 has run/ 0750 in qemu's group, plus 107 by an ACL: no
    VM's own uid could pass. Opened again by root it becomes 0711, the ACL gone; disks/ keeps its mode
    (VMs started before may still read their base through it) and is named by the warning."""
    cache = tmp_path / "old"
    for sub in ("", "run", "disks"):
        (cache / sub).mkdir(exist_ok=True)
        (cache / sub).chmod(0o750 if sub else 0o711)
    for sub in ("run", "disks"):
        os.setxattr(cache / sub, ACL, acl_granting(QEMU_UID, 0o750))
    opened = Cache(cache)
    st = (cache / "run").stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o711)
    assert ACL not in os.listxattr(cache / "run") and ACL in os.listxattr(cache / "disks")
    assert stat.S_IMODE((cache / "disks").stat().st_mode) == 0o750 and opened.too_open() == [str(cache / "disks")]


ACL = "system.posix_acl_access"


def acl_granting(uid: int, mode: int) -> bytes:
    """The xattr of a POSIX access ACL: the mode's owner, group and other entries, `uid` with the
    group's bits, and the mask (linux/posix_acl_xattr.h, version 2)."""
    undefined = 0xFFFFFFFF
    owner, group, other = (mode >> 6) & 7, (mode >> 3) & 7, mode & 7
    entries = [(0x01, owner, undefined), (0x02, group, uid), (0x04, group, undefined), (0x10, group, undefined), (0x20, other, undefined)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)
