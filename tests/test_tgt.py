"""The tests' iSCSI target (tests/tgt.py: a private tgtd on loopback) against the real initiators
diskkit relies on: qemu's libiscsi driver (qemu-img, qemu-system-x86_64) and libvirt's
qemu:///session daemon running as the unprivileged qemu user (UID 107), with and without CHAP."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import tgt
from tests.testguest import boot_qemu, ensure_testguest, parse_console
from tests.tgt import start_target
from tests.vmhost import qemu_scratch

QEMU_UID = 107
GUEST_SIZE = 64 << 20


def qemu_img_info(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["qemu-img", "info", "--output=json", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def guest_lun(tmp_path: Path) -> Path:
    """A raw copy of the test guest: what the target exports."""
    lun = tmp_path / "lun.img"
    subprocess.run(["qemu-img", "convert", "-O", "raw", ensure_testguest() / "testguest-poweroff.qcow2", lun], check=True)
    return lun


@pytest.fixture
def blank_lun(tmp_path: Path) -> Path:
    lun = tmp_path / "blank.img"
    with open(lun, "wb") as f:
        f.truncate(24 << 20)
    return lun


def assert_booted(console: str) -> None:
    parsed = parse_console(console)
    assert parsed["ready"], console
    assert parsed["disks"]["vda"]["size"] == GUEST_SIZE, console
    assert parsed["disks"]["vda"]["head"].startswith("33c0"), console  # the guest's own MBR
    assert parsed["done"], console


# --- the target itself ---------------------------------------------------------------------------

def test_tgtd_is_private_and_stops_without_leftovers(tmp_path, blank_lun):
    a = start_target(tmp_path / "a", blank_lun)
    b = start_target(tmp_path / "b", blank_lun, iqn="iqn.2026-11.io.diskkit:second")
    try:
        assert (a.host, a.lun) == ("127.0.0.1", 1) and a.port != b.port
        assert a.iqn.startswith("iqn.2026-11.io.diskkit:test-")
        assert a.url == f"iscsi://127.0.0.1:{a.port}/{a.iqn}/1"
        assert b.url == f"iscsi://127.0.0.1:{b.port}/iqn.2026-11.io.diskkit:second/1"
        # Each tgtd only knows its own target: the control sockets are private.
        assert a.iqn in a.tgtadm("--mode", "target", "--op", "show")
        assert a.iqn not in b.tgtadm("--mode", "target", "--op", "show")
        assert (a._ipc_dir / "ctl.0").is_socket() and (b._ipc_dir / "ctl.0").is_socket()
        pid, ipc = a.pid, a._ipc_dir
    finally:
        a.stop()
        b.stop()
    assert not Path(f"/proc/{pid}").exists()
    assert not ipc.exists()


def test_a_taken_port_is_detected_and_another_one_used(tmp_path, blank_lun, monkeypatch):
    # tgtd only logs a portal it cannot bind and keeps running: start_target must notice and retry.
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    ports = iter([taken])
    real_free_port = tgt.free_port
    monkeypatch.setattr(tgt, "free_port", lambda: next(ports, None) or real_free_port())
    try:
        target = start_target(tmp_path / "w", blank_lun)
        try:
            assert target.port != taken
            assert qemu_img_info(target.url).returncode == 0
        finally:
            target.stop()
        assert "failed to create/bind to portal" in (tmp_path / "w" / f"tgtd-{taken}.log").read_text()
    finally:
        busy.close()


def test_tgtd_dies_with_its_parent(tmp_path, blank_lun):
    # A crashed test run must not leave a tgtd behind: PR_SET_PDEATHSIG(SIGKILL).
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from tests.tgt import start_target
        t = start_target(Path({str(tmp_path / 'w')!r}), Path({str(blank_lun)!r}))
        print(t.pid, t.port, flush=True)
        sys.stdin.read()
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
    pid, port = map(int, parent.stdout.readline().split())
    assert Path(f"/proc/{pid}").exists()
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid), f"tgtd {pid} survived its parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, just not reaped yet
    except FileNotFoundError:
        return False


# --- qemu-img / qemu-system-x86_64 (libiscsi) ----------------------------------------------------

def test_qemu_img_reads_the_lun(iscsi_target, guest_lun):
    target = iscsi_target(guest_lun)
    info = qemu_img_info(target.url)
    assert info.returncode == 0, info.stderr + target.log_text()
    assert json.loads(info.stdout)["virtual-size"] == GUEST_SIZE


def test_qemu_img_with_chap(iscsi_target, blank_lun):
    user, password = "diskkit", secrets.token_hex(8)
    target = iscsi_target(blank_lun, chap=(user, password))
    # Working form: --object secret,id=ID,data=PASSWORD --image-opts driver=iscsi,...,user=U,password-secret=ID
    good = qemu_img_info("--object", f"secret,id=sec0,data={password}", "--image-opts", target.image_opts("sec0"))
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["virtual-size"] == 24 << 20
    bad = qemu_img_info("--object", "secret,id=sec0,data=wrong-password", "--image-opts", target.image_opts("sec0"))
    assert bad.returncode != 0
    assert "Authentication failure" in bad.stderr, bad.stderr
    anonymous = qemu_img_info(target.url)
    assert anonymous.returncode != 0
    assert "Authentication failure" in anonymous.stderr, anonymous.stderr


def test_qemu_boots_the_guest_from_the_lun(iscsi_target, guest_lun):
    target = iscsi_target(guest_lun)
    console = boot_qemu([], timeout=90, extra_args=[
        "-drive", f"file={target.url},format=raw,if=none,id=disk0",
        "-device", "virtio-blk-pci,drive=disk0,bootindex=0",
    ])
    assert_booted(console)
    assert parse_console(console)["stamps"]["vda"] == (0, 1)  # the guest wrote through iSCSI


# --- libvirt qemu:///session as UID 107 ---------------------------------------------------------

# Run as UID 107 with libvirt-python; JSON on stdin: {"domain": XML, "secret": {"xml", "value"} | null, "timeout"}.
# Defines the secret and the domain, starts it, waits for the guest to power off, undefines both.
# Prints {"started": bool, "error": str | None, "finished": bool}.
LIBVIRT_SCRIPT = r"""
import json, sys, time
import libvirt
cfg = json.load(sys.stdin)
out = {"started": False, "error": None, "finished": False}
conn = libvirt.open("qemu:///session")
secret = dom = None
try:
    if cfg["secret"]:
        secret = conn.secretDefineXML(cfg["secret"]["xml"])
        secret.setValue(cfg["secret"]["value"].encode())
    dom = conn.defineXML(cfg["domain"])
    try:
        dom.create()
        out["started"] = True
    except libvirt.libvirtError as e:
        out["error"] = str(e)
    deadline = time.monotonic() + cfg["timeout"]
    while out["started"] and time.monotonic() < deadline:
        if not dom.isActive():
            out["finished"] = True
            break
        time.sleep(0.1)
