"""A VM's EFI firmware and the state KubeVirt keeps for it in a claim of its own: where each lives here.

The firmware is KubeVirt's efi.DetectEFIEnvironment over the node's OVMF (/usr/share/OVMF): a code
file with secure boot's infrastructure (KubeVirt prefers it with secure boot off too) and the template
of its variable store, with Microsoft's keys enrolled for secure boot. Debian's ovmf names them
OVMF_CODE_4M.secboot.fd, OVMF_VARS_4M.fd and OVMF_VARS_4M.ms.fd (what its firmware descriptors give
libvirt's own auto-selection); KubeVirt's launcher image names them OVMF_CODE.secboot.fd,
OVMF_VARS.fd and OVMF_VARS.secboot.fd. Every VM boots with a variable store of its own,
`<name>_VARS.fd`, a copy of the template (compute/os.go).

KubeVirt keeps the persistent state of a VM (efi.persistent's variable store, a persistent TPM's)
in a backend-storage claim the VirtualMachine owns; a bare VMI's claim is the VMI's and goes with
it (pkg/storage/backend-storage). Here:
- a VirtualMachine's persistent variable store lives in the node's state, `<cache>/state/<domain>/`
  (root's and qemu's group may pass, the file qemu's), made from the template on its first run and
  booted by every later one; otherwise the store is made afresh in the run directory and goes with it;
- a persistent TPM's state is swtpm's, kept by libvirt per domain UUID in its swtpm directory (the
  qemu user's session daemon: `$XDG_CONFIG_HOME/libvirt/qemu/swtpm/<uuid>/`, which for a root
  launcher's own daemon leads to `<cache>/state/swtpm/<uuid>/`, launcher.runtime.sessiond; the system
  daemon: /var/lib/libvirt/swtpm/<uuid>/). The VM's UUID is stable (firmware.uuid, else derived from its
  namespace and name), libvirt keeps persistent state when the domain goes, and a bare VMI's run
  removes it at the end (`drops_tpm_state`).
"""

from __future__ import annotations

import os
from pathlib import Path

from diskkit.errors import DiskkitError
from diskkit.streams.fsutil import write_atomic
from launcher.hostfs.dirfd import Dir, give
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
TRAVERSE = 0o710


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
    return within(cache_root / STATE, entry_name(vmi.domain_name))


def prepare(ctx: Context) -> None:
    """The EFI firmware and the VM's variable store, made (with `create`) unless a kept one is reused."""
    vmi = ctx.vmi
    for note in notes(vmi):
        ctx.note(note)
    if vmi.domain.firmware.bootloader != "efi":
        return
    found = firmware(vmi.domain.firmware.secure_boot)
    if found is None:
        return  # the render refuses in KubeVirt's words
    code, template = found
    name = f"{entry_name(vmi.name)}_VARS.fd"
    if persistent_efi(vmi):
        store = state_dir(ctx.cache.root, vmi) / name
        if ctx.create:
            _kept_store(store, template, ctx.qemu)
    else:
        store = ctx.run_dir / NVRAM_DIR / name
        if ctx.create:
            private_dirs(ctx.run_dir, store.parent)
            write_atomic(store, _template(template), 0o600)  # qemu's once the run directory is handed over
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


def _kept_store(store: Path, template: Path, qemu: tuple[int, int]) -> None:
    """The store in the VM's state directory, made from the template the first time; a kept one must be a
    regular file of the template's size (no link followed) and is given to qemu through its fd."""
    with Dir.open(store.parent.parent) as top:
        if top.lstat(store.parent.name) is None:
            top.mkdir(store.parent.name)
        with top.subdir(store.parent.name) as own:
            if os.geteuid() == 0:
                if os.fstat(own.fd).st_uid != 0:
                    raise DiskkitError(own.path, "is not root's; a root launcher keeps a VM's state only in directories it made")
                os.fchown(own.fd, 0, qemu[1])
                os.fchmod(own.fd, TRAVERSE)
            data = _template(template)
            st = own.regular(store.name)
            if st is None:
                own.replace(store.name, data, 0o600, owner=qemu)
                return
            if st.st_size != len(data):
                raise DiskkitError(store, f"was made from another firmware's template ({st.st_size} bytes, {template} has"
                                          f" {len(data)}); remove it to boot with fresh EFI variables")
            fd = own.open_file(store.name)
            try:
                give(fd, qemu, 0o600)
            finally:
                os.close(fd)
