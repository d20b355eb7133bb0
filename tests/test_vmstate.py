"""A VM's EFI firmware and kept state (launcher.volumes.vmstate): KubeVirt's OVMF choice; each run works on
a copy of the VM's kept variable store and TPM state in its run directory, kept back after; a root launcher
never writes, chowns or reads through a name the qemu user or the VM's uid could have planted, and
keeps nothing that is not the run's own regular file. Needs Debian's ovmf (scripts/setup.sh installs it)."""

from __future__ import annotations

import os
import shutil
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


def _vm(persistent: bool = True, kind: str = "VirtualMachine", tpm: bool = False) -> dict:
    template = {"domain": {"firmware": {"bootloader": {"efi": {"secureBoot": False, "persistent": persistent}}},
                           "resources": {"requests": {"memory": "64Mi"}}}}
    if tpm:
        template["domain"]["devices"] = {"tpm": {"persistent": persistent}}
    if kind == "VirtualMachine":
        return {"apiVersion": "kubevirt.io/v1", "kind": kind, "metadata": {"name": "win"}, "spec": {"template": {"spec": template}}}
    return {"apiVersion": "kubevirt.io/v1", "kind": kind, "metadata": {"name": "win"}, "spec": template}


def _prepare(cache: Cache, doc: dict) -> Context:
    """A run's preparation, in a fresh run directory (the last one goes, as a run's end removes it)."""
    vmi = parse_vmi(doc)
    run_dir = cache.run_dir(vmi.domain_name)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(mode=0o700)
    ctx = Context(vmi, cache, run_dir, None, None, True, Storage(), qemu=QEMU)
    vmstate.prepare(ctx)
    return ctx


def _keep(cache: Cache, doc: dict) -> list[str]:
    vmi = parse_vmi(doc)
    return vmstate.keep(cache.root, vmi.domain_name, cache.run_dir(vmi.domain_name), vmstate.kept_state(vmi))


def _store(cache: Cache) -> Path:
    return cache.root / "state" / "default_win" / "win_VARS.fd"


def _run_store(cache: Cache) -> Path:
    return cache.run_dir("default_win") / "nvram" / "win_VARS.fd"


def test_a_vms_store_is_made_once_and_kept_from_the_copy_its_run_wrote(tmp_path):
    cache = Cache(tmp_path / "cache")
    code, template, store = _prepare(cache, _vm()).out.efi
    assert Path(store) == _run_store(cache)  # qemu opens the run directory's copy, never the kept one
    assert Path(store).read_bytes() == Path(template).read_bytes()
    assert not _store(cache).exists()
    _run_store(cache).write_bytes(b"\x01" + _run_store(cache).read_bytes()[1:])  # what the guest's firmware wrote
    assert _keep(cache, _vm()) == []
    assert _store(cache).read_bytes()[:1] == b"\x01"
    _prepare(cache, _vm())
    assert _run_store(cache).read_bytes()[:1] == b"\x01"
    if os.geteuid() == 0:
        # nothing of the kept state is any qemu's: its uid may be another VM's by the next run
        st, top = _store(cache).stat(), _store(cache).parent.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600)
        assert (top.st_uid, top.st_gid, stat.S_IMODE(top.st_mode)) == (0, 0, 0o700)


def test_without_persistence_or_for_a_bare_vmi_the_store_goes_with_the_run(tmp_path):
    cache = Cache(tmp_path / "cache")
    for doc in (_vm(persistent=False), _vm(kind="VirtualMachineInstance")):
        ctx = _prepare(cache, doc)
        assert Path(ctx.out.efi[2]).parent == ctx.run_dir / "nvram"
        assert _keep(cache, doc) == []
    assert not (cache.root / "state" / "default_win").exists()
    assert ctx.out.notes and "last as long as it runs" in ctx.out.notes[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="a root launcher runs the swtpm")
def test_a_vms_tpm_state_is_copied_into_its_run_and_kept_back(tmp_path):
    cache = Cache(tmp_path / "cache")
    doc = _vm(tpm=True)
    assert vmstate.kept_state(parse_vmi(doc))["tpm"] is True
    ctx = _prepare(cache, doc)
    tpm = ctx.run_dir / "tpm"
    assert tpm.is_dir() and not (tpm / vmstate.TPM_STATE).exists()  # a new TPM: swtpm_setup makes it (launcher.runtime.swtpm)
    (tpm / vmstate.TPM_STATE).write_bytes(b"nv state of run 1")
    (tpm / ".lock").write_bytes(b"")
    assert _keep(cache, doc) == []
    kept = cache.root / "state" / "default_win" / vmstate.TPM_STATE
    assert kept.read_bytes() == b"nv state of run 1" and not (kept.parent / ".lock").exists()
    ctx = _prepare(cache, doc)
    assert (ctx.run_dir / "tpm" / vmstate.TPM_STATE).read_bytes() == b"nv state of run 1"
    assert vmstate.kept_state(parse_vmi(_vm(tpm=True, kind="VirtualMachineInstance"))) == {}  # a bare VMI's goes with it


