"""virtctl's habits, as root on a host with no system libvirt daemon: `launcher run` boots through a
session daemon of the qemu user it starts for the VM itself, `console` attaches to the running guest (output and
input, detach with Ctrl-] as pkg/virtctl/console/console.go), `logs [-f]` prints its console log,
`stop` takes several names and says a VM that is not running is not (exit 0). gc removes stale
VM lock files.

That boot's guest is also on a Multus network whose NetworkAttachmentDefinition is a bridge CNI
config (launcher.network.linuxbridge): the launcher runs in a network namespace of the test's own
(tests/netns.py), where the test made the Linux bridge, put an address on it and serves DHCP and a web
page there, as a LAN would. The guest's console shows its NIC with the spec's MAC, the lease the
bridge's DHCP server gave it, the page it fetched on the bridge, and that the namespace's loopback
was out of its reach; the VM's stop takes its tap away and leaves the bridge."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from launcher.node.cache import Cache
from launcher.runtime import sessiond
from launcher.runtime.vmuser import VMS_DIR
from tests import stacks
from tests.conftest import launcher_command, run_diskkit, run_launcher
from tests.netns import NetNS, tun_node
from tests.testguest import ensure_testguest
from tests.vmhost import DONE, NOREG, QEMU_UID

# A host with no system daemon: whatever this machine runs, the launcher is started in a mount
# namespace of its own with an empty /run/libvirt, where the system daemon's sockets would be.
NO_SYSTEM_DAEMON = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'if [ -d /run/libvirt ]; then mount -t tmpfs tmpfs /run/libvirt; fi; exec "$@"', "sh"]


def as_root_here(cache: Path, *args, netns: NetNS | None = None) -> list[str]:
    """The command as root with no system daemon; in `netns`, with a /dev/net/tun the VM's uid may open, as on
    a host (tests/netns.py tun_node)."""
    inside = [*netns.enter, *tun_node(0o666)] if netns is not None else []
    return [*inside, *NO_SYSTEM_DAEMON, *launcher_command(*args, "--cache-dir", cache)]


def root_launcher(cache: Path, *args, timeout: float = 400, netns: NetNS | None = None):
    proc = subprocess.run(as_root_here(cache, *args, netns=netns), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "CI": "true"})
    return proc


def popen(cache: Path, *args, stdin=subprocess.DEVNULL, netns: NetNS | None = None) -> subprocess.Popen:
    return subprocess.Popen(as_root_here(cache, *args, netns=netns), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "CI": "true"})


def read_until(stream, needle: bytes, timeout: float = 120) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} did not come within {timeout} s; got {seen[-2000:]!r}"
        ready, _, _ = select.select([stream], [], [], min(left, 1))
        if ready:
            chunk = os.read(stream.fileno(), 4096)
            assert chunk, f"the stream ended before {needle!r}; got {seen[-2000:]!r}"
            seen += chunk
    return seen


def vm_uid(cache: Path, domain: str) -> int | None:
    """The host uid the VM's own session daemon and qemu run as (its record says), while it is recorded."""
    try:
        return json.loads((cache / "vms" / f"{domain}.json").read_text())["vmUser"]["uid"]
    except (OSError, ValueError, KeyError):
        return None


