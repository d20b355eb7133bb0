"""virtiofs filesystems (spec.domain.devices.filesystems): KubeVirt's admission rules, the real
guest reading a claim's directory and a ConfigMap's files over virtiofs, with no virtiofsd left after,
and a hostile guest that tries to reach the host through its shares.

virtiofsd runs as root of a user namespace that is the qemu user outside (launcher.runtime.virtiofs,
as KubeVirt's non-root virtiofsd: securityContextVirtioFS in pkg/virt-controller/services/virtiofs.go),
so both a root launcher and an unprivileged one serve filesystems. The root VM tests run against the
qemu user's libvirt session daemon (its socket given in the URI): qemu runs as UID 107, fast.
`qemu:///session` as root is the system daemon (34-68 s per start here), so it is not used.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from diskkit.errors import DiskkitError
from launcher.runtime import virtiofs
from launcher.spec.fields import SpecError
from launcher.spec.vmi import parse_vmi
from launcher.volumes.context import Share
from launcher.volumes.filesystems import give_share
from tests.conftest import launcher_command, run_launcher
from tests.testguest import parse_console
from tests.vmhost import NOREG, QEMU_UID, assert_clean, qemu_scratch

VIRTIOFSD = "/usr/lib/qemu/virtiofsd"
OLD_LOCK_DIR = Path("/run/virtiofsd")  # where virtiofsd keeps a pid lock per --socket-path
NOBODY = 65534


# ---------------------------------------------------------------- admission (pure)

def doc(filesystems, volumes, disks=()):
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "fs"},
        "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}},
                            "devices": {"disks": [{"name": "root"}, *disks], "filesystems": filesystems}},
                 "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/x/y:1"}}, *volumes]},
    }


PVC = {"name": "data", "persistentVolumeClaim": {"claimName": "data"}}
FS = {"name": "data", "virtiofs": {}}


def error(filesystems, volumes, disks=()) -> str:
    with pytest.raises(SpecError) as err:
        parse_vmi(doc(filesystems, volumes, disks))
    return str(err.value)


def test_a_volume_a_filesystem_uses_gets_no_disk():
    vmi = parse_vmi(doc([FS], [PVC]))
    assert [d.name for d in vmi.domain.devices.disks] == ["root"]  # util.SetDefaultVolumeDisk skips it
    assert [f.name for f in vmi.domain.devices.filesystems] == ["data"]
    bare = parse_vmi(doc([], [PVC]))
    assert [d.name for d in bare.domain.devices.disks] == ["root", "data"]  # without the filesystem: a disk


def test_filesystem_rules():
    assert error([FS, FS], [PVC]) == ("spec.domain.devices.filesystems[1].name: spec.domain.devices.filesystems[1] and"
                                      " spec.domain.devices.filesystems[0] must not have the same Name.")
    assert error([{"name": "data"}], [PVC]) == "spec.domain.devices.filesystems[0].virtiofs: required: virtiofs is the only filesystem type"
    assert error([{"name": "nope", "virtiofs": {}}], [PVC]) == (
        "spec.domain.devices.filesystems[0].name: spec.domain.devices.filesystems[0].Name 'nope' not found.")
    assert error([FS], [PVC], [{"name": "data"}]) == (
        "spec.domain.devices.filesystems[0].name: volume data is already used by spec.domain.devices.disks[1]:"
        " a volume backs one disk or one filesystem")
    assert error([FS], [{"name": "data", "emptyDisk": {"capacity": "1Mi"}}]).startswith(
        "spec.domain.devices.filesystems[0].name: emptyDisk volumes cannot be shared as a filesystem")
    for kind, source in (("dataVolume", {"name": "dv"}), ("configMap", {"name": "c"}), ("secret", {"secretName": "s"}),
                         ("serviceAccount", {"serviceAccountName": "sa"}), ("downwardAPI", {"fields": []})):
        assert parse_vmi(doc([FS], [{"name": "data", kind: source}])).domain.devices.filesystems


# ---------------------------------------------------------------- end to end

def virtiofsd_pids(under: Path) -> list[int]:
    """virtiofsd processes serving a socket under `under` (two per socket: sandbox=namespace forks)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline and cmdline[0] == VIRTIOFSD.encode() and any(str(under).encode() in arg for arg in cmdline):
            found.append(int(proc.name))
    return found


