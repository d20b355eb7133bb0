"""The launcher as root through libvirt's system daemon (`qemu:///system`), where qemu runs as the
user and group of qemu.conf (Debian's build default: libvirt-qemu), neither root nor KubeVirt's 107.

Each libvirt start as root re-probes QEMU here (34-68 s), so the module boots twice: a pulled
containerDisk, and a lazy one served over NBD by the disk server `launcher run` starts."""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from diskkit.errors import DiskkitError
from launcher.diskserver.qemuid import is_system_uri, system_qemu_ids
from launcher.runtime.virtiofs import SOCKETS_DIR
from launcher.volumes.files import qemu_owner
from tests.conftest import run_diskkit
from tests.lazyhost import control, stop_spawned_server
from tests.systemlibvirt import system_libvirtd
from tests.testguest import ensure_testguest, parse_console
from tests.vmhost import DONE, NOREG

TIMEOUT = "900"
KUBEVIRT_QEMU = (107, 107)  # two QEMU probes (capabilities, then the domain's own start) on a shared 2-core machine


def test_qemu_conf_user_and_group(tmp_path):
    conf = tmp_path / "qemu.conf"
    conf.write_text("")  # unset: libvirt's build default, libvirt-qemu on Debian (user and group each looked up)
    assert system_qemu_ids(conf) == (pwd.getpwnam("libvirt-qemu").pw_uid, grp.getgrnam("libvirt-qemu").gr_gid)
    conf.write_text('#user = "root"\nuser = "+4242"\ngroup = "kvm"  # as on some hosts\n')
    assert system_qemu_ids(conf) == (4242, grp.getgrnam("kvm").gr_gid)
    conf.write_text('user = "4343"\ngroup = "4444"\n')  # numbers that name no one are IDs
    assert system_qemu_ids(conf) == (4343, 4444)
    conf.write_text('user = "no-such-qemu-user"\n')
    with pytest.raises(DiskkitError, match=r"qemu.conf: user: user 'no-such-qemu-user' does not exist"):
        system_qemu_ids(conf)


def test_run_directory_owner_follows_the_daemon():
    for uri in ("qemu:///system", "qemu+unix:///system?socket=/run/libvirt/libvirt-sock"):
        assert is_system_uri(uri)
        assert qemu_owner(uri) == system_qemu_ids()
    for uri in ("qemu:///session", "qemu+unix:///session?socket=/home/q/.cache/libvirt/libvirt-sock", "qemu+ssh://host/system", "test:///system"):
        assert not is_system_uri(uri)
    assert qemu_owner("qemu:///session") == KUBEVIRT_QEMU  # a root launcher on the qemu user's session daemon
    # A user in the libvirt group may use the system daemon too: it gives nothing away, and must not
    # need qemu.conf, which only root reads on Debian.
    code = "from launcher.volumes.files import qemu_owner; print(qemu_owner('qemu:///system'))"
    as_qemu = subprocess.run(["setpriv", "--reuid=107", "--regid=107", "--clear-groups", sys.executable, "-c", code],
                             capture_output=True, text=True, check=False)
    assert (as_qemu.returncode, as_qemu.stdout) == (0, "(107, 107)\n"), as_qemu.stderr


@pytest.fixture(scope="module")
def daemon():
    with system_libvirtd() as d:
        yield d


@pytest.fixture(scope="module")
def cache(daemon) -> Path:
    path = daemon.root / "cache"
    path.mkdir()
    return path