finally:
    if dom is not None:
        if dom.isActive():
            dom.destroy()
        dom.undefine()
    if secret is not None:
        secret.undefine()
    conn.close()
print(json.dumps(out))
"""


class SessionUser:
    """UID 107's HOME (under /tmp, 0755: pytest's tmp dirs are private to root) and its libvirt session."""

    def __init__(self, home: Path):
        self.home = home
        self.env = {**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": "", "XDG_CONFIG_HOME": "",
                    "XDG_CACHE_HOME": "", "XDG_DATA_HOME": ""}

    def run_domain(self, domain_xml: str, secret: dict | None = None, timeout: float = 90) -> dict:
        cmd = ["setpriv", f"--reuid={QEMU_UID}", f"--regid={QEMU_UID}", "--clear-groups",
               sys.executable, "-c", LIBVIRT_SCRIPT]
        proc = subprocess.run(cmd, input=json.dumps({"domain": domain_xml, "secret": secret, "timeout": timeout}),
                              capture_output=True, text=True, env=self.env, timeout=timeout + 60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])



@pytest.fixture(scope="module")
def session_user():
    with qemu_scratch("tgt-") as home:
        os.chown(home, QEMU_UID, QEMU_UID)
        yield SessionUser(home)


def domain_xml(name: str, target, log: Path, auth_usage: str | None = None) -> str:
    auth = ""
    if auth_usage:
        auth = (f"<auth username='{target.chap[0]}'>"
                f"<secret type='iscsi' usage='{auth_usage}'/></auth>")
    return f"""<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>128</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type><boot dev='hd'/></os>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <devices>
    <disk type='network' device='disk'>
      <driver name='qemu' type='raw'/>
      <source protocol='iscsi' name='{target.iqn}/{target.lun}'>
        <host name='{target.host}' port='{target.port}'/>
        {auth}
      </source>
      <target dev='vda' bus='virtio'/>
    </disk>
    <serial type='pty'><log file='{log}' append='off'/></serial>
    <console type='pty'/>
  </devices>
</domain>"""


def test_libvirt_session_boots_from_the_lun(session_user, iscsi_target, guest_lun):
    target = iscsi_target(guest_lun)
    log = session_user.home / "plain.log"
    result = session_user.run_domain(domain_xml(f"tgt-plain-{secrets.token_hex(3)}", target, log))
    assert result["started"], result["error"]
    assert result["finished"], log.read_text(errors="replace")
    assert_booted(log.read_text(errors="replace"))


# The XML that boots with CHAP (libvirt 9.0, qemu:///session as UID 107):
#   secret: <secret ephemeral='no' private='yes'><usage type='iscsi'><target>NAME</target></usage></secret>
#           + setValue(b"PASSWORD")
#   disk:   <disk type='network' device='disk'>
#             <driver name='qemu' type='raw'/>
#             <source protocol='iscsi' name='IQN/1'>
#               <host name='127.0.0.1' port='PORT'/>
#               <auth username='USER'><secret type='iscsi' usage='NAME'/></auth>
#             </source>
#             <target dev='vda' bus='virtio'/>
#           </disk>
def test_libvirt_session_boots_with_chap(session_user, iscsi_target, guest_lun):
    user, password = "diskkit", secrets.token_hex(8)
    target = iscsi_target(guest_lun, chap=(user, password))
    usage = f"diskkit-tgt-{secrets.token_hex(4)}"
    secret_xml = (f"<secret ephemeral='no' private='yes'><usage type='iscsi'><target>{usage}</target></usage>"
                  "</secret>")
    log = session_user.home / "chap.log"
    result = session_user.run_domain(domain_xml(f"tgt-chap-{secrets.token_hex(3)}", target, log, usage),
                                     secret={"xml": secret_xml, "value": password})
    assert result["started"], result["error"]
    assert result["finished"], log.read_text(errors="replace")
    assert_booted(log.read_text(errors="replace"))
    # The same domain with a wrong password never starts: qemu's login is refused.
    wrong = session_user.run_domain(domain_xml(f"tgt-chap-{secrets.token_hex(3)}", target, log, usage),
                                    secret={"xml": secret_xml, "value": "wrong-password"})
    assert not wrong["started"]
    assert "Authentication failure" in wrong["error"], wrong["error"]