def processes_of_uid(uid: int) -> list[int]:
    """The live processes of `uid` (a zombie init has yet to reap runs nothing)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(pid))
        except (OSError, IndexError):
            continue
    return found


BRIDGE, BRIDGE_ADDRESS = "br77", "192.168.77.1"
GUEST_MAC = "02:00:00:4b:4d:01"
PAGE_PORT, LOOPBACK_PORT = 8080, 8081  # a page on the bridge's address; a service on the loopback alone
PROBE = re.compile(r"PROBE addr=(\S+) port=(\d+) got=(.*)")


@dataclass
class Embedded:
    cache: Path
    netns: NetNS
    started: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def embedded(qemu_user, guest_image):
    """The file's one boot: a root launcher with no system daemon, in a network namespace of the test's
    own, the guest on the Multus bridge network `lan` (br77, which the test made: an admin's bridge;
    macspoofchk on) with the spec's MAC. Its disks' serials ask the test guest (images/testguest/init) to fetch the
    page on the bridge's address (reach-C0A84D01-8080) and to try the loopback's port through the
    bridge (probe-8081)."""
    assert os.geteuid() == 0, "this test is about a root launcher"
    ns = NetNS()
    cache = qemu_user.root / "embedded-cache"
    try:
        ns.run("ip", "link", "add", "name", BRIDGE, "type", "bridge")
        ns.run("ip", "address", "add", f"{BRIDGE_ADDRESS}/24", "dev", BRIDGE)
        ns.run("ip", "link", "set", "dev", BRIDGE, "up")
        lan = qemu_user.root / "lan"
        (lan / "www").mkdir(parents=True)
        (lan / "www" / "index.html").write_text("on the bridge\n")
        (lan / "udhcpd.conf").write_text(f"start 192.168.77.50\nend 192.168.77.60\ninterface {BRIDGE}\n"
                                         f"lease_file {lan}/leases\npidfile {lan}/udhcpd.pid\n"
                                         f"opt subnet 255.255.255.0\nopt router {BRIDGE_ADDRESS}\n")
        ns.start("busybox", "udhcpd", "-f", lan / "udhcpd.conf", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ns.start("busybox", "httpd", "-f", "-p", f"{BRIDGE_ADDRESS}:{PAGE_PORT}", "-h", lan / "www")
        ns.start("busybox", "httpd", "-f", "-p", f"127.0.0.1:{LOOPBACK_PORT}", "-h", lan / "www")
        manifests = qemu_user.root / "embedded-manifests"
        manifests.mkdir()
        (manifests / "nad.yaml").write_text(yaml.safe_dump({
            "apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition", "metadata": {"name": "lan"},
            "spec": {"config": json.dumps({"cniVersion": "0.3.1", "name": "lan", "type": "bridge", "bridge": BRIDGE, "macspoofchk": True})}}))
        # Pulled on the host's network (the registry is on its loopback); the run in the namespace finds it cached.
        pulled = root_launcher(cache, "pull", NOREG, guest_image)
        assert pulled.returncode == 0, pulled.stderr
        probes = [({"name": name, "disk": {"bus": "virtio"}, "serial": serial}, {"name": name, "emptyDisk": {"capacity": "1Mi"}})
                  for name, serial in (("reach", f"reach-C0A84D01-{PAGE_PORT}"), ("probe", f"probe-{LOOPBACK_PORT}"))]
        vmi = qemu_user.write_vmi("embedded", guest_image, serial="hold-240-echo", extra=probes)
        doc = json.loads(vmi.read_text())
        doc["spec"]["domain"]["devices"]["interfaces"] = [{"name": "lan", "bridge": {}, "macAddress": GUEST_MAC}]
        doc["spec"]["networks"] = [{"name": "lan", "multus": {"networkName": "lan"}}]
        vmi.write_text(json.dumps(doc))
        started = root_launcher(cache, "run", NOREG, "--manifests", manifests, "--wait-for", "ECHO ready", "--timeout", "300", vmi, netns=ns)
        yield Embedded(cache, ns, started)
    finally:
        root_launcher(cache, "stop", "embedded", netns=ns)
        ns.close()


def test_the_guest_on_a_bridge_network_has_the_specs_mac_and_reaches_the_bridge_not_the_loopback(embedded):
    """KubeVirt's bridge binding on a secondary network: the guest's NIC has the spec's MAC, the guest
    is on the bridge's LAN (its DHCP server's lease, its page), and the node's loopback stays out of
    reach even routed through the bridge's address (route_localnet off: launcher.network.linuxbridge)."""
    assert embedded.started.returncode == 0, embedded.started.stderr
    following = popen(embedded.cache, "logs", "-f", "embedded", netns=embedded.netns)
    try:
        seen = read_until(following.stdout, b"PROBE-DONE", timeout=180).decode(errors="replace")
    finally:
        following.kill()
        following.wait()
    assert f"NET-NIC iface=eth0 mac={GUEST_MAC}" in seen
    lease = re.search(r"NET-LEASE iface=eth0 ip=(\S+) mask=(\S+) router=(\S+) dns=\S+ mac=(\S+)", seen)
    assert lease is not None, seen[-2000:]
    assert lease.group(1).startswith("192.168.77.") and lease.group(3) == BRIDGE_ADDRESS and lease.group(4) == GUEST_MAC
    got = {(addr, int(port)): answer.strip() for addr, port, answer in PROBE.findall(seen)}
    assert got[(BRIDGE_ADDRESS, PAGE_PORT)].startswith("HTTP/1.") and "200" in got[(BRIDGE_ADDRESS, PAGE_PORT)], got
    # the loopback's service, asked for through the bridge's address and by 127.0.0.1 routed out of eth0
    assert got[("127.0.0.1", LOOPBACK_PORT)] == "nothing" and got[(BRIDGE_ADDRESS, LOOPBACK_PORT)] == "nothing", got
    tap = json.loads((embedded.cache / "vms" / "default_embedded.json").read_text())["bridgeTaps"][0]["tap"]
    link = embedded.netns.links()[tap]
    assert link["master"] == BRIDGE and link["linkinfo"]["info_data"]["user"] == vm_uid(embedded.cache, "default_embedded")
    assert f"-s ! {GUEST_MAC} -i {tap} -j DROP" in embedded.netns.run("ebtables", "-t", "nat", "-L", "PREROUTING").stdout