def write_vmi(where: Path, name: str, image: str, cloud_init: str | None = None, config_map: str | None = None, hold: int = 0) -> Path:
    """A VMI booting `image`, with a cloud-init disk and a ConfigMap shared over virtiofs if asked; a guest
    held `hold` seconds after DONE (until `launcher stop` presses its power button) if asked."""
    root = {"name": "root", "disk": {"bus": "virtio"}} | ({"serial": f"hold-{hold}"} if hold else {})
    disks, volumes = [root], [{"name": "root", "containerDisk": {"image": image}}]
    devices: dict = {"disks": disks}
    if cloud_init is not None:
        disks.append({"name": "ci", "disk": {"bus": "virtio"}})
        volumes.append({"name": "ci", "cloudInitNoCloud": {"userData": cloud_init}})
    if config_map is not None:
        devices["filesystems"] = [{"name": "fs0", "virtiofs": {}}]
        volumes.append({"name": "fs0", "configMap": {"name": config_map}})
    vmi = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name},
        "spec": {"domain": {"resources": {"requests": {"memory": "128Mi"}}, "devices": devices}, "volumes": volumes},
    }
    path = where / f"{name}.yaml"
    path.write_text(json.dumps(vmi))  # JSON is YAML
    return path


def boot(daemon, cache: Path, vmi: Path, *args: str) -> dict:
    result = daemon.launcher("run", NOREG, "--console", "--timeout", TIMEOUT, *args, vmi, env={"DISKKIT_CACHE": str(cache)})
    assert result.code == 0, f"{result.err}\n{daemon.log[-4000:]}"
    console = parse_console(result.out)
    assert console["ready"] and console["done"], result.out
    assert console["disks"]["vda"]["head"].startswith("33c0"), console  # the guest's own MBR
    return console


def assert_gone(daemon, cache: Path, domain: str) -> None:
    assert domain not in daemon.domains()
    assert not (cache / "run" / domain).exists()
    assert not (cache / "vms" / f"{domain}.json").exists()


def test_pulled_container_disk_boots_as_root_through_the_system_daemon(daemon, cache, guest_image):
    user_data = "#cloud-config\npassword: s3cret-of-the-vm\n"
    manifests = daemon.root / "manifests"
    manifests.mkdir()
    (manifests / "cm.json").write_text(json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app-config", "namespace": "default"},
                                                   "data": {"greeting": "hi over virtiofs"}}))
    # Held, so qemu still has the files open while they are looked at: once it ends, libvirt gives them
    # back to root (remember_owner = 0, see tests.systemlibvirt) and the test would race the guest's power-off.
    vmi = write_vmi(daemon.root, "sys-pulled", guest_image, cloud_init=user_data, config_map="app-config", hold=600)
    # --wait-for: the run directory stays until `launcher stop`, to be looked at
    console = boot(daemon, cache, vmi, "--wait-for", DONE, "--manifests", str(manifests))
    assert console["disks"]["vda"]["size"] == 64 << 20
    assert console["isos"]["vdb"]["files"]["/user-data"] == user_data  # qemu, as libvirt-qemu, read the ISO
    assert console["filesystems"]["fs0"]["files"]["/greeting"] == "hi over virtiofs\n"  # and reached virtiofsd's socket

    # qemu runs as the VM's own uid (a static DAC label; launcher.runtime.vmuser), not as qemu.conf's user
    # every VM would share, and every file in the run directory is that uid's; its directories are root's,
    # which the VM's group only traverses (launcher.runtime.rundir): the ISO with the password is no one
    # else's to read, not qemu.conf's user's, not KubeVirt's qemu's (107).
    run_dir = cache / "run" / "default_sys-pulled"
    uid = json.loads((cache / "vms" / "default_sys-pulled.json").read_text())["vmUser"]["uid"]
    owner = (uid, uid)
    [qemu] = [p for p in Path("/proc").iterdir() if p.name.isdigit() and b"guest=default_sys-pulled," in _cmdline(p)]
    assert (qemu.stat().st_uid, qemu.stat().st_gid) == owner and uid != pwd.getpwnam("libvirt-qemu").pw_uid
    tree = [run_dir, *run_dir.rglob("*")]
    sockets = run_dir / SOCKETS_DIR
    shares = run_dir / "virtiofs-shares"  # the ConfigMap's files, the qemu user's as virtiofsd serves them as it
    log_dir = run_dir / "console"  # qemu's user's own, 0700: its log daemon rotates the console log there
    root_dirs = [p for p in tree if p.is_dir() and shares not in p.parents and p != log_dir]
    assert {str(p.relative_to(run_dir)): (p.stat().st_uid, p.stat().st_gid, stat.S_IMODE(p.stat().st_mode)) for p in root_dirs} \
        == {str(p.relative_to(run_dir)): (0, owner[1], 0o710) for p in root_dirs}
    # virtiofsd's log is root's, and domain.xml (libvirt is given the XML, not the file), and the pod
    # switch's log and forward socket (the launcher user's alone: launcher.network.backend)
    net = run_dir / "net"
    given = [p for p in tree if p not in root_dirs and p.parent != sockets and p != run_dir / "domain.xml"
             and p not in (net / "0.forward", net / "0.log")]
    strangers = {str(p.relative_to(run_dir)): (p.stat().st_uid, p.stat().st_gid) for p in given if (p.stat().st_uid, p.stat().st_gid) != owner}
    assert not strangers, f"not {owner}: {strangers}"
    sock = (sockets / "fs0.sock").stat()
    assert (sock.st_uid, sock.st_gid) == owner
    for path, who in ((net / "0.sock", owner), (net / "0.forward", (0, 0)), (net / "0.log", (0, 0))):
        st = path.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*who, 0o600), path
    [iso] = run_dir.rglob("*.iso")
    libvirt_qemu = f"--reuid={pwd.getpwnam('libvirt-qemu').pw_uid}", f"--regid={grp.getgrnam('libvirt-qemu').gr_gid}"
    for ids in (("--reuid=107", "--regid=107"), libvirt_qemu):
        other = subprocess.run(["setpriv", *ids, "--clear-groups", "cat", iso], capture_output=True, text=True, check=False)
        assert other.returncode != 0 and "Permission denied" in other.stderr, other

    stopped = daemon.launcher("stop", "sys-pulled", env={"DISKKIT_CACHE": str(cache)})
    assert stopped.code == 0, stopped.err
    assert_gone(daemon, cache, "default_sys-pulled")


