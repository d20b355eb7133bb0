"""Choose the libvirt domain type: "kvm" when KVM really runs guests here, else "qemu" (TCG), and say why.

/dev/kvm existing proves nothing: on some hosts (nested, or software "KVM" such as PVM) it opens
fine and guests then crawl at 100 % sys CPU. So we boot a tiny real guest under KVM and call KVM
usable only if it finishes a fixed amount of work in time. The answer is cached per boot, with its
reason: every run says which accelerator it uses and, when /dev/kvm is there but unused, why.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from diskkit.errors import DiskkitError
from diskkit.streams.fsutil import write_atomic

KVM_DEVICE = "/dev/kvm"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
START = b"DISKKIT-PROBE\n"
MARKER = b"DISKKIT-KVM-OK\n"
# Busy-loop iterations before MARKER. TCG runs them in ~0.2 s and real KVM in ~0.02 s; a KVM
# that emulates instructions (~1 us each, seen here) needs over a minute. Printing alone is not
# enough: such a KVM does reach the boot sector and print, then stalls in any real kernel.
SPIN = 50_000_000


def _boot_sector() -> bytes:
    """A 512-byte x86 real-mode boot sector (BIOS loads it at 0:7c00) that prints START, spins
    SPIN times, prints MARKER to COM1 and halts."""
    def say(text: bytes) -> bytes:
        return b"".join(b"\xb0" + bytes([c]) + b"\xee" for c in text)  # mov al,c ; out dx,al

    code = (
        b"\xfa"                                     # cli: no BIOS IRQ handler (SeaBIOS's serial
                                                    #   console flushes from them) may split our text
        + b"\xba\xf8\x03"                           # mov dx,0x3f8  (COM1 data port)
        + say(START)
        + b"\x66\xb9" + SPIN.to_bytes(4, "little")  # mov ecx,SPIN
        + b"\x66\x49"                               # spin: dec ecx
        + b"\x75\xfc"                               #       jnz spin  (-4)
        + say(MARKER)
        + b"\xf4"                                   # hlt
        + b"\xeb\xfe"                               # jmp $  (should anything wake hlt)
    )
    assert len(code) <= 510
    return code.ljust(510, b"\0") + b"\x55\xaa"     # boot signature


BOOT_SECTOR = _boot_sector()


@dataclass
class Probe:
    works: bool      # MARKER seen
    reason: str
    output: bytes    # everything the guest wrote to the serial port
    seconds: float


def run_probe(accel: str, qemu: str = "qemu-system-x86_64", timeout: float = 8.0) -> Probe:
    """Boot BOOT_SECTOR under `-accel ACCEL`; wait for MARKER at most `timeout` s; kill qemu."""
    binary = shutil.which(qemu)
    if binary is None:
        return Probe(False, f"{qemu} not found", b"", 0.0)
    with tempfile.TemporaryDirectory(prefix="diskkit-accel-") as tmp:
        sector = Path(tmp) / "probe.img"
        sector.write_bytes(BOOT_SECTOR)
        cmd = [binary, "-accel", accel, "-machine", "pc", "-m", "16", "-nodefaults", "-nographic",
               "-display", "none", "-serial", "stdio", "-drive", f"file={sector},format=raw,if=ide", "-no-reboot"]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out = b""
        try:
            while MARKER not in out and (left := start + timeout - time.monotonic()) > 0:
                if select.select([proc.stdout], [], [], left)[0]:
                    chunk = os.read(proc.stdout.fileno(), 4096)
                    if not chunk:
                        break  # qemu exited (e.g. KVM cannot be opened)
                    out += chunk
        finally:
            proc.kill()
            err = proc.communicate()[1].decode(errors="replace").strip()
        seconds = time.monotonic() - start
    if MARKER in out:
        return Probe(True, f"{accel} guest finished the probe in {seconds:.1f}s", out, seconds)
    if proc.returncode != -9:  # exited before we killed it
        last = err.splitlines()[-1] if err else f"exit status {proc.returncode}"
        return Probe(False, f"qemu -accel {accel} failed: {last}", out, seconds)
    if START in out:
        why = f"{accel} guest too slow: started the probe but did not finish it in {timeout:g}s (instructions emulated?)"
    else:
        why = f"{accel} guest made no progress: probe not reached in {timeout:g}s"
    return Probe(False, why, out, seconds)


def probe_kvm(qemu: str = "qemu-system-x86_64", timeout: float = 8.0) -> tuple[bool, str]:
    probe = run_probe("kvm", qemu, timeout)
    return probe.works, probe.reason


def _cache_file(cache_dir: Path, qemu: str) -> tuple[Path, str] | None:
    """<cache>/accel/<boot id>_<hash of the qemu binary's path>.json, and the boot id."""
    try:
        boot_id = BOOT_ID.read_text().strip()
    except OSError:
        return None
    binary = shutil.which(qemu) or qemu
    return Path(cache_dir) / "accel" / f"{boot_id}_{hashlib.sha256(binary.encode()).hexdigest()[:16]}.json", boot_id