def _plant(target: Path, plant: str, secret: Path) -> None:
    target.unlink(missing_ok=True)
    if plant == "symlink":
        target.symlink_to(secret)
    elif plant == "hardlink":
        os.link(secret, target)
    elif plant == "fifo":
        os.mkfifo(target)
    else:  # grown past what it may be
        target.write_bytes(bytes(vmstate.TPM_STATE_MAX + 1))


@pytest.mark.skipif(os.geteuid() != 0, reason="root's guarantee")
@pytest.mark.parametrize("plant", ["symlink", "hardlink", "fifo", "oversized"])
@pytest.mark.parametrize("what", ["efi", "tpm"])
def test_what_a_vms_uid_leaves_in_its_run_is_kept_only_as_its_own_regular_file(tmp_path, plant, what):
    # The run's copies are the VM's uid's while it runs: it can put anything under their names in tpm/
    # (its own directory), or grow the store. Root keeps none of it, reads no file it names, and the state
    # kept before stays; before, a link there would have been read by root and handed to the VM's next run.
    cache = Cache(tmp_path / "cache")
    doc = _vm(tpm=True)
    ctx = _prepare(cache, doc)
    (ctx.run_dir / "tpm" / vmstate.TPM_STATE).write_bytes(b"nv state of run 1")
    assert _keep(cache, doc) == []
    before = {p.name: p.read_bytes() for p in _store(cache).parent.iterdir()}
    ctx = _prepare(cache, doc)
    target = _run_store(cache) if what == "efi" else ctx.run_dir / "tpm" / vmstate.TPM_STATE
    secret = tmp_path / "shadow"
    data = ROOT_ONLY.ljust(target.stat().st_size, b"\0")  # a store's size: only the link is wrong with it
    secret.write_bytes(data)
    secret.chmod(0o600)
    _plant(target, plant, secret)
    said = _keep(cache, doc)
    assert len(said) == 1 and str(target) in said[0] and "\n" not in said[0], said
    assert {p.name: p.read_bytes() for p in _store(cache).parent.iterdir()} == before
    st = secret.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode), secret.read_bytes()) == (0, 0o600, data)


@pytest.mark.skipif(os.geteuid() != 0, reason="root's guarantee")
@pytest.mark.parametrize("plant", ["symlink", "hardlink"])
def test_a_store_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path, plant):
    # The state directory is root's (0700): only root can put a name there. Should a name be there all the
    # same (a cache moved in, an older launcher's), root neither follows nor copies it.
    cache = Cache(tmp_path / "cache")
    _prepare(cache, _vm())
    assert _keep(cache, _vm()) == []
    secret = tmp_path / "shadow"
    secret.write_bytes(ROOT_ONLY)
    secret.chmod(0o600)
    _plant(_store(cache), plant, secret)
    with pytest.raises(DiskkitError) as err:
        _prepare(cache, _vm())
    assert "link" in str(err.value) and "\n" not in str(err.value)
    st = secret.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode), secret.read_bytes()) == (0, 0o600, ROOT_ONLY)
    assert not _run_store(cache).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="root's guarantee")
def test_a_state_directory_root_did_not_make_is_refused(tmp_path):
    cache = Cache(tmp_path / "cache")
    theirs = cache.root / "state" / "default_win"
    theirs.mkdir()
    os.chown(theirs, *QEMU)
    with pytest.raises(DiskkitError) as err:
        _prepare(cache, _vm())
    assert "is not root's" in str(err.value)
    _prepare(cache, _vm(persistent=False))
    assert not (theirs / "win_VARS.fd").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="root's guarantee")
def test_a_store_an_older_launcher_gave_to_qemu_is_taken_back(tmp_path):
    # Before, the kept store was the qemu user's (107) in a root:107 0710 directory: uid 107, any local
    # process of it, reached it. Its bytes are kept; the directory and the next kept copy are root's alone.
    cache = Cache(tmp_path / "cache")
    _prepare(cache, _vm())
    _keep(cache, _vm())
    os.chown(_store(cache), *QEMU)
    os.chown(_store(cache).parent, 0, QEMU[1])
    _store(cache).parent.chmod(0o710)
    _prepare(cache, _vm())
    top = _store(cache).parent.stat()
    assert (top.st_uid, top.st_gid, stat.S_IMODE(top.st_mode)) == (0, 0, 0o700)
    _keep(cache, _vm())
    assert _store(cache).stat().st_uid == 0


def test_a_store_from_another_firmware_is_refused(tmp_path):
    cache = Cache(tmp_path / "cache")
    _prepare(cache, _vm())
    _keep(cache, _vm())
    _store(cache).write_bytes(bytes(4096))
    with pytest.raises(DiskkitError) as err:
        _prepare(cache, _vm())
    assert str(err.value).startswith(f"{_store(cache)}: was made from another firmware's template (4096 bytes")