def test_root_with_no_system_daemon_boots_attaches_follows_and_stops(embedded, guest_image):
    cache, ns, started = embedded.cache, embedded.netns, embedded.started

    def root_launcher_(*args):
        return root_launcher(cache, *args, netns=ns)

    def popen_(*args, **kwargs):
        return popen(cache, *args, netns=ns, **kwargs)

    try:
        assert started.returncode == 0, started.stderr
        # One line says which libvirt runs it, then one short block: name, console, how to stop it.
        assert "no libvirt system daemon answers here" in started.stderr, started.stderr
        assert "launcher console embedded" in started.stderr and "launcher stop embedded" in started.stderr
        record = json.loads((cache / "vms" / "default_embedded.json").read_text())
        uid = record["vmUser"]["uid"]
        assert record["uri"] == f"qemu+unix:///session?socket={VMS_DIR}/{uid}/.cache/libvirt/libvirt-sock"
        # The VM's own daemon: the qemu user (107) in its user namespace, a uid of the VM's own outside.
        [daemon] = [pid for pid in processes_of_uid(uid) if Path(f"/proc/{pid}/comm").read_text().strip() == "libvirtd"]
        assert Path(f"/proc/{daemon}/uid_map").read_text().split() == [str(QEMU_UID), str(uid), "1"]
        status = root_launcher_("status", "embedded")
        assert (status.returncode, status.stdout.strip()) == (0, "running"), status.stderr
        # ls names the disk by the image it came from, not by a cut path.
        listed = root_launcher_("ls")
        assert listed.returncode == 0, listed.stderr
        [row] = [line for line in listed.stdout.splitlines() if "default_embedded" in line and "Mi" in line]
        assert row.split()[0] == f"docker://{guest_image}" and str(cache) not in listed.stdout, listed.stdout
        [disk] = json.loads(root_launcher_("ls", "--json").stdout)["disks"]
        assert disk["images"] == [f"docker://{guest_image}"] and disk["usedBy"] == ["default_embedded"]

        # console: the guest's output, and a line typed reaches the guest (it answers ECHO <line>).
        attached = popen_("console", "embedded", stdin=subprocess.PIPE)
        try:
            assert b"Successfully connected to embedded console. The escape sequence is ^]" in read_until(attached.stderr, b"^]\n")
            attached.stdin.write(b"hello console\n")
            attached.stdin.flush()
            read_until(attached.stdout, b"ECHO hello console")
            attached.stdin.write(b"\x1d")  # Ctrl-]: detach, the VM keeps running
            attached.stdin.flush()
            assert attached.wait(timeout=60) == 0, attached.stderr.read()
        except AssertionError as failed:
            failed.add_note(stacks.kill_telling(attached, daemon))  # where the console and its daemon were
            raise
        finally:
            attached.kill()
        assert root_launcher_("status", "embedded").stdout.strip() == "running"

        logs = root_launcher_("logs", "embedded")
        assert logs.returncode == 0, logs.stderr
        assert DONE in logs.stdout and "ECHO hello console" in logs.stdout

        following = popen_("logs", "-f", "embedded")
        read_until(following.stdout, b"ECHO hello console")  # what came before, then it follows
        # stop, found again on the session daemon, takes several names; one not running is no error.
        stopped = root_launcher_("stop", "embedded", "never-started")
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.splitlines() == ["VM embedded was stopped", "VM never-started is not running"]
        assert following.wait(timeout=60) == 0, following.stderr.read()  # -f ends with the VM
    finally:
        root_launcher_("stop", "embedded")
    assert processes_of_uid(uid) == [] and not (VMS_DIR / str(uid)).exists()  # stop gave the VM's uid back
    # and its tap with it; the bridge stays, as the bridge CNI plugin's DEL leaves it
    links = ns.links()
    assert not [name for name in links if name.startswith("dk")] and BRIDGE in links, list(links)
    assert "-i dk" not in ns.run("ebtables", "-t", "nat", "-L", "PREROUTING").stdout  # nor its spoof check
    again = root_launcher_("stop", "embedded")
    assert (again.returncode, again.stdout.strip()) == (0, "VM embedded is not running"), again.stderr
    assert not (cache / "run" / "default_embedded").exists()
    gone = root_launcher_("logs", "embedded")
    assert gone.returncode != 0 and "VM is not running" in gone.stderr and gone.stderr.count("\n") == 1, gone.stderr


