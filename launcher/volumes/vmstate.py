"""A VM's EFI firmware, its TPM's files, and the state KubeVirt keeps for a VM in a claim of its own.

The firmware is KubeVirt's efi.DetectEFIEnvironment over the node's OVMF (/usr/share/OVMF): a code
file with secure boot's infrastructure (KubeVirt prefers it with secure boot off too) and the template
of its variable store, with Microsoft's keys enrolled for secure boot. Debian's ovmf names them
OVMF_CODE_4M.secboot.fd, OVMF_VARS_4M.fd and OVMF_VARS_4M.ms.fd (what its firmware descriptors give
libvirt's own auto-selection); KubeVirt's launcher image names them OVMF_CODE.secboot.fd,
OVMF_VARS.fd and OVMF_VARS.secboot.fd. Every VM boots with a variable store of its own,
`<name>_VARS.fd`, a copy of the template (compute/os.go).

KubeVirt keeps the persistent state of a VM (efi.persistent's variable store, a persistent TPM's)
in a backend-storage claim the VirtualMachine owns; a bare VMI's claim is the VMI's and goes with
it (pkg/storage/backend-storage). Here a VirtualMachine's kept state is `<cache>/state/<domain>/`,
which no qemu and no swtpm ever opens: root's (a root launcher's) and 0700, it holds the variable
store and swtpm's NV state (`tpm2-00.permall`) between runs. A run gets a copy in its run directory
(`nvram/`, `tpm/`), which goes to the VM's own uid with the rest of it (launcher.runtime.rundir), and
`keep` copies what qemu and swtpm left there back, atomically, once they have ended; the run directory
then goes. So nothing in the node's state belongs to a VM's uid, which a later VM may get: a VM's uid
reaches its own state only while it runs, and only its own copy. A store without `persistent` (or a
bare VMI's) is made afresh in the run directory and goes with it.

A root launcher's VM runs its TPM's swtpm itself, as the VM's uid (launcher.runtime.swtpm): the
system daemon would run it as qemu.conf's swtpm_user (tss), whose socket a qemu of the VM's own uid
cannot open with no relabelling, and a VM's own session daemon would keep its state in a HOME that
goes at the VM's stop. Under an unprivileged launcher libvirt runs it, as KubeVirt's does, and keeps
a persistent TPM's state per domain UUID in the user's `$XDG_CONFIG_HOME/libvirt/qemu/swtpm/<uuid>/`;
the VM's UUID is stable (firmware.uuid, else derived from its namespace and name), and a bare VMI's
run removes it at the end (`drops_tpm_state`).
"""

from __future__ import annotations

import os
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.hostfs.dirfd import Dir
from launcher.node.cache import entry_name, private_dirs, within
from launcher.spec.vmi import VMI
from launcher.volumes.context import Context

OVMF_DIR = Path("/usr/share/OVMF")
# (code, variable-store template), the first pair found wins
SECURE = (("OVMF_CODE_4M.secboot.fd", "OVMF_VARS_4M.ms.fd"), ("OVMF_CODE.secboot.fd", "OVMF_VARS.secboot.fd"))
INSECURE = (("OVMF_CODE_4M.secboot.fd", "OVMF_VARS_4M.fd"), ("OVMF_CODE_4M.fd", "OVMF_VARS_4M.fd"),
            ("OVMF_CODE.secboot.fd", "OVMF_VARS.fd"), ("OVMF_CODE.fd", "OVMF_VARS.fd"))
TEMPLATE_MAX = 64 << 20  # OVMF's stores are 128 KiB or 528 KiB; read no more than this of a file called one
STATE = "state"
NVRAM_DIR = "nvram"  # in the run directory, as libvirt's /var/lib/libvirt/qemu/nvram in KubeVirt's pod
TPM_DIR = "tpm"  # in the run directory: the swtpm's state directory, the VM's uid's while it runs
# swtpm's NV state of a TPM 2.0 (libtpms' permanent state: seeds, NV indices, the reset count): what
# outlives a power-off. Its volatile state is saved only for suspend and migration, which do not happen here.
TPM_STATE = "tpm2-00.permall"
TPM_STATE_MAX = 4 << 20  # libtpms' NV is some 128 KiB; a TPM 2.0's permanent state stays well below this