def write_shared_vmi(qemu_user, guest_image, name: str, hold: int = 0) -> tuple[Path, Path, Path]:
    claim = qemu_user.root / f"{name}-claim"
    claim.mkdir()
    (claim / "hello.txt").write_text("hello from the claim\nsecond line\n")
    manifests = qemu_user.root / f"{name}-manifests"
    manifests.mkdir()
    (manifests / "cm.json").write_text(json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                                                   "metadata": {"name": "app-config", "namespace": "default"},
                                                   "data": {"greeting": "hi over virtiofs"}}))
    extra = [({"name": "fs0", "virtiofs": {}}, {"name": "fs0", "persistentVolumeClaim": {"claimName": "shared"}}),
             ({"name": "fs1", "virtiofs": {}}, {"name": "fs1", "configMap": {"name": "app-config"}})]
    disks = []
    volumes = [v for _, v in extra]
    if hold:
        disks.append({"name": "hold", "serial": f"hold-{hold}", "disk": {"bus": "virtio"}})
        volumes.append({"name": "hold", "emptyDisk": {"capacity": "1Mi"}})
    vmi_path = qemu_user.write_vmi(name, guest_image)
    vmi = json.loads(vmi_path.read_text())
    vmi["spec"]["domain"]["devices"]["disks"] += disks
    vmi["spec"]["domain"]["devices"]["filesystems"] = [fs for fs, _ in extra]
    vmi["spec"]["volumes"] += volumes
    vmi_path.write_text(json.dumps(vmi))
    return vmi_path, claim, manifests


def virtiofsd_sockets(under: Path) -> set[str]:
    """The sockets served under `under`, named by the mount point each virtiofsd serves (NAME.root)."""
    sockets = set()
    for pid in virtiofsd_pids(under):
        with contextlib.suppress(OSError):
            sockets.update(str(Path(a.decode().split("=", 1)[1]).with_suffix(".sock"))
                           for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a.startswith(b"source="))
    return sockets


def virtiofsd_locks(under: Path) -> list[Path]:
    """Pid locks in /run/virtiofsd for sockets under `under` (virtiofsd takes none when given --fd)."""
    return list(OLD_LOCK_DIR.glob(str(under).replace("/", ".") + "*"))


def root_launcher(cache: Path, *args, timeout: float = 400):
    return run_launcher(*args, env={"DISKKIT_CACHE": str(cache)}, timeout=timeout)


def shared_console(result) -> dict:
    """The console of a run of write_shared_vmi's VM: the claim (fs0) read and written, the ConfigMap (fs1) read only."""
    assert result.code == 0, result.err
    console = parse_console(result.out)
    assert console["done"], result.out[-2000:]
    assert console["filesystems"]["fs0"]["files"]["/hello.txt"] == "hello from the claim\nsecond line\n"
    assert console["filesystems"]["fs1"]["files"]["/greeting"] == "hi over virtiofs\n"
    assert console["filesystems"]["fs0"]["wrote"]
    assert not console["filesystems"]["fs1"]["wrote"]  # a ConfigMap is read-only, as the kubelet mounts it
    return console


