"""The real cloud guest (images/cloudguest) booted once for the module through the launcher as the
qemu user, as a KubeVirt user boots a cloud image: a containerDisk, a NoCloud disk and an ssh key from
accessCredentials (pkg/cloud-init/cloud-init.go puts it in the NoCloud meta-data's public-keys, which
cloud-init installs for its default user). Each check is its own test id, reading the one boot.

Host keys: cloud-init prints the keys it made at first boot on the console
(cloudinit/config/cc_keys_to_console.py, between -----BEGIN SSH HOST KEY KEYS----- and -----END ...),
and `launcher ssh` trusts those, with no ssh options, and refuses a changed one.

The same boot is read through what KubeVirt gives every VM: the guest agent's channel, the VNC
display, the SMBIOS entries.

- `launcher guestosinfo|userlist|fslist` print what `virtctl guestosinfo|userlist|fslist` print
  (pkg/virtctl/vm/guestosinfo.go, user_list.go, fs_list.go: KubeVirt's objects as indented JSON),
  filled as virt-launcher fills them (pkg/virt-launcher/virtwrap/manager.go GetGuestInfo, GetUsers,
  GetFilesystems); each is checked against what the guest itself says over ssh.
- `launcher status` shows the AgentConnected condition (pkg/virt-handler/vm.go updateGuestAgentConditions)
  and AccessCredentialsSynchronized (updateAccessCredentialConditions).
- root's ssh key comes through the agent (accessCredentials propagationMethod qemuGuestAgent) and
  follows its Secret, as virt-launcher's access credential manager keeps it
  (pkg/virt-launcher/virtwrap/access-credentials/access_credentials.go).
- `launcher vnc screenshot` is virtctl's (pkg/virtctl/vnc/screenshot/screenshot.go): a PNG of the
  console, here the guest's tty1 login prompt; `launcher vnc --proxy-only` prints {"port": N} as
  virtctl's (pkg/virtctl/vnc/vnc.go) and serves only its own user.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import struct
import subprocess
import zlib

import pytest

from launcher.cli.smoketest import login_user
from launcher.runtime.agentinfo import go_json
from launcher.runtime.cloudinitreport import Report
from tests.conftest import Result, launcher_command
from tests.cloudguest import NAME, CloudGuest, _keypair, cloud_guest, write_secret  # noqa: F401  (fixture)
from tests.lazyhost import wait_for
from tests.vmhost import QEMU_UID

pytestmark = pytest.mark.vm


def console_report(guest: CloudGuest) -> Report:
    report = Report()
    report.feed(guest.console().encode())
    return report


def test_the_cloud_guest_boots_to_a_login_prompt(cloud_guest: CloudGuest):
    assert cloud_guest.started.code == 0, cloud_guest.started.err
    console = cloud_guest.console()
    assert "Debian GNU/Linux 12" in console and "login:" in console, console[-3000:]


def test_cloud_init_finishes_from_the_nocloud_disk(cloud_guest: CloudGuest):
    assert cloud_guest.reported().get("cloud-init") == "status: done", cloud_guest.first_ssh
    assert "Datasource DataSourceNoCloud" in cloud_guest.console()


def test_ssh_straight_after_wait_for_needs_no_options(cloud_guest: CloudGuest):
    first = cloud_guest.first_ssh
    assert first.code == 0, first.err
    assert cloud_guest.reported()["user"] == cloud_guest.default_user == "debian"
    # The keys came from the console, not from trusting the first key shown.
    assert "trusting the key" not in first.err, first.err
    learned = (cloud_guest.run_dir / "known_hosts").read_text()
    assert f"vmi.cloudguest.default {cloud_guest.reported()['ed25519']}\n" in learned
    assert learned.splitlines() == [f"vmi.cloudguest.default {k.type} {k.key}" for k in console_report(cloud_guest).host_keys]


def test_the_default_user_has_passwordless_sudo(cloud_guest: CloudGuest):
    assert cloud_guest.reported()["sudo"] == "root", cloud_guest.first_ssh


def test_the_guest_agent_is_installed(cloud_guest: CloudGuest):
    assert cloud_guest.reported()["agent"] == "install ok installed", cloud_guest.first_ssh


def test_a_changed_host_key_is_refused(cloud_guest: CloudGuest, tmp_path):
    known_hosts = cloud_guest.run_dir / "known_hosts"
    learned = known_hosts.read_text()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    other = (tmp_path / "other.pub").read_text().split()[1]
    # Every key the guest has, replaced by another of its type: a man in the middle's.
    tampered = "".join(f"{host} {kind} {other if kind == 'ssh-ed25519' else key}\n"
                       for host, kind, key in (line.split() for line in learned.splitlines()) if kind == "ssh-ed25519")
    try:
        known_hosts.write_text(tampered)
        refused = cloud_guest.ssh("true")
        assert refused.code == 255, refused
        assert "Host key verification failed" in refused.err, refused.err
    finally:
        known_hosts.write_text(learned)
    assert cloud_guest.ssh("true").code == 0  # the guest's own keys still do


def test_launcher_test_finds_the_default_user_cloud_init_names(cloud_guest: CloudGuest):
    # What `launcher test` does without --user or a label: the user cloud-init installed the test's key for.
    user, source = login_user(None, None, console_report(cloud_guest), cloud_guest.public_key)
    assert (user, source) == ("debian", "cloud-init's default user, whom it gave the key")
    assert login_user(None, None, Report(), cloud_guest.public_key)[0] == "root"


def test_port_forward_gives_the_ssh_options_that_check_the_vms_keys(cloud_guest: CloudGuest):
    forward = cloud_guest.user.popen("port-forward", "vmi/cloudguest", "0:22")
    try:
        port = re.fullmatch(r"Forwarding from 127\.0\.0\.1:(\d+) -> 22 \(tcp\)\n", forward.stdout.readline()).group(1)
        hint = forward.stderr.readline()
        prefix = "launcher: ssh with cloudguest's host keys: ssh "
        assert hint.startswith(prefix), hint
        *options, target = shlex.split(hint[len(prefix):])
        assert options[-2:] == ["-p", port] and target == "USER@127.0.0.1", hint
        done = subprocess.run(["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-i", str(cloud_guest.key), *options, "debian@127.0.0.1", "id -un"],
                              capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout) == (0, "debian\n"), done.stderr
    finally:
        forward.terminate()
        forward.wait(timeout=60)


# ---- the guest agent, the display and the SMBIOS entries of the same boot ----
# Every ssh below checks the host keys `launcher ssh` learned from the console at the first one: no options.


def status(guest: CloudGuest) -> dict:
    return json.loads(guest.user.launcher("status", "--json", NAME).out)


def condition(guest: CloudGuest, kind: str) -> dict | None:
    return next((c for c in status(guest)["conditions"] if c["type"] == kind), None)


@pytest.fixture(scope="module")
def agent(cloud_guest: CloudGuest) -> CloudGuest:
    """The guest once its agent holds the channel open (qemu-guest-agent.service starts with the port)."""
    wait_for(lambda: condition(cloud_guest, "AgentConnected"), 180, "the AgentConnected condition", interval=2)
    return cloud_guest


def guest_says(guest: CloudGuest, command: str) -> str:
    done = guest.ssh(command)
    assert done.code == 0, done.err
    return done.out


def test_status_says_agent_connected(agent: CloudGuest):
    answer = agent.user.launcher("status", NAME)
    assert answer.code == 0, answer.err
    lines = answer.out.splitlines()
    assert lines[0] == "running" and "AgentConnected: True" in lines, answer.out
    # Debian's qemu-guest-agent 7.2 has every command KubeVirt needs (virt-handler/guestagent.go)
    assert condition(agent, "UnsupportedAgent") is None


def test_guestosinfo_is_kubevirts_object_with_what_the_guest_says(agent: CloudGuest):
    printed = agent.user.launcher("guestosinfo", NAME)
    assert printed.code == 0, printed.err
    info = json.loads(printed.out)
    assert printed.out == go_json(info) + "\n"  # MarshalIndent's layout, fields in the struct's order
    assert list(info) == ["guestAgentVersion", "supportedCommands", "hostname", "os", "timezone", "fsInfo", "fsFreezeStatus"] or \
        list(info) == ["guestAgentVersion", "supportedCommands", "hostname", "os", "timezone", "userList", "fsInfo", "fsFreezeStatus"]
    facts = dict(line.split("=", 1) for line in guest_says(agent, (
        "echo kernel=$(uname -r); echo version=$(uname -v); echo machine=$(uname -m); echo host=$(hostname); "
        ". /etc/os-release; echo id=$ID; echo version_id=$VERSION_ID; echo pretty=$PRETTY_NAME; echo name=$NAME; "
        "echo osversion=$VERSION; echo agent=$(/usr/sbin/qemu-ga --version)")).splitlines())
    assert info["os"] == {"name": facts["name"], "kernelRelease": facts["kernel"], "version": facts["osversion"],
                          "prettyName": facts["pretty"], "versionId": facts["version_id"], "kernelVersion": facts["version"],
                          "machine": facts["machine"], "id": facts["id"]}
    assert (info["os"]["id"], info["os"]["versionId"]) == ("debian", "12")
    assert info["hostname"] == facts["host"] == NAME  # cloud-init's local-hostname: the VMI's name
    assert facts["agent"] == f"QEMU Guest Agent {info['guestAgentVersion']}"
    assert info["timezone"] == "UTC, 0"  # the user data's timezone, as "%s, %d" (manager.go)
    commands = {c["name"]: c.get("enabled", False) for c in info["supportedCommands"]}
    assert commands["guest-ssh-add-authorized-keys"] and commands["guest-get-osinfo"]
    root = next(fs for fs in info["fsInfo"]["disks"] if fs["mountPoint"] == "/")
    assert (root["fileSystemType"], root["disk"][0]["busType"]) == ("ext4", "virtio")
    assert 0 < root["usedBytes"] < root["totalBytes"]
    assert info["fsFreezeStatus"] == "thawed"  # guest-fsfreeze-status, as virt-launcher's poller stores it


def test_userlist_lists_a_logged_in_user(agent: CloudGuest):
    # an ssh session of the default user on a terminal (sshd records those in utmp, which guest-get-users
    # reads), held open while the agent is asked
    holder = agent.user.popen("ssh", f"{agent.default_user}@vmi/{NAME}", "-i", agent.key, "-t", "-tt",
                              "-c", "echo in; sleep 120")
    try:
        assert holder.stdout.readline().strip() == "in"
        listed = wait_for(lambda: (out := json.loads(agent.user.launcher("userlist", NAME).out))["items"] and out, 60, "a logged-in user")
    finally:
        holder.terminate()
        holder.wait(timeout=60)
    assert listed["metadata"] == {} and list(listed) == ["metadata", "items"]
    user = next(u for u in listed["items"] if u["userName"] == agent.default_user)
    assert set(user) <= {"userName", "domain", "loginTime"} and user["loginTime"] > 1.7e9


def test_fslist_lists_every_mounted_filesystem_with_its_disk(agent: CloudGuest):
    printed = agent.user.launcher("fslist", NAME)
    assert printed.code == 0, printed.err
    listed = json.loads(printed.out)
    assert list(listed) == ["metadata", "items"] and listed["metadata"] == {}
    mounted = {line.split()[1] for line in guest_says(agent, "cat /proc/mounts").splitlines() if line.startswith("/dev/")}
    assert {fs["mountPoint"] for fs in listed["items"]} >= mounted
    root = next(fs for fs in listed["items"] if fs["mountPoint"] == "/")
    assert list(root) == ["diskName", "mountPoint", "fileSystemType", "usedBytes", "totalBytes", "disk"]


def test_the_guest_sees_kubevirts_smbios_balloon_and_agent_port(agent: CloudGuest):
    # pkg/virt-config SMBIOS defaults through compute/sysinfo.go; the balloon is virtio device 5
    seen = guest_says(agent, "cat /sys/class/dmi/id/sys_vendor /sys/class/dmi/id/product_name /sys/class/dmi/id/product_family;"
                             " cat /sys/bus/virtio/devices/*/device; ls /dev/virtio-ports")
    lines = seen.split()
    assert lines[:3] == ["KubeVirt", "None", "KubeVirt"], seen
    assert "0x0005" in lines and "org.qemu.guest_agent.0" in lines, seen


def _ssh_as_root(guest: CloudGuest, key) -> Result:
    return guest.user.launcher("ssh", f"root@vmi/{NAME}", "-i", key, "-c", "id -un")


def test_roots_key_comes_through_the_agent_and_follows_its_secret(agent: CloudGuest):
    synced = wait_for(lambda: (c := condition(agent, "AccessCredentialsSynchronized")) and c["status"] == "True" and c, 120,
                      "AccessCredentialsSynchronized: True", interval=2)
    assert synced == {"type": "AccessCredentialsSynchronized", "status": "True"}
    first = _ssh_as_root(agent, agent.agent_key)
    assert (first.code, first.out) == (0, "root\n"), first.err
    # the Secret changes: the agent writes the new key in place of the old one within a check or two (15 s each)
    new_key, new_public = _keypair(agent.user.root, "agent-key-2")
    write_secret(agent.manifests, "agent-key", {"key": new_public})
    wait_for(lambda: _ssh_as_root(agent, new_key).code == 0, 120, "the new key in root's authorized_keys", interval=3)
    refused = _ssh_as_root(agent, agent.agent_key)
    assert refused.code == 255 and "Permission denied" in refused.err, refused
    keys = guest_says(agent, "sudo -n cat /root/.ssh/authorized_keys").splitlines()
    assert keys == [new_public]  # guest-ssh-add-authorized-keys with reset: exactly the Secret's keys
    assert condition(agent, "AccessCredentialsSynchronized") == synced


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and unfiltered rows of an 8-bit RGB(A) PNG (what qemu's screendump writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        header = chunk if kind == b"IHDR" else header
        idat += chunk if kind == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and color in (2, 6), (depth, color)
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prior = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up, corner = prior[i], prior[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 0xFF
        rows.append(bytes(line))
        prior = line
    return width, height, rows


def _lit_rows(guest: CloudGuest) -> int:
    """Rows of the screen with anything light on them, from `launcher vnc screenshot`."""
    out = guest.user.home / "screen.png"
    taken = guest.user.launcher("vnc", "screenshot", NAME, "-f", out)
    assert taken.code == 0, taken.err
    width, height, rows = _png_pixels(out.read_bytes())
    assert (width, height) >= (640, 400)
    return sum(1 for row in rows if max(row) > 128)  # the console's text is light grey on black


def test_a_vnc_screenshot_shows_the_guests_console(agent: CloudGuest):
    # not blank: the tty1 login prompt (getty's), light on the console's black
    assert _lit_rows(agent) >= 10
    # and it is the guest's console now: filled with text, then cleared, through tty1
    clear = 'printf "\\033[2J\\033[H" >/dev/tty1'
    guest_says(agent, f"sudo -n sh -c '{clear}; yes \"{'#' * 79}\" | head -n 20 >/dev/tty1'")
    filled = _lit_rows(agent)
    guest_says(agent, f"sudo -n sh -c '{clear}'")
    cleared = _lit_rows(agent)
    assert filled > 120 and cleared < 20, (filled, cleared)
    unwritable = agent.user.root / "screen.png"  # root's directory
    refused = agent.user.launcher("vnc", "screenshot", NAME, "-f", unwritable)
    assert (refused.code, refused.err) == (1, f"launcher: {unwritable}: Can't write image to a file: Permission denied\n")
    # virtctl's "-": the PNG on stdout
    stdout = subprocess.run(launcher_command("vnc", "screenshot", NAME, "-f", "-", user=str(QEMU_UID)), capture_output=True,
                            env={**os.environ, "CI": "true", **agent.user.env}, timeout=120)
    assert stdout.returncode == 0 and stdout.stdout.startswith(b"\x89PNG\r\n\x1a\n"), stdout.stderr


def _connect(port: int, uid: int) -> bytes:
    """What a client of uid `uid` reads from the proxy within 10 s (the RFB banner, or nothing)."""
    probe = ("import socket,sys; s=socket.create_connection(('127.0.0.1', int(sys.argv[1]))); s.settimeout(10);\n"
             "try: sys.stdout.buffer.write(s.recv(12))\nexcept OSError: pass")
    done = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/usr/bin/python3", "-c", probe, str(port)],
                          capture_output=True, timeout=60)
    return done.stdout


def test_the_vnc_proxy_serves_its_user_and_no_other(agent: CloudGuest):
    proxy = agent.user.popen("vnc", "--proxy-only", NAME)
    try:
        port = json.loads(proxy.stdout.readline())["port"]
        assert _connect(port, 65534) == b""  # nobody: closed unanswered, and the proxy waits on
        assert re.search(r"refused a VNC connection from uid 65534", proxy.stderr.readline())
        assert _connect(port, QEMU_UID) == b"RFB 003.008\n"  # qemu's VNC server, through the proxy
        assert proxy.wait(timeout=60) == 0  # one viewer, as virtctl's proxy
    finally:
        if proxy.poll() is None:
            proxy.kill()
            proxy.wait()