def firmware(secure: bool, directory: Path = OVMF_DIR) -> tuple[Path, Path] | None:
    """(code, template) for EFI with or without secure boot; None when the node has neither pair."""
    for code, template in SECURE if secure else INSECURE:
        if (directory / code).is_file() and (directory / template).is_file():
            return directory / code, directory / template
    return None


def persistent_efi(vmi: VMI) -> bool:
    return vmi.domain.firmware.bootloader == "efi" and vmi.domain.firmware.efi_persistent and vmi.from_vm


def drops_tpm_state(vmi: VMI) -> bool:
    """A bare VMI's persistent TPM goes with its run (KubeVirt ties its claim to the VMI); a VirtualMachine's stays."""
    return vmi.domain.devices.tpm is not None and vmi.domain.devices.tpm.persistent and not vmi.from_vm


def launcher_runs_tpm(vmi: VMI) -> bool:
    """Whether the launcher runs the VM's swtpm itself (a root launcher; launcher.runtime.swtpm) rather than libvirt."""
    return vmi.domain.devices.tpm is not None and os.geteuid() == 0


def persistent_tpm(vmi: VMI) -> bool:
    """Whether the launcher keeps the TPM's state in the VM's kept state (libvirt keeps it otherwise)."""
    return launcher_runs_tpm(vmi) and vmi.domain.devices.tpm.persistent and vmi.from_vm


def kept_state(vmi: VMI) -> dict:
    """What a run keeps for its next one, for its record: the variable store's name and size (its template's),
    and whether the TPM's state."""
    found = {}
    chosen = firmware(vmi.domain.firmware.secure_boot)
    if persistent_efi(vmi) and chosen is not None:
        found["efi"], found["efiSize"] = store_name(vmi), chosen[1].stat().st_size
    if persistent_tpm(vmi):
        found["tpm"] = True
    return found


def notes(vmi: VMI) -> list[str]:
    found = []
    if vmi.domain.firmware.efi_persistent and not vmi.from_vm:
        found.append("spec.domain.firmware.bootloader.efi.persistent: a VirtualMachineInstance's EFI variables last as long as"
                     " it runs, as KubeVirt ties their claim to the VMI; a VirtualMachine's are kept from one run to the next")
    if drops_tpm_state(vmi):
        found.append("spec.domain.devices.tpm.persistent: a VirtualMachineInstance's TPM state lasts as long as it runs, as"
                     " KubeVirt ties its claim to the VMI; a VirtualMachine's is kept from one run to the next")
    return found


def state_dir(cache_root: Path, vmi: VMI) -> Path:
    return _state_dir(cache_root, vmi.domain_name)


def _state_dir(cache_root: Path, domain: str) -> Path:
    return within(cache_root / STATE, entry_name(domain))


def store_name(vmi: VMI) -> str:
    return f"{entry_name(vmi.name)}_VARS.fd"


def tpm_dir(run_dir: Path) -> Path:
    return run_dir / TPM_DIR


def prepare(ctx: Context) -> None:
    """The EFI firmware and the VM's variable store in its run directory (made with `create`), from its kept
    state or the template; the kept TPM state of a TPM the launcher runs, in the run directory's tpm/."""
    vmi = ctx.vmi
    for note in notes(vmi):
        ctx.note(note)
    if ctx.create and launcher_runs_tpm(vmi):
        kept = _kept(ctx.cache.root, vmi.domain_name, TPM_STATE, TPM_STATE_MAX) if persistent_tpm(vmi) else None
        private_dirs(ctx.run_dir, tpm_dir(ctx.run_dir))
        if kept is not None:
            _write_new(tpm_dir(ctx.run_dir), TPM_STATE, kept)
    if vmi.domain.firmware.bootloader != "efi":
        return
    found = firmware(vmi.domain.firmware.secure_boot)
    if found is None:
        return  # the render refuses in KubeVirt's words
    code, template = found
    store = ctx.run_dir / NVRAM_DIR / store_name(vmi)
    if ctx.create:
        data = _template(template)
        kept = _kept(ctx.cache.root, vmi.domain_name, store.name, TEMPLATE_MAX) if persistent_efi(vmi) else None
        if kept is not None and len(kept) != len(data):
            raise DiskkitError(_state_dir(ctx.cache.root, vmi.domain_name) / store.name,
                               f"was made from another firmware's template ({len(kept)} bytes, {template} has {len(data)});"
                               f" remove it to boot with fresh EFI variables")
        private_dirs(ctx.run_dir, store.parent)
        _write_new(store.parent, store.name, data if kept is None else kept)  # qemu's once the run directory is handed over
    ctx.out.efi = (str(code), str(template), str(store))


