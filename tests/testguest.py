"""Helpers for the diskkit test guest (images/testguest).

The test guest is a 64 MiB BIOS-bootable disk whose /init reports every disk it
sees on the serial console (size, first bytes, serial, ISO 9660 contents), bumps a
stamp in the last sector of every writable non-ISO disk and powers off.

    ensure_testguest()   build (or reuse) the guest, return its output directory
    parse_console(text)  console text -> dict
    boot_qemu(disks)     boot under TCG, return the console text
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

REPO = Path(__file__).resolve().parent.parent
SRC_DIR = REPO / "images" / "testguest"
BUILD_SH = SRC_DIR / "build.sh"
INIT = SRC_DIR / "init"
SCSI_PR = SRC_DIR / "scsi-pr.c"
CMDLINE = SRC_DIR / "cmdline"
OUTPUTS = ("testguest.qcow2", "testguest-poweroff.qcow2", "vmlinuz", "initrd.img")
# testguest-poweroff.qcow2's APPEND line (for -kernel/-initrd boots): the guest powers off once it has
# reported, for the tests that wait for the end.
KERNEL_CMDLINE = CMDLINE.read_text().strip() + " diskkit.poweroff"
QEMU = "qemu-system-x86_64"


def testguest_dir() -> Path:
    env = os.environ.get("DISKKIT_TESTGUEST_DIR")
    return Path(env).resolve() if env else REPO / "build" / "testguest"


def guest_is_current(out: Path) -> bool:
    """Outputs present and built from the current build.sh + init.

    Mirrors build.sh's cache key (sha256 of build.sh, init, scsi-pr.c, cmdline, deb filename) using
    the .deb kept in OUTDIR/cache, so no apt call is needed to detect staleness
    after an edit of build.sh or init. A key that does not match build.sh's runs build.sh at every
    call (1-2 s each): test_testguest checks the two agree.
    """
    if not all((out / name).is_file() for name in OUTPUTS):
        return False
    try:
        recipe = (out / "recipe.sha256").read_text().strip()
    except FileNotFoundError:
        return False
    body = BUILD_SH.read_bytes() + INIT.read_bytes() + SCSI_PR.read_bytes() + CMDLINE.read_bytes()
    for deb in (out / "cache").glob("linux-image-*.deb"):
        if hashlib.sha256(body + deb.name.encode() + b"\n").hexdigest() == recipe:
            return True
    return False


def ensure_testguest() -> Path:
    """Return the directory holding testguest.qcow2 (stays up until its power button is pressed),
    testguest-poweroff.qcow2 (powers off once it has reported), vmlinuz and initrd.img.

    Uses $DISKKIT_TESTGUEST_DIR if set, else <repo>/build/testguest; runs
    images/testguest/build.sh there when the outputs are missing or stale.
    """
    out = build_once(testguest_dir(), BUILD_SH, guest_is_current)
    missing = [name for name in OUTPUTS if not (out / name).is_file()]
    if missing:
        raise RuntimeError(f"build.sh did not produce {missing} in {out}")
    return out



def build_once(out: Path, build_sh: Path, is_current) -> Path:
    """`out`, built by `bash build_sh out` unless `is_current(out)`: once, whichever test worker asks first."""
    if is_current(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers build once
        if not is_current(out):
            proc = subprocess.run(["bash", str(build_sh), str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{build_sh} {out} failed ({proc.returncode}):\n{proc.stdout}")
    return out

# ---------------------------------------------------------------------------
# console parsing

_DISK = re.compile(r"DISK name=(\S+) size=(\d+) ro=([01]) serial=(.*) head=([0-9a-f]*)$")
_ISO = re.compile(r"ISO name=(\S+) label=(.*)$")
_ISO_FILE = re.compile(r"ISO-FILE name=(\S+) path=(.*) size=(\d+)$")
_ISO_DATA = re.compile(r"ISO-DATA name=(\S+) path=(.*?) \|(?: (.*))?$")
_STAMP = re.compile(r"STAMP name=(\S+) before=(\d+) after=(\d+)$")
_UNSYNCED = re.compile(r"UNSYNCED name=(\S+) before=(\d+) after=(\d+)$")
_CPUS = re.compile(r"CPUS count=(\d+) mem_kib=(\d+)$")
_FS = re.compile(r"FS tag=(\S+) files=(\d+)$")
_FS_FILE = re.compile(r"FS-FILE tag=(\S+) path=(.*) size=(\d+)$")
_FS_DATA = re.compile(r"FS-DATA tag=(\S+) path=(.*?) \|(?: (.*))?$")
_FS_WROTE = re.compile(r"FS-WROTE tag=(\S+) (ok|failed)$")
_SSH = re.compile(r"SSH keys=(\d+) (started|off)(?: (.*))?$")
_ATTACK = re.compile(r"ATTACK tag=(\S+) uid=(\d+) what=(\S+) (ok|failed)(?:: (.*))?$")
_TPM = re.compile(r"TPM dev=(\S+) version=(\S+) driver=(\S*) resets=(\S+)$")
_EFI = re.compile(r"EFI var=(\S+) before=(\d+) (?:after=(\d+)|failed)$")
_PR = re.compile(r"PR name=(\S+) key=(\S+) register=(\S+) reserve=(\S+) keys=([0-9a-f]+) first=([0-9a-f]+) holder=(\S+) type=([0-9a-f]+)$")


def parse_console(text: str) -> dict[str, Any]:
    """Turn the guest's console output into a dict.

    {"ready": bool, "done": bool,
     "disks": {name: {"size": int, "ro": bool, "serial": str | None, "head": str}},
     "isos": {name: {"label": str, "files": {path: content}, "sizes": {path: int}}},
     "stamps": {name: (before, after)},
     "unsynced": {name: (before, after)},  (a disk with serial unsynced: the number written last boot, left in the page cache)
     "cpus": int, "mem_kib": int,   (vCPUs online and MemTotal, once the guest reported them)
     "filesystems": {tag: {"files": {path: content}, "sizes": {path: int}, "wrote": bool}},  (virtiofs tags fs0..fs7)
     "acpi_poweroff": bool,  (the guest powered off because its ACPI power button was pressed)
     "rng": str,  (the kernel's current hardware RNG: virtio_rng.0, or none)
     "attacks": {(tag, uid, what): succeeded},  (a disk with serial attack-fs: what the hostile guest tried on its shares)
     "attack_errors": {(tag, uid, what): reason},  (why a failed one failed, e.g. "Read-only file system")
     "ssh": {"keys": int, "started": bool, "why": str} | None,  (a guest with a NIC: dropbear on port 22, or why not)
     "hypervisor": str,  (what the kernel detected: "Microsoft Hyper-V", "KVM", or "none")
     "tpm": {"dev": str, "version": str, "driver": str, "resets": int | None} | None,  (None: no TPM; resets from TPM2_ReadClock)
     "efi": {"before": int, "after": int | None} | None,  (None: not booted by EFI; the guest's boot counter in an EFI variable)
     "reservations": {name: {"key", "register", "reserve", "keys", "first", "holder", "type"}},  (a disk with serial pr-KEY:
        the guest's SCSI persistent reservation; register/reserve "ok", a SCSI status or "sg-error"; keys an int; first, holder hex)
     "warnings": [str]}

    File content is rebuilt from the ISO-DATA lines, each terminated by "\\n"
    (the guest reports at most 50 lines per file; "\\r" and NUL are dropped).
    Unknown lines (kernel messages) are ignored.
    """
    res: dict[str, Any] = {"ready": False, "done": False, "disks": {}, "isos": {},
                           "stamps": {}, "unsynced": {}, "cpus": None, "mem_kib": None, "filesystems": {}, "warnings": [], "acpi_poweroff": False, "rng": None,
                           "attacks": {}, "attack_errors": {}, "ssh": None, "hypervisor": None, "tpm": None, "efi": None,
                           "reservations": {}}
    for raw in text.splitlines():
        line = raw.rstrip("\r")
        if "DISKKIT-TESTGUEST v1 READY" in line:
            res["ready"] = True
        elif "DISKKIT-TESTGUEST DONE" in line:
            res["done"] = True
        elif "DISKKIT-TESTGUEST ACPI-POWEROFF" in line:
            res["acpi_poweroff"] = True
        elif line.startswith("RNG current="):
            res["rng"] = line.split("=", 1)[1].strip()
        elif line.startswith("HYPERVISOR "):
            res["hypervisor"] = line.split(" ", 1)[1].strip()
        elif m := _TPM.match(line):
            res["tpm"] = {"dev": m[1], "version": m[2], "driver": m[3], "resets": None if m[4] == "-" else int(m[4])}
        elif m := _EFI.match(line):
            res["efi"] = {"before": int(m[2]), "after": None if m[3] is None else int(m[3])}
        elif m := _DISK.match(line):
            name, size, ro, serial, head = m.groups()
            res["disks"][name] = {"size": int(size), "ro": ro == "1",
                                  "serial": None if serial == "-" else serial, "head": head}
        elif m := _ISO_FILE.match(line):
            iso = res["isos"].setdefault(m[1], {"label": "", "files": {}, "sizes": {}})
            iso["files"][m[2]] = ""
            iso["sizes"][m[2]] = int(m[3])
        elif m := _ISO_DATA.match(line):
            iso = res["isos"].setdefault(m[1], {"label": "", "files": {}, "sizes": {}})
            iso["files"][m[2]] = iso["files"].get(m[2], "") + (m[3] or "") + "\n"
        elif m := _ISO.match(line):
            iso = res["isos"].setdefault(m[1], {"label": "", "files": {}, "sizes": {}})
            iso["label"] = m[2]
        elif m := _STAMP.match(line):
            res["stamps"][m[1]] = (int(m[2]), int(m[3]))
        elif m := _UNSYNCED.match(line):
            res["unsynced"][m[1]] = (int(m[2]), int(m[3]))
        elif m := _FS.match(line):
            res["filesystems"].setdefault(m[1], {"files": {}, "sizes": {}, "wrote": False})
        elif m := _FS_FILE.match(line):
            fs = res["filesystems"].setdefault(m[1], {"files": {}, "sizes": {}, "wrote": False})
            fs["files"][m[2]] = ""
            fs["sizes"][m[2]] = int(m[3])
        elif m := _FS_DATA.match(line):
            fs = res["filesystems"].setdefault(m[1], {"files": {}, "sizes": {}, "wrote": False})
            fs["files"][m[2]] = fs["files"].get(m[2], "") + (m[3] or "") + "\n"
        elif m := _FS_WROTE.match(line):
            res["filesystems"].setdefault(m[1], {"files": {}, "sizes": {}, "wrote": False})["wrote"] = m[2] == "ok"
        elif m := _ATTACK.match(line):
            res["attacks"][(m[1], int(m[2]), m[3])] = m[4] == "ok"
            if m[4] == "failed":
                res["attack_errors"][(m[1], int(m[2]), m[3])] = m[5] or ""
        elif m := _PR.match(line):
            res["reservations"][m[1]] = {"key": m[2], "register": m[3], "reserve": m[4], "keys": int(m[5], 16),
                                         "first": m[6], "holder": m[7], "type": int(m[8], 16)}
        elif m := _SSH.match(line):
            res["ssh"] = {"keys": int(m[1]), "started": m[2] == "started", "why": m[3] or ""}
        elif m := _CPUS.match(line):
            res["cpus"], res["mem_kib"] = int(m[1]), int(m[2])
        elif line.startswith("WARN "):
            res["warnings"].append(line[5:])
    return res


# ---------------------------------------------------------------------------
# booting

_DEVICES = {
    # "if" value -> (qemu device, needs virtio-scsi controller, read-only by default)
    "virtio": ("virtio-blk-pci", False, False),
    "ide-hd": ("ide-hd", False, False),
    "ide-cd": ("ide-cd", False, True),
    "scsi-hd": ("scsi-hd", True, False),
    "scsi-cd": ("scsi-cd", True, True),
}


def _qemu_path(path: os.PathLike | str) -> str:
    return str(path).replace(",", ",,")


def _detect_format(path: Path) -> str:
    with open(path, "rb") as f:
        return "qcow2" if f.read(4) == b"QFI\xfb" else "raw"


def qemu_args(
    disks: Sequence[tuple[os.PathLike | str, dict]],
    *,
    memory: int = 256,
    machine: str = "pc",
    kernel: os.PathLike | str | None = None,
    initrd: os.PathLike | str | None = None,
    append: str | None = None,
    extra_args: Iterable[str] = (),
) -> list[str]:
    """Command line for boot_qemu (see there)."""
    qemu = shutil.which(QEMU)
    if qemu is None:
        raise FileNotFoundError(f"{QEMU} not found on PATH (install qemu-system-x86)")
    args = [qemu, "-accel", "tcg", "-machine", machine, "-m", str(memory),
            "-nodefaults", "-display", "none", "-monitor", "none",
            "-serial", "stdio", "-no-reboot"]
    if kernel is not None:
        args += ["-kernel", str(kernel), "-append", append or KERNEL_CMDLINE]
        if initrd is not None:
            args += ["-initrd", str(initrd)]
    scsi = False
    for i, (path, opts) in enumerate(disks):
        path = Path(path)
        opts = dict(opts)
        iface = opts.pop("if", "virtio")
        device, needs_scsi, ro_default = _DEVICES.get(iface, (iface, False, False))
        fmt = opts.pop("format", None) or _detect_format(path)
        readonly = opts.pop("readonly", ro_default)
        serial = opts.pop("serial", None)
        cache = opts.pop("cache", None)
        if opts:
            raise ValueError(f"unknown disk options for {path}: {sorted(opts)}")
        drive = f"file={_qemu_path(path)},format={fmt},if=none,id=disk{i}"
        if readonly:
            drive += ",readonly=on"
        if cache:
            drive += f",cache={cache}"
        dev = f"{device},drive=disk{i}"
        if needs_scsi:
            if not scsi:
                args += ["-device", "virtio-scsi-pci,id=scsi0"]
                scsi = True
            dev += ",bus=scsi0.0"
        if serial:
            dev += f",serial={serial}"
        if i == 0 and kernel is None:
            dev += ",bootindex=0"
        args += ["-drive", drive, "-device", dev]
    args += list(extra_args)
    return args


def boot_qemu(
    disks: Sequence[tuple[os.PathLike | str, dict]],
    timeout: float = 90,
    **kwargs: Any,
) -> str:
    """Boot the test guest under TCG and return the serial console text.

    disks: [(path, options)], the first one is the boot disk (bootindex 0, unless
    kernel= is given). Options: "format" ("qcow2"/"raw", default: sniffed),
    "if" ("virtio" (default), "ide-hd", "ide-cd", "scsi-hd", "scsi-cd" (on a
    virtio-scsi controller), or any other qemu device name), "serial",
    "readonly" (default on for *-cd), "cache".
    Keyword arguments: memory, machine ("pc"; note: the cloud kernel has no
    AHCI, so q35's SATA disks are invisible to the guest), kernel/initrd/append
    for a direct kernel boot, extra_args.

    Returns once the guest printed DONE and powered off (so its writes are on
    disk), or when qemu exits. Raises TimeoutError after `timeout` seconds and
    RuntimeError if qemu exits with an error.
    """
    args = qemu_args(disks, **kwargs)
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    chunks: list[bytes] = []
    errs: list[bytes] = []

    def pump(stream, sink):
        for chunk in iter(lambda: stream.read1(65536), b""):
            sink.append(chunk)

    readers = [threading.Thread(target=pump, args=(proc.stdout, chunks), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, errs), daemon=True)]
    for t in readers:
        t.start()

    def text() -> str:
        return b"".join(chunks).decode("utf-8", "replace")

    deadline = time.monotonic() + timeout
    done_at = None
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if done_at is None and b"DISKKIT-TESTGUEST DONE" in b"".join(chunks):
                done_at = now
            # after DONE the guest syncs and powers off; give it a moment to do so
            if now > deadline or (done_at is not None and now - done_at > 15):
                raise TimeoutError(
                    f"test guest did not finish within {timeout}s "
                    f"(done={'yes' if done_at else 'no'}); console so far:\n{text()}")
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for t in readers:
            t.join(timeout=5)
    if proc.returncode != 0:
        raise RuntimeError(
            f"qemu exited with {proc.returncode}: {' '.join(args)}\n"
            f"stderr:\n{b''.join(errs).decode('utf-8', 'replace')}\nconsole:\n{text()}")
    return text()


class Running:
    """A test guest that stays up (ssh, hold-N): its console so far, and a wait for a line."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        for chunk in iter(lambda: self.proc.stdout.read1(65536), b""):
            self._chunks.append(chunk)

    def text(self) -> str:
        return b"".join(self._chunks).decode("utf-8", "replace")

    def wait_for(self, marker: str, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while marker not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise TimeoutError(f"no {marker!r} from the test guest (qemu exit {self.proc.poll()}); console:\n{self.text()}")
            time.sleep(0.1)
        return self.text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=5)


def start_qemu(disks: Sequence[tuple[os.PathLike | str, dict]], **kwargs: Any) -> Running:
    """Boot the test guest as boot_qemu does, but return at once; stop() it when done."""
    return Running(qemu_args(disks, **kwargs))