def test_guest_reads_a_claim_and_a_configmap_over_virtiofs(qemu_user, guest_image, root_side):
    cache, uri = root_side
    vmi, claim, manifests = write_shared_vmi(qemu_user, guest_image, "shared")
    result = root_launcher(cache, "run", NOREG, "--console", "--timeout", "300", "--connect", uri,
                           "--pvc", f"shared={claim}", "--manifests", manifests, vmi)
    console = shared_console(result)
    assert (claim / "guest-wrote").read_text() == "written by the guest\n"  # the claim's directory itself is shared
    assert not (claim / "disk.img").exists()
    assert not [w for w in console["warnings"] if "virtiofs" in w], console["warnings"]
    assert set(console["disks"]) == {"vda"}  # neither shared volume became a disk
    assert virtiofsd_pids(cache) == []
    assert virtiofsd_locks(cache) == []
    assert not (cache / "run" / "default_shared").exists()
    assert "default_shared" not in qemu_user.virsh("list", "--all", "--name").split()


def test_launcher_stop_ends_the_virtiofsd_of_a_running_vm(qemu_user, guest_image, root_side):
    cache, uri = root_side
    vmi, claim, manifests = write_shared_vmi(qemu_user, guest_image, "held", hold=120)
    started = root_launcher(cache, "run", NOREG, "--wait-for", "DISKKIT-TESTGUEST DONE", "--timeout", "300", "--connect", uri,
                            "--pvc", f"shared={claim}", "--manifests", manifests, vmi)
    assert started.code == 0, started.err
    assert {s.rsplit("/", 1)[1] for s in virtiofsd_sockets(cache)} == {"fs0.sock", "fs1.sock"}  # one per filesystem, outliving the launcher
    stopped = root_launcher(cache, "stop", "held")
    assert stopped.code == 0, stopped.err
    assert virtiofsd_pids(cache) == []
    assert virtiofsd_locks(cache) == []
    assert not list((cache / "run").glob("default_held*"))
    assert "default_held" not in qemu_user.virsh("list", "--all", "--name").split()


def test_sigterm_ends_the_virtiofsd(qemu_user, guest_image, root_side):
    cache, uri = root_side
    vmi, claim, manifests = write_shared_vmi(qemu_user, guest_image, "termed", hold=120)
    proc = subprocess.Popen(launcher_command("run", NOREG, "--console", "--timeout", "300", "--grace-period", "2", "--connect", uri,
                                             "--pvc", f"shared={claim}", "--manifests", manifests, vmi),
                            env={**os.environ, "CI": "true", "DISKKIT_CACHE": str(cache)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    out = ""
    while "HOLD seconds=" not in out and time.monotonic() < deadline:  # the guest is up, its shares read
        line = proc.stdout.readline()
        if not line:
            break
        out += line
    assert "HOLD seconds=" in out, out[-2000:] + proc.stderr.read()
    assert {s.rsplit("/", 1)[1] for s in virtiofsd_sockets(cache)} == {"fs0.sock", "fs1.sock"}
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert virtiofsd_pids(cache) == []
    assert not (cache / "run" / "default_termed").exists()


def test_unprivileged_launcher_serves_filesystems(qemu_user, guest_image):
    """An unprivileged launcher (uid 107) serves a claim and a ConfigMap: virtiofsd needs no host root.
    The hostile guest (attack-fs) gets no device node, no file of another owner, no write to the ConfigMap."""
    vmi_path, claim, manifests = write_shared_vmi(qemu_user, guest_image, "unpriv")
    os.chown(claim, QEMU_UID, QEMU_UID)
    vmi = json.loads(vmi_path.read_text())
    vmi["spec"]["domain"]["devices"]["disks"].append({"name": "attack", "serial": "attack-fs", "disk": {"bus": "virtio"}})
    vmi["spec"]["volumes"].append({"name": "attack", "emptyDisk": {"capacity": "1Mi"}})
    vmi_path.write_text(json.dumps(vmi))
    result = qemu_user.launcher("run", NOREG, "--console", "--timeout", "300", "--pvc", f"shared={claim}", "--manifests", manifests, vmi_path)
    console = shared_console(result)
    errors = console["attack_errors"]
    assert console["attacks"][("fs0", 0, "write")]
    assert errors[("fs0", 0, "mknod-char")] == errors[("fs0", 0, "mknod-block")] == "Operation not permitted"
    assert errors[("fs0", 0, "chown-other")] == "Invalid argument"  # 1234 is no id of the namespace
    assert errors[("fs1", 0, "write")] == "Read-only file system"
    assert not any(ok for (tag, _, _), ok in console["attacks"].items() if tag == "fs1")
    for entry in claim.iterdir():
        st = entry.lstat()
        if entry.name != "hello.txt":  # the test's, as root
            assert (st.st_uid, st.st_gid) == (QEMU_UID, QEMU_UID), entry  # the launcher's own ids (setpriv --regid=107)
        assert not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)), entry
    assert stat.S_IMODE(claim.stat().st_mode) == 0o700
    assert virtiofsd_pids(qemu_user.cache) == []
    assert_clean(qemu_user, "default_unpriv")