def _template(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(TEMPLATE_MAX + 1)
    except OSError as exc:
        raise DiskkitError(path, f"cannot be read ({exc.strerror})") from None
    if len(data) > TEMPLATE_MAX:
        raise DiskkitError(path, f"is larger than {TEMPLATE_MAX} bytes: not an EFI variable store")
    return data


def _write_new(directory: Path, name: str, data: bytes) -> None:
    with Dir.open(directory) as here:
        fd = here.create(name, 0o600)
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                f.write(data)
        finally:
            os.close(fd)


def _own_state(cache_root: Path, domain: str, make: bool) -> Dir | None:
    """The VM's state directory, held open: root's alone (one root did not make is refused), 0700; None
    when it is not there and not to be made."""
    path = _state_dir(cache_root, domain)
    with Dir.open(path.parent) as top:
        if top.lstat(path.name) is None:
            if not make:
                return None
            top.mkdir(path.name)
        own = top.subdir(path.name)
    try:
        if os.geteuid() == 0:
            if os.fstat(own.fd).st_uid != 0:
                raise DiskkitError(own.path, "is not root's; a root launcher keeps a VM's state only in directories it made")
            os.fchown(own.fd, 0, 0)  # a root:qemu 0710 one of an older launcher's: no qemu opens anything here now
        os.fchmod(own.fd, 0o700)
    except BaseException:
        own.close()
        raise
    return own


def _kept(cache_root: Path, domain: str, name: str, limit: int) -> bytes | None:
    """A kept file's bytes (None when there is none): a regular file with one link, no link followed."""
    own = _own_state(cache_root, domain, make=False)
    if own is None:
        return None
    with own:
        return own.read_bytes(name, limit)


def keep(cache_root: Path, domain: str, run_dir: Path, kept: dict) -> list[str]:
    """What qemu and swtpm left in the run directory becomes the VM's kept state, each file whole or not
    at all; called once they have ended (what a VM's uid can still do to its copy is its own state's
    business). The files are the VM's uid's: each is read through the run directory's fds, never through
    a link, a regular file with one link, at most its limit (a variable store: the size it was made
    with). What cannot be kept is said, one line each, and the last kept state stays."""
    wanted = []
    efi = kept.get("efi")
    if isinstance(efi, str) and efi.endswith("_VARS.fd") and "/" not in efi and isinstance(kept.get("efiSize"), int):
        wanted.append((NVRAM_DIR, efi, min(kept["efiSize"], TEMPLATE_MAX)))
    if kept.get("tpm") is True:
        wanted.append((TPM_DIR, TPM_STATE, TPM_STATE_MAX))
    said = []
    for directory, name, limit in wanted:
        try:
            data = _left(run_dir, directory, name, limit)
            if data is None:
                continue  # the run ended before it was made: the last kept state stays
            if directory == NVRAM_DIR and len(data) != limit:
                raise DiskkitError(run_dir / directory / name, f"is {len(data)} bytes, not the {limit} of the store it was made as")
            with _own_state(cache_root, domain, make=True) as own:
                own.replace(name, data, 0o600)
        except DiskkitError as exc:
            said.append(f"{exc}; the state kept before this run stays")
    return said


def _left(run_dir: Path, directory: str, name: str, limit: int) -> bytes | None:
    try:
        top = Dir.open(run_dir)
    except DiskkitError:
        return None  # no run directory: nothing of this run to keep
    with top:
        if top.lstat(directory) is None:
            return None
        with top.subdir(directory) as here:
            return here.read_bytes(name, limit)