def test_lazy_container_disk_boots_as_root_through_the_system_daemon(daemon, cache, registry):
    ref = f"{registry.host}/system/guest:lazy"
    built = run_diskkit("build", NOREG, ensure_testguest() / "testguest-poweroff.qcow2", "-t", ref)  # lazy v2 is the default
    assert built.code == 0, built.err
    try:
        console = boot(daemon, cache, write_vmi(daemon.root, "sys-lazy", ref, hold=600), "--wait-for", DONE)
        assert console["disks"]["vda"]["size"] == 64 << 20
        exports = control(cache, {"op": "status"})["exports"]
        # served lazily over NBD (the image's qcow2 file, read by qemu through its TOC), not pulled
        assert [(e["member"], e["toc"]) for e in exports] == [("disk/testguest-poweroff.qcow2", True)], exports
        # qemu, as the VM's own uid, reads it through a socket of that uid's alone, which goes with the VM
        uid = json.loads((cache / "vms" / "default_sys-lazy.json").read_text())["vmUser"]["uid"]
        sock = os.stat(cache / "serve" / f"nbd-{uid}.sock")
        assert (sock.st_uid, stat.S_IMODE(sock.st_mode)) == (uid, 0o600)
        stopped = daemon.launcher("stop", "sys-lazy", env={"DISKKIT_CACHE": str(cache)})
        assert stopped.code == 0, stopped.err
        assert not (cache / "serve" / f"nbd-{uid}.sock").exists()  # the disk server forgot the uid
    finally:
        stop_spawned_server(cache)
    assert_gone(daemon, cache, "default_sys-lazy")


# ---------------------------------------------------------------- claims: given to qemu by fd, never relabelled by path

MINIMAL_DOMAIN = """<domain type="qemu">
  <name>{name}</name>
  <memory unit="MiB">64</memory>
  <os><type arch="x86_64" machine="q35">hvm</type></os>
  <devices>
    <disk type="file" device="disk">
      <driver name="qemu" type="raw"/>
      <source file="{path}">{seclabel}</source>
      <target dev="vda" bus="virtio"/>
    </disk>
  </devices>
</domain>
"""