@pytest.fixture
def scratch():
    """A directory the qemu user (whom virtiofsd runs as) can reach; pytest's tmp_path is root's alone."""
    with qemu_scratch("virtiofs-") as root:
        yield root


def test_stop_ends_a_virtiofsd_no_qemu_ever_connected_to(scratch):
    # A virtiofsd ends by itself when its qemu disconnects; one that never got a qemu (the domain did
    # not start) only ends when the launcher ends it.
    vmi = parse_vmi(doc([FS], [PVC]))
    tmp_path = scratch
    share = tmp_path / "share"
    share.mkdir()
    run_dir = tmp_path / "run"
    daemons = virtiofs.start(vmi, {"data": Share(share)}, run_dir)
    assert [d["name"] for d in daemons] == ["data"]
    assert virtiofsd_sockets(tmp_path) == {f"{run_dir}/virtiofs/data.sock"}
    assert Path(daemons[0]["socket"]).is_socket()
    status = Path(f"/proc/{daemons[0]['pid']}/status").read_text()
    assert "\nUid:\t107\t107\t107\t107\n" in status, status  # the qemu user outside its namespace, never host root
    assert Path(f"/proc/{daemons[0]['pid']}/uid_map").read_text().split() == ["0", "107", "1"]  # its root is 107, and no one else
    assert Path(f"/proc/{daemons[0]['pid']}/gid_map").read_text().split() == ["0", "107", "1"]
    assert virtiofsd_locks(tmp_path) == []
    virtiofs.stop(daemons)
    assert virtiofsd_pids(tmp_path) == []
    assert not Path(daemons[0]["socket"]).exists()


def test_virtiofsd_command():
    """As root: become the owner first, so the namespace is the owner's; unprivileged: already are.
    A read-only share's bind mount is ro; every share's nosuid,nodev."""
    root = virtiofs.command(Path("/claim"), Path("/run/x.root"), True, 5, (107, 108), euid=0)
    assert root[:root.index("unshare")] == ["setpriv", "--reuid", "107", "--regid", "108", "--clear-groups", "--no-new-privs", "--"]
    assert root[root.index("/claim") + 2] == "nosuid,nodev,ro"
    assert root[-7:] == [VIRTIOFSD, "--fd=5", "-o", "source=/run/x.root", "-o", "cache=auto", "-f"]
    user = virtiofs.command(Path("/claim"), Path("/run/x.root"), False, 5, (107, 108), euid=107)
    assert user[:user.index("unshare")] == ["setpriv", "--no-new-privs", "--"]
    assert user[user.index("/claim") + 2] == "nosuid,nodev"


def test_virtiofsd_never_runs_as_host_root(scratch):
    """qemu.conf's user root would make the namespace root's: refused, nothing started."""
    vmi = parse_vmi(doc([FS], [PVC]))
    with pytest.raises(DiskkitError) as err:
        virtiofs.start(vmi, {"data": Share(scratch)}, scratch / "run", (0, 0))
    assert str(err.value) == ("spec.domain.devices.filesystems[0]: filesystem data: qemu runs as root here, and virtiofsd runs"
                              " as the qemu user; set a user in qemu.conf")
    assert virtiofsd_pids(scratch) == []