@dataclass(frozen=True)
class Accel:
    domain_type: str  # libvirt's: "kvm", or "qemu" for TCG
    reason: str  # why, in words a user can act on

    @property
    def name(self) -> str:
        return "kvm" if self.domain_type == "kvm" else "tcg"

    def line(self) -> str:
        shown = "KVM" if self.domain_type == "kvm" else "TCG (software emulation)"
        return f"accelerator: {shown}: {self.reason}"

    def to_json(self) -> dict:
        return {"accelerator": self.name, "domainType": self.domain_type, "reason": self.reason}


FORCE_HINT = "--accel kvm or DISKKIT_ACCEL=kvm forces KVM"


def choose(cache_dir: Path | None = None, requested: str | None = None, qemu: str = "qemu-system-x86_64", timeout: float = 8.0,
           qemu_cannot_open: str | None = None) -> Accel:
    """The accelerator and why. `requested` (--accel kvm|qemu|tcg; None or "auto" to choose) wins, then
    $DISKKIT_ACCEL; no /dev/kvm, or one this user cannot open, means TCG without probing (the
    unprivileged qemu:///session case); `qemu_cannot_open` names a qemu that runs as another user who
    cannot open it (a root launcher's session daemon); otherwise this boot's cached probe, or a fresh one."""
    if requested not in (None, "auto"):
        return _forced(requested, "--accel", f"--accel {requested}")
    forced = os.environ.get("DISKKIT_ACCEL", "").strip()
    if forced:
        return _forced(forced, "DISKKIT_ACCEL", f"DISKKIT_ACCEL={forced}")
    if not os.path.exists(KVM_DEVICE):
        return Accel("qemu", f"no {KVM_DEVICE} on this host")
    if qemu_cannot_open is not None:
        return Accel("qemu", f"{KVM_DEVICE} exists but {qemu_cannot_open} cannot open it; {FORCE_HINT}")
    if not os.access(KVM_DEVICE, os.R_OK | os.W_OK, effective_ids=True):
        return Accel("qemu", f"{KVM_DEVICE} exists but uid {os.geteuid()} cannot open it read-write (not in its group?)")
    if cache_dir is None:
        from launcher.node.cache import default_root
        cache_dir = default_root()
    path, boot_id = _cache_file(Path(cache_dir), qemu) or (None, "")
    if path is not None:
        try:
            record = json.loads(path.read_text())
            return _probed(bool(record["works"]), str(record.get("reason") or "probed earlier"), f"this boot's probe, kept in {path}")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # absent or torn: probe again
    works, reason = probe_kvm(qemu, timeout)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            for old in path.parent.glob("*.json"):  # results from earlier boots are void
                if not old.name.startswith(f"{boot_id}_"):
                    old.unlink(missing_ok=True)
            write_atomic(path, json.dumps({"works": works, "reason": reason, "qemu": qemu}).encode() + b"\n")
        except (OSError, DiskkitError):
            pass  # a read-only cache only costs the next run another probe
    return _probed(works, reason, "probed now")


def _forced(value: str, option: str, by: str) -> Accel:
    value = value.lower()
    if value not in ("kvm", "tcg", "qemu"):
        raise DiskkitError(option, f"must be kvm, tcg or qemu, not {value!r}")
    return Accel("kvm" if value == "kvm" else "qemu", f"{by} asks for it")


def _probed(works: bool, reason: str, when: str) -> Accel:
    if works:
        return Accel("kvm", f"a probe guest ran under KVM ({reason}; {when})")
    return Accel("qemu", f"{KVM_DEVICE} exists but KVM is not used: {reason} ({when}); {FORCE_HINT}")