@pytest.mark.parametrize("relabel", [True, False])
def test_libvirt_chowns_through_a_swapped_link_unless_told_not_to_relabel(daemon, relabel):
    """What <seclabel model='dac' relabel='no'/> on a disk's source buys under the system daemon
    (libvirt's src/security/security_dac.c: virSecurityDACSetImageLabelInternal returns before any chown
    when the source's DAC seclabel has relabel off). The attack: a claim's owner swaps disk.img for a
    link to a root-only file after the launcher checked it. Without the seclabel, libvirt chowns the
    target to qemu's user by path (and qemu would read and write it); with it, the target keeps its owner
    and qemu, as libvirt-qemu, is refused it."""
    victim = daemon.root / f"root-only-{relabel}"
    victim.write_bytes(b"root's own\n" + bytes(1 << 20))
    victim.chmod(0o600)
    claim = daemon.root / f"claim-{relabel}"
    claim.mkdir()
    (claim / "disk.img").symlink_to(victim)
    name = f"relabel-{str(relabel).lower()}"
    xml = daemon.root / f"{name}.xml"
    xml.write_text(MINIMAL_DOMAIN.format(name=name, path=claim / "disk.img",
                                         seclabel="" if relabel else '<seclabel model="dac" relabel="no"/>'))
    started = subprocess.run(daemon.command("virsh", "-c", "qemu:///system", "create", xml), capture_output=True, text=True, timeout=300)
    try:
        st = victim.stat()
        if relabel:
            assert started.returncode == 0, started.stderr
            assert (st.st_uid, st.st_gid) == (pwd.getpwnam("libvirt-qemu").pw_uid, grp.getgrnam("libvirt-qemu").gr_gid)
        else:
            assert started.returncode != 0 and "Permission denied" in started.stderr, started
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600)
    finally:
        if started.returncode == 0:
            daemon.virsh("destroy", name)


def test_a_users_claim_is_given_to_qemu_by_the_launcher(daemon, cache, guest_image):
    """Issue 29 item 3 under qemu:///system: a claim of another user's boots; its disk.img (checked: a
    regular file with one link, never a link) is given to qemu.conf's user through its fd by the launcher,
    and qemu, which runs as the VM's own uid, is handed that very file open (fdgroup); the domain says
    relabel='no', so libvirt chowns nothing by path, and the guest reads the file."""
    claim = daemon.root / "users-claim"
    claim.mkdir()
    nobody = pwd.getpwnam("nobody")
    disk = claim / "disk.img"
    disk.write_bytes(b"\x5a" * 512 + bytes((16 << 20) - 512))
    for path in (claim, disk):
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    disk.chmod(0o600)
    inode = disk.stat().st_ino
    vmi = write_vmi(daemon.root, "sys-claim", guest_image, hold=600)  # held: its live XML is looked at
    doc = json.loads(vmi.read_text())
    doc["spec"]["domain"]["devices"]["disks"].append({"name": "data", "disk": {"bus": "virtio"}})
    doc["spec"]["volumes"].append({"name": "data", "persistentVolumeClaim": {"claimName": "data"}})
    vmi.write_text(json.dumps(doc))
    console = boot(daemon, cache, vmi, "--wait-for", DONE, "--pvc", f"data={claim}")
    try:
        assert console["disks"]["vdb"]["head"].startswith("5a5a5a5a"), console
        live = daemon.virsh("dumpxml", "default_sys-claim")
        assert re.search(rf"<source file='{re.escape(str(disk))}' fdgroup='data'", live), live
        uid = json.loads((cache / "vms" / "default_sys-claim.json").read_text())["vmUser"]["uid"]
        assert re.search(rf"<seclabel type='static' model='dac' relabel='no'>\s*<label>\+{uid}:\+{uid}</label>", live), live
        st = disk.stat()
        assert st.st_ino == inode and (st.st_uid, st.st_gid) == system_qemu_ids() and stat.S_IMODE(st.st_mode) == 0o660
    finally:
        stopped = daemon.launcher("stop", "sys-claim", env={"DISKKIT_CACHE": str(cache)})
    assert stopped.code == 0, stopped.err
    assert_gone(daemon, cache, "default_sys-claim")


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""