def test_a_share_virtiofsd_cannot_mount_is_one_line(scratch):
    """A share the qemu user cannot reach (under a root-only directory) ends in one line naming it, no virtiofsd left."""
    vmi = parse_vmi(doc([FS], [PVC]))
    tmp_path = scratch
    hidden = tmp_path / "hidden"
    share = hidden / "share"
    share.mkdir(parents=True)
    hidden.chmod(0o700)
    with pytest.raises(DiskkitError) as err:
        virtiofs.start(vmi, {"data": Share(share, read_only=True)}, tmp_path / "run")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"spec.domain.devices.filesystems[0]: virtiofsd for {share}, run as uid 107, exited ("), message
    assert message.endswith(f"stat: cannot statx '{share}/': Permission denied"), message
    assert virtiofsd_pids(tmp_path) == []


def test_a_shared_directory_is_given_to_the_qemu_user_alone(tmp_path):
    """A root launcher gives a root-owned claim directory to the qemu user, mode 0700; another local
    user's directory, or a symbolic link planted where the claim is, is refused in one line."""
    owner = (QEMU_UID, QEMU_UID)
    mine = tmp_path / "root-claim"
    mine.mkdir(mode=0o755)
    give_share(mine, owner, "here")
    st = mine.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (QEMU_UID, QEMU_UID, 0o700)
    theirs = tmp_path / "nobody-claim"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(DiskkitError) as err:
        give_share(theirs, owner, "here")
    assert str(err.value) == (f"here: shared directory {theirs} belongs to uid {NOBODY}; virtiofsd serves it as uid 107"
                              " (the qemu user), so it must belong to that user or to root")
    assert (theirs.stat().st_uid, stat.S_IMODE(theirs.stat().st_mode)) == (NOBODY, 0o755)
    target = tmp_path / "root-only"
    target.mkdir(mode=0o711)
    link = tmp_path / "link-claim"
    link.symlink_to(target)
    with pytest.raises(DiskkitError) as err:
        give_share(link, owner, "here")
    assert "a symbolic link is not followed" in str(err.value)
    assert (target.stat().st_uid, stat.S_IMODE(target.stat().st_mode)) == (0, 0o711)


def test_a_domain_that_does_not_start_leaves_no_virtiofsd(qemu_user, guest_image, root_side):
    # qemu never connects, so nothing but the launcher ends the virtiofsd (after a run, qemu's
    # disconnect ends it too): more memory than qemu's CPU can address makes the start fail after them.
    cache, uri = root_side
    vmi_path, claim, manifests = write_shared_vmi(qemu_user, guest_image, "nostart")
    vmi = json.loads(vmi_path.read_text())
    vmi["spec"]["domain"]["resources"]["requests"]["memory"] = "4Ti"
    vmi_path.write_text(json.dumps(vmi))
    result = root_launcher(cache, "run", NOREG, "--timeout", "120", "--connect", uri,
                           "--pvc", f"shared={claim}", "--manifests", manifests, vmi_path)
    assert result.code != 0
    assert "the domain did not start" in result.err, result.err
    assert virtiofsd_sockets(cache) == set()
    assert not (cache / "run" / "default_nostart").exists()


