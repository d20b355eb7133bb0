"""A VM's EFI firmware and kept variable store (launcher.volumes.vmstate): KubeVirt's OVMF choice, and a
root launcher that keeps a store in the node's state never writes, chowns or reads through a name the
qemu user could have planted. Needs Debian's ovmf (scripts/setup.sh installs it)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from diskkit.errors import DiskkitError
from launcher.node.cache import Cache
from launcher.spec.vmi import parse_vmi
from launcher.volumes import vmstate
from launcher.volumes.context import Context
from launcher.volumes.storage import Storage

QEMU = (107, 107)
ROOT_ONLY = b"root's secret\n"


def _touch(directory: Path, *names: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_bytes(b"x")
    return directory


def test_the_firmware_is_found_as_kubevirt_finds_it(tmp_path):
    # pkg/virt-launcher/virtwrap/efi/efi.go DetectEFIEnvironment: the code with secure boot's
    # infrastructure even without secure boot; Microsoft's keys enrolled for it (Debian's .ms vars)
    debian = _touch(tmp_path / "debian", "OVMF_CODE_4M.secboot.fd", "OVMF_CODE_4M.fd", "OVMF_VARS_4M.fd", "OVMF_VARS_4M.ms.fd")
    assert vmstate.firmware(False, debian) == (debian / "OVMF_CODE_4M.secboot.fd", debian / "OVMF_VARS_4M.fd")
    assert vmstate.firmware(True, debian) == (debian / "OVMF_CODE_4M.secboot.fd", debian / "OVMF_VARS_4M.ms.fd")
    kubevirt = _touch(tmp_path / "kubevirt", "OVMF_CODE.secboot.fd", "OVMF_VARS.secboot.fd", "OVMF_VARS.fd")
    assert vmstate.firmware(True, kubevirt) == (kubevirt / "OVMF_CODE.secboot.fd", kubevirt / "OVMF_VARS.secboot.fd")
    assert vmstate.firmware(False, kubevirt) == (kubevirt / "OVMF_CODE.secboot.fd", kubevirt / "OVMF_VARS.fd")
    plain = _touch(tmp_path / "plain", "OVMF_CODE_4M.fd", "OVMF_VARS_4M.fd")
    assert vmstate.firmware(False, plain) == (plain / "OVMF_CODE_4M.fd", plain / "OVMF_VARS_4M.fd")
    assert vmstate.firmware(True, plain) is None  # the render then refuses in virt-launcher's words


def _vm(persistent: bool = True, kind: str = "VirtualMachine") -> dict:
    template = {"domain": {"firmware": {"bootloader": {"efi": {"secureBoot": False, "persistent": persistent}}},
                           "resources": {"requests": {"memory": "64Mi"}}}}
    if kind == "VirtualMachine":
        return {"apiVersion": "kubevirt.io/v1", "kind": kind, "metadata": {"name": "win"}, "spec": {"template": {"spec": template}}}
    return {"apiVersion": "kubevirt.io/v1", "kind": kind, "metadata": {"name": "win"}, "spec": template}


def _prepare(cache: Cache, doc: dict) -> Context:
    vmi = parse_vmi(doc)
    run_dir = cache.run_dir(vmi.domain_name)
    run_dir.mkdir(mode=0o700, exist_ok=True)
    ctx = Context(vmi, cache, run_dir, None, None, True, Storage(), qemu=QEMU)
    vmstate.prepare(ctx)
    return ctx


def _store(cache: Cache) -> Path:
    return cache.root / "state" / "default_win" / "win_VARS.fd"


def test_a_vms_store_is_made_once_in_its_state_and_kept(tmp_path):
    cache = Cache(tmp_path / "cache")
    code, template, store = _prepare(cache, _vm()).out.efi
    assert Path(store) == _store(cache)
    assert Path(store).read_bytes() == Path(template).read_bytes()
    _store(cache).write_bytes(b"\x01" + _store(cache).read_bytes()[1:])  # what the guest's firmware wrote
    _prepare(cache, _vm())
    assert _store(cache).read_bytes()[:1] == b"\x01"
    if os.geteuid() == 0:
        st, top = _store(cache).stat(), _store(cache).parent.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*QEMU, 0o600)
        assert (top.st_uid, top.st_gid, stat.S_IMODE(top.st_mode)) == (0, QEMU[1], 0o710)


def test_without_persistence_or_for_a_bare_vmi_the_store_goes_with_the_run(tmp_path):
    cache = Cache(tmp_path / "cache")
    for doc in (_vm(persistent=False), _vm(kind="VirtualMachineInstance")):
        ctx = _prepare(cache, doc)
        assert Path(ctx.out.efi[2]).parent == ctx.run_dir / "nvram"
    assert not (cache.root / "state" / "default_win").exists()
    assert ctx.out.notes and "last as long as it runs" in ctx.out.notes[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="root's guarantee")
@pytest.mark.parametrize("plant", ["symlink", "hardlink"])
def test_a_store_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path, plant):
    # The state directory is root's (0710): only root can put a name there. Should a name be there all the
    # same (a cache moved in, an older launcher's), root neither follows nor chowns it.
    cache = Cache(tmp_path / "cache")
    _prepare(cache, _vm())
    secret = tmp_path / "shadow"
    secret.write_bytes(ROOT_ONLY)
    secret.chmod(0o600)
    _store(cache).unlink()
    if plant == "symlink":
        _store(cache).symlink_to(secret)
    else:
        os.link(secret, _store(cache))
    with pytest.raises(DiskkitError) as err:
        _prepare(cache, _vm())
    assert "link" in str(err.value) and "\n" not in str(err.value)
    st = secret.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode), secret.read_bytes()) == (0, 0o600, ROOT_ONLY)


@pytest.mark.skipif(os.geteuid() != 0, reason="root's guarantee")
def test_a_state_directory_root_did_not_make_is_refused(tmp_path):
    cache = Cache(tmp_path / "cache")
    theirs = cache.root / "state" / "default_win"
    theirs.mkdir()
    os.chown(theirs, *QEMU)
    with pytest.raises(DiskkitError) as err:
        _prepare(cache, _vm())
    assert "is not root's" in str(err.value)
    assert not (theirs / "win_VARS.fd").exists()


def test_a_store_from_another_firmware_is_refused(tmp_path):
    cache = Cache(tmp_path / "cache")
    _prepare(cache, _vm())
    _store(cache).write_bytes(bytes(4096))
    with pytest.raises(DiskkitError) as err:
        _prepare(cache, _vm())
    assert str(err.value).startswith(f"{_store(cache)}: was made from another firmware's template (4096 bytes")