def test_gc_removes_lock_files_no_process_holds(tmp_path):
    cache_dir = tmp_path / "cache"
    cache = Cache(cache_dir)
    with cache.lock("vm-default_gone"):
        pass  # a VM that ran once: its lock file stays behind
    with cache.lock("pull-keeps"):
        pass
    locks = cache_dir / "locks"
    with cache.lock("vm-default_starting"):  # a launcher starting this VM right now
        result = run_launcher("gc", "--json", "--cache-dir", cache_dir)
        assert result.code == 0, result.err
        assert json.loads(result.out)["locks_removed"] == [str(locks / "vm-default_gone.lock")]
        assert (locks / "vm-default_starting.lock").exists()
    assert not (locks / "vm-default_gone.lock").exists()
    assert (locks / "pull-keeps.lock").exists()  # only VM locks: one per name ever run
    # A lock taken again after gc removed its file is a fresh file, held.
    with cache.lock("vm-default_gone"):
        fd = os.open(locks / "vm-default_gone.lock", os.O_RDWR)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("the lock is not held")
            except BlockingIOError:
                pass
        finally:
            os.close(fd)


def test_connect_still_wins_over_the_embedded_default(qemu_user):
    cache = qemu_user.root / "connect-cache"
    vmi = qemu_user.write_vmi("chosen", "127.0.0.1:1/none:v1")
    refused = root_launcher(cache, "run", "--connect", "qemu:///system", vmi)
    assert refused.returncode != 0
    assert refused.stderr.startswith("launcher: qemu:///system: cannot connect to libvirt") and refused.stderr.count("\n") == 1, refused.stderr
    assert "no libvirt system daemon answers here" not in refused.stderr


def test_a_lazy_image_boots_through_the_embedded_daemon(qemu_user, registry):
    """qemu runs as the VM's own uid, outside the group of the root disk server's nbd.sock: the root
    launcher asks for the socket of that uid instead, which goes with the VM (a later VM given the uid
    reads nothing the first one was answered with)."""
    ref = f"{registry.host}/embedded/lazy:v1"
    built = run_diskkit("build", NOREG, ensure_testguest() / "testguest-poweroff.qcow2", "-t", ref)  # lazy by default
    assert built.code == 0, built.err
    cache = qemu_user.root / "lazy-cache"
    vmi = qemu_user.write_vmi("lazy-embedded", ref)
    booted = None
    try:
        booted = popen(cache, "run", NOREG, "--console", "--timeout", "300", vmi)
        read_until(booted.stdout, DONE.encode(), timeout=300)
        uid = vm_uid(cache, "default_lazy-embedded")
        served = cache / "serve" / f"nbd-{uid}.sock"
        assert stat.S_ISSOCK(served.lstat().st_mode) and served.lstat().st_uid == uid
        assert booted.wait(timeout=300) == 0, booted.stderr.read()
        assert b"no libvirt system daemon answers here" in booted.stderr.read()
    finally:
        if booted is not None:
            booted.kill()
        root_launcher(cache, "stop", "lazy-embedded")
    assert not served.exists() and processes_of_uid(uid) == []


def test_kvm_for_the_qemu_user_is_what_it_may_open_not_what_root_may():
    kvm = 1000
    assert not sessiond.qemu_user_has_kvm(0o20600, 0, ())  # root's alone (this machine's): TCG, though root may probe KVM
    assert not sessiond.qemu_user_has_kvm(0o20660, kvm, ())  # the kvm group's, a daemon without it
    assert sessiond.qemu_user_has_kvm(0o20660, kvm, (kvm,))  # the embedded daemon is given /dev/kvm's group
    assert sessiond.qemu_user_has_kvm(0o20666, 0, ())
    assert not sessiond.is_ours("qemu:///session") and not sessiond.is_ours(f"qemu+unix:///session?socket={VMS_DIR}/x/.cache/libvirt/libvirt-sock")