def test_gc_leaves_no_virtiofsd_of_a_vm_that_ended(qemu_user, guest_image, root_side):
    cache, uri = root_side
    vmi, claim, manifests = write_shared_vmi(qemu_user, guest_image, "collected", hold=120)
    started = root_launcher(cache, "run", NOREG, "--wait-for", "DISKKIT-TESTGUEST DONE", "--timeout", "300", "--connect", uri,
                            "--pvc", f"shared={claim}", "--manifests", manifests, vmi)
    assert started.code == 0, started.err
    assert len(virtiofsd_sockets(cache)) == 2
    qemu_user.virsh("destroy", "default_collected")  # the VM ends behind the launcher's back
    collected = root_launcher(cache, "gc")
    assert collected.code == 0, collected.err
    assert virtiofsd_pids(cache) == []
    assert virtiofsd_locks(cache) == []
    assert not (cache / "vms" / "default_collected.json").exists()
    assert not (cache / "run" / "default_collected").exists()


def test_timeout_leaves_no_virtiofsd(qemu_user, guest_image, root_side):
    cache, uri = root_side
    vmi, claim, manifests = write_shared_vmi(qemu_user, guest_image, "timed", hold=120)
    # Meant to expire: long enough for the domain and its virtiofsd to start (seconds here), no longer.
    result = root_launcher(cache, "run", NOREG, "--timeout", "15", "--connect", uri,
                           "--pvc", f"shared={claim}", "--manifests", manifests, vmi)
    assert result.code != 0
    assert "the VM was still running after 15 s; the domain was destroyed" in result.err, result.err
    assert virtiofsd_pids(cache) == []
    assert virtiofsd_locks(cache) == []
    assert not (cache / "run" / "default_timed").exists()


# ---------------------------------------------------------------- a hostile guest

def as_nobody(*cmd) -> subprocess.CompletedProcess:
    """Another local user's try. Through a shell: setpriv's own execve still resolves the path with
    root's capabilities here (it ran a file in a 0700 directory of another user's)."""
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
                           "/bin/sh", "-c", '"$@"', "sh", *map(str, cmd)], capture_output=True, text=True)


def tree(root: Path) -> dict[str, tuple[int, int, int, bytes | None]]:
    """Every entry under root: (uid, gid, mode, content of a regular file)."""
    found = {}
    for parent, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = Path(parent) / name
            st = path.lstat()
            found[str(path.relative_to(root))] = (st.st_uid, st.st_gid, st.st_mode,
                                                  path.read_bytes() if stat.S_ISREG(st.st_mode) else None)
    return found


def test_a_hostile_guest_stays_in_its_shares(qemu_user, guest_image, root_side):
    """Attacks by a guest root on its virtiofs shares (issue 29, 2 and 7): a setuid busybox, one given to
    root, files given to another owner, char and block device nodes, a link to /etc/shadow, writes and
    chmods of the host's files; in read-only shares (ConfigMap, Secret, a readOnly claim) the same again
    as the share owner's uid and as 107. On the host: nothing setuid but the qemu user's, no device node,
    every new file the qemu user's, nothing written in a read-only share, and another local user reaches
    nothing in the claim. (virtiofsd ran as host root: the guest left a setuid-root binary nobody ran.)"""
    cache, uri = root_side
    vmi_path, claim, manifests = write_shared_vmi(qemu_user, guest_image, "hostile", hold=120)
    (manifests / "secret.json").write_text(json.dumps({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "app-secret", "namespace": "default"},
        "data": {"token": base64.b64encode(b"s3cret\n").decode()}}))
    ro_claim = qemu_user.root / "hostile-ro-claim"
    ro_claim.mkdir()
    (ro_claim / "ro.txt").write_text("the host's, read-only\n")
    for path in (ro_claim, ro_claim / "ro.txt"):  # written by the qemu user before: only the read-only mount stops the guest
        os.chown(path, QEMU_UID, QEMU_UID)
    vmi = json.loads(vmi_path.read_text())
    devices = vmi["spec"]["domain"]["devices"]
    devices["filesystems"] += [{"name": "fs2", "virtiofs": {}}, {"name": "fs3", "virtiofs": {}}]
    devices["disks"].append({"name": "attack", "serial": "attack-fs", "disk": {"bus": "virtio"}})
    vmi["spec"]["volumes"] += [{"name": "fs2", "persistentVolumeClaim": {"claimName": "ro", "readOnly": True}},
                               {"name": "fs3", "secret": {"secretName": "app-secret"}},
                               {"name": "attack", "emptyDisk": {"capacity": "1Mi"}}]
    vmi_path.write_text(json.dumps(vmi))
    claim_before = tree(claim)
    ro_before = tree(ro_claim)
    started = root_launcher(cache, "run", NOREG, "--wait-for", "DISKKIT-TESTGUEST DONE", "--timeout", "300", "--connect", uri,
                            "--pvc", f"shared={claim}", "--pvc", f"ro={ro_claim}", "--manifests", manifests, vmi_path)
    assert started.code == 0, started.err
    run_dir = cache / "run" / "default_hostile"
    try:
        console = parse_console((run_dir / "console" / "console.log").read_text(errors="replace"))
        attacks = console["attacks"]

        # The writable claim: the guest writes, but only as the qemu user, and nobody else gets in.
        assert attacks[("fs0", 0, "write")] and attacks[("fs0", 0, "setuid")], attacks  # the guest did attack
        for what in ("mknod-char", "mknod-block", "chown-other"):
            assert not attacks[("fs0", 0, what)], what
        after = tree(claim)
        assert after["hello.txt"] == claim_before["hello.txt"]  # the host's file, not the qemu user's to change
        new = {name: entry for name, entry in after.items() if name not in claim_before}
        assert "attack-0-suid" in new and "attack-0-link" in new, sorted(new)
        for name, (uid, gid, mode, _) in after.items():
            assert not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)), f"device node {name}"
            assert not (mode & stat.S_ISUID and uid != QEMU_UID), f"setuid {name} of uid {uid}"
            assert not (mode & stat.S_ISGID and gid != QEMU_UID), f"setgid {name} of gid {gid}"
        for name, (uid, gid, _, _) in new.items():
            assert (uid, gid) == (QEMU_UID, QEMU_UID), f"{name} is {uid}:{gid}"
        st = claim.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (QEMU_UID, 0o700)
        assert as_nobody("ls", claim).returncode != 0
        ran = as_nobody(claim / "attack-0-suid", "id", "-u")
        assert ran.returncode != 0 and "Permission denied" in ran.stderr, (ran.stdout, ran.stderr)

        # Read-only shares: every try fails, as root, as the share's owner and as 107, and nothing changed.
        for tag in ("fs1", "fs2", "fs3"):
            tried = {key: ok for key, ok in attacks.items() if key[0] == tag}
            assert {uid for _, uid, _ in tried} >= {0, 107}, tried
            assert {what for _, _, what in tried} >= {"write", "setuid", "mknod-char", "symlink", "append", "chmod"}, tried
            assert not any(tried.values()), {key: ok for key, ok in tried.items() if ok}
            for what in ("write", "setuid", "mknod-char", "mknod-block", "symlink", "append", "chmod"):  # the mount, not permissions
                assert console["attack_errors"][(tag, 0, what)] == "Read-only file system", (tag, what, console["attack_errors"])
        assert tree(ro_claim) == ro_before
        shares = run_dir / "virtiofs-shares"
        assert {name: entry[3] for name, entry in tree(shares / "fs1").items()} == {"greeting": b"hi over virtiofs"}
        assert {name: entry[3] for name, entry in tree(shares / "fs3").items()} == {"token": b"s3cret\n"}
        # The config shares live in the VM's run directory (root's, which qemu's group only traverses),
        # each the qemu user's, 0700.
        st = run_dir.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, QEMU_UID, 0o710)
        st = (shares / "fs3").stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (QEMU_UID, 0o700)
        assert as_nobody("cat", shares / "fs3" / "token").returncode != 0
    finally:
        stopped = root_launcher(cache, "stop", "hostile")
    assert stopped.code == 0, stopped.err
    assert virtiofsd_pids(cache) == []
