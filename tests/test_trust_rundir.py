"""A VM's run directory under a root launcher (issue 29, item 3: root never follows a path it did not make).

The run directory holds what root writes for the VM (domain.xml, overlays, empty disks, generated ISOs,
share trees, virtiofs sockets) and what qemu opens. It used to be the qemu user's from the moment it
was made, so any process of that uid (another VM's qemu after a guest escape, a launcher user who is
107) could plant a link under a name root then wrote, truncated or chowned. These tests are that user:
a real root launcher runs a real VM on the qemu user's libvirt session daemon while uid 107 tries.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from diskkit.errors import DiskkitError
from launcher.runtime import rundir
from launcher.runtime.console import ConsoleLog
from launcher.volumes.files import give_to_qemu
from tests.conftest import run_launcher
from tests.testguest import parse_console
from tests.vmhost import NOREG, QEMU_UID, QemuUser, qemu_scratch

NOBODY = 65534
VICTIM_TEXT = b"root's own, 0600: no one else writes, truncates or chowns this\n"


def as_user(uid: int, *cmd: str | os.PathLike, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *map(str, cmd)],
                          capture_output=True, text=True, **kw)


def victim_state(path: Path) -> tuple[int, int, int, bytes]:
    st = path.lstat()
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), path.read_bytes()


@pytest.fixture
def victim(tmp_path) -> Path:
    """A root-only file: pytest's tmp_path is root's 0700, so only a link planted by root's hand could reach it."""
    path = tmp_path / "root-only"
    path.write_bytes(VICTIM_TEXT)
    path.chmod(0o600)
    return path


def test_give_to_qemu_never_follows_a_link(tmp_path, victim):
    """Attack: a link where root gives a file to qemu (a virtiofs socket swapped between bind and chown):
    give_to_qemu chowned the link's target, a root-only file, to 107. Now: refused in one line, the
    target untouched."""
    assert os.geteuid() == 0, "give_to_qemu only gives as root"
    link = tmp_path / "disk.img"
    link.symlink_to(victim)
    before = victim_state(victim)
    with pytest.raises(DiskkitError) as err:
        give_to_qemu(link)
    assert str(err.value) == f"{link}: is a symbolic link; root never follows a link in a directory others can write"
    assert victim_state(victim) == before


PLANTER = r'''
run=$1 victim=$2 stop=$3
while [ ! -e "$stop" ]; do
    for name in domain.xml console.log x; do
        ln -s "$victim" "$run/$name" 2>&1 && echo "PLANTED $name"
    done
    sleep 0.02
done
'''


def test_the_qemu_user_plants_nothing_in_a_root_run_directory(qemu_user, guest_image, root_side, victim):
    """Attack: uid 107 plants links to a root-only file at domain.xml, console.log and other names of
    the VM's run directory from the moment it exists, while a root launcher prepares and runs the VM
    (root wrote domain.xml through the link: the root-only file became the domain's XML). Now: the run
    directory is root's (0700 while prepared, then root:<qemu's group> 0710), every plant fails, the VM
    boots, the file is untouched; afterwards 107 still creates, renames and removes nothing in it or its
    subdirectories, the files qemu opens are its own (owner-only modes), and other users cannot enter."""
    cache, uri = root_side
    name = "planted"
    run_dir = cache / "run" / f"default_{name}"
    vmi = qemu_user.write_vmi(name, guest_image, extra=[
        ({"name": "ci", "disk": {"bus": "virtio"}}, {"name": "ci", "cloudInitNoCloud": {"userData": "#cloud-config\npassword: s3cret\n"}}),
        ({"name": "hold", "serial": "hold-90", "disk": {"bus": "virtio"}}, {"name": "hold", "emptyDisk": {"capacity": "1Mi"}}),
    ])
    stop_file = qemu_user.root / f"{name}-stop-planting"
    before = victim_state(victim)
    planter = subprocess.Popen(["setpriv", f"--reuid={QEMU_UID}", f"--regid={QEMU_UID}", "--clear-groups", "--",
                                "/bin/sh", "-c", PLANTER, "planter", str(run_dir), str(victim), str(stop_file)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        started = run_launcher("run", NOREG, "--wait-for", "DISKKIT-TESTGUEST DONE", "--timeout", "300", "--connect", uri, vmi,
                               env={"DISKKIT_CACHE": str(cache)}, timeout=400)
    finally:
        stop_file.touch()
        tried = planter.communicate(timeout=60)[0]
    try:
        assert victim_state(victim) == before
        assert "PLANTED" not in tried, tried
        assert "Permission denied" in tried, tried  # it did try while the run directory was there
        assert started.code == 0, started.err

        # The running VM's directory: root's, qemu's group passes through, nothing more.
        st = run_dir.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, QEMU_UID, 0o710)
        console = run_dir / "console"  # qemu's own: its log daemon rotates console.log in it
        st = console.lstat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (QEMU_UID, QEMU_UID, 0o700)
        directories = [run_dir] + [Path(top) / d for top, dirs, _ in os.walk(run_dir) for d in dirs if Path(top) / d != console]
        assert len(directories) >= 4, directories  # the overlay's, the empty disk's, cloud-init's
        for directory in directories:
            st = directory.lstat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o710), directory
            planted = as_user(QEMU_UID, "ln", "-s", "/etc/shadow", directory / "x")
            assert planted.returncode != 0 and "Permission denied" in planted.stderr, (directory, planted.stderr)
        for cmd in (["mv", console, run_dir / "moved"], ["rm", "-f", run_dir / "domain.xml"],
                    ["mkdir", run_dir / "new"], ["mv", run_dir / "root", run_dir / "gone"]):
            tried = as_user(QEMU_UID, *cmd)
            assert tried.returncode != 0 and "Permission denied" in tried.stderr, (cmd, tried.stderr)

        # What qemu opens is qemu's, open to it alone; domain.xml is root's.
        iso = run_dir / "cloud-init-data" / "default" / name / "noCloud.iso"
        for path in (console / "console.log", run_dir / "root" / "disk.qcow2", run_dir / "empty-disks" / "hold.qcow2", iso):
            st = path.lstat()
            assert stat.S_ISREG(st.st_mode) and st.st_uid == QEMU_UID and not st.st_mode & 0o077, (path, oct(st.st_mode), st.st_uid)
        assert b"DISKKIT-TESTGUEST DONE" in (console / "console.log").read_bytes()
        st = (run_dir / "domain.xml").lstat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)

        # Another local user, not in qemu's group, gets nowhere.
        assert as_user(NOBODY, "ls", run_dir).returncode != 0
        assert as_user(NOBODY, "cat", iso).returncode != 0
    finally:
        stopped = run_launcher("stop", name, env={"DISKKIT_CACHE": str(cache)})
    assert stopped.code == 0, stopped.err
    assert not run_dir.exists()
    assert victim_state(victim) == before


def test_a_run_directory_is_always_made_afresh(tmp_path):
    """Attack: a run directory name left taken (a killed launcher's the cleanup could not remove, or the
    qemu user's, with links in it) is never reused: refused in one line, nothing written in it."""
    left = tmp_path / "default_vm"
    left.mkdir()
    os.chown(left, QEMU_UID, QEMU_UID)
    (left / "domain.xml").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DiskkitError) as err:
        rundir.create(left)
    assert str(err.value) == f"{left}: cannot be made afresh (File exists); a VM's run directory is always new"
    assert [p.name for p in left.iterdir()] == ["domain.xml"] and not (tmp_path / "elsewhere").exists()


def test_handing_over_gives_qemu_files_never_directories(tmp_path):
    """What open_to_qemu leaves: root's directories qemu's group traverses, qemu's owner-only files,
    a fresh console log of qemu's, and a config volume's share tree all qemu's (virtiofsd serves it as
    that user; the system daemon's qemu user here, not 107), its files' modes as the guest sees them."""
    owner = (64055, 64055)
    run_dir = rundir.create(tmp_path / "default_vm")
    (run_dir / "root").mkdir()
    (run_dir / "root" / "disk.qcow2").write_bytes(b"overlay")  # 0644, as qemu-img makes it
    share = run_dir / "virtiofs-shares" / "fs0"
    (share / "sub").mkdir(parents=True)
    (share / "sub" / "greeting").write_bytes(b"hi")
    rundir.open_to_qemu(run_dir, owner)
    for directory in (run_dir, run_dir / "root", run_dir / "virtiofs-shares"):
        st = directory.lstat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, owner[1], 0o710), directory
    for path in (run_dir / "root" / "disk.qcow2", rundir.console_log(run_dir)):
        st = path.lstat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*owner, 0o600), path
    assert rundir.console_log(run_dir).read_bytes() == b""
    st = (run_dir / "console").lstat()  # qemu's own, so that its log daemon can rotate the log in it
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*owner, 0o700)
    assert [(p.lstat().st_uid, p.lstat().st_gid, stat.S_IMODE(p.lstat().st_mode)) for p in (share, share / "sub", share / "sub" / "greeting")] \
        == [(*owner, 0o700), (*owner, 0o755), (*owner, 0o644)]
    with pytest.raises(DiskkitError, match="console: is not root's"):
        rundir.open_to_qemu(run_dir, owner)  # a log directory already given away is never taken over


# ---------------------------------------------------------------- the console log, rotated by qemu's log daemon

@pytest.fixture
def qemus_console_dir() -> Path:
    """A console directory as open_to_qemu leaves it: qemu's, 0700, in a run directory qemu traverses."""
    with qemu_scratch("console-") as root:
        run_dir = rundir.create(root / "default_vm")
        rundir.open_to_qemu(run_dir, (QEMU_UID, QEMU_UID))
        yield run_dir / rundir.CONSOLE_DIR


def test_the_console_is_followed_across_rotations(qemus_console_dir):
    """virtlogd rotates the log as qemu's user: renames console.log to console.log.0 and starts a new one.
    What the old file got before the rename, and the new file from its start, are read in order."""
    log = ConsoleLog(qemus_console_dir / rundir.CONSOLE_LOG)
    got = []
    as_user(QEMU_UID, "sh", "-c", f"printf one >> {log.log}", check=True)
    got.append(log.read())
    as_user(QEMU_UID, "sh", "-c", f"printf two >> {log.log}; mv {log.log} {log.log}.0; printf three > {log.log}", check=True)
    got += [log.read(), log.read(), log.read()]
    as_user(QEMU_UID, "sh", "-c", f"mv {log.log} {log.log}.0; printf four > {log.log}", check=True)
    got += [log.read(), log.read()]
    log.close()
    assert b"".join(got) == b"onetwothreefour", got


def test_files_rotated_away_between_two_reads_are_read_in_order(qemus_console_dir):
    """A chatty guest fills more than one file between two reads: virtlogd shifts console.log.0 to
    .1 and console.log to .0 at each rotation, so the file after the one being read is a backup by
    then. It is read, then the newest: nothing between is skipped (the console of the test below
    lost whole files that way)."""
    log = ConsoleLog(qemus_console_dir / rundir.CONSOLE_LOG)
    got = []
    as_user(QEMU_UID, "sh", "-c", f"printf one > {log.log}", check=True)
    got.append(log.read())

    def rotate(text: str) -> str:
        return f"[ -e {log.log}.0 ] && mv {log.log}.0 {log.log}.1; mv {log.log} {log.log}.0; printf {text} > {log.log}"

    as_user(QEMU_UID, "sh", "-c", f"printf two >> {log.log}; {rotate('three')}; printf four >> {log.log}; {rotate('five')}", check=True)
    got += [log.read() for _ in range(6)]
    log.close()
    assert b"".join(got) == b"onetwothreefourfive", got


def test_a_link_planted_as_a_rotated_backup_is_not_followed(qemus_console_dir, victim):
    """Attack: uid 107 puts a link to a root-only file where the reader looks for the file after its own
    (console.log.0, while its own went to .1). The link is refused in one line; nothing of it is read."""
    log = _planted_after_a_first_read(qemus_console_dir, "mv {log} {log}.1; ln -s {victim} {log}.0; printf later > {log}", victim,
                                      ".0")
    log.close()
    assert victim_state(victim)[3] == VICTIM_TEXT


def _planted_after_a_first_read(console: Path, plant: str, victim, planted_suffix: str) -> ConsoleLog:
    """A reader that has read the guest's first bytes, then uid 107 runs `plant` (with {log} and
    {victim}): its next read is refused in one line naming the link at console.log`planted_suffix`."""
    log = ConsoleLog(console / rundir.CONSOLE_LOG)
    as_user(QEMU_UID, "sh", "-c", f"printf booting > {log.log}", check=True)
    assert log.read() == b"booting"
    as_user(QEMU_UID, "sh", "-c", plant.format(log=log.log, victim=victim), check=True)
    with pytest.raises(DiskkitError) as err:
        log.read()
    assert str(err.value) == f"{log.log}{planted_suffix}: is a symbolic link; root never follows a link in a directory others can write"
    return log


def test_a_link_planted_in_the_console_directory_is_not_followed(qemus_console_dir, victim):
    """Attack: the console directory is qemu's (its log daemon must rotate there), so uid 107 may put a link
    to a root-only file under console.log, or swap one in as a rotation; root following the console
    would read the file to the launcher's stdout. The link is refused in one line; nothing of it is read."""
    console = qemus_console_dir
    log = _planted_after_a_first_read(console, "mv {log} {log}.0; ln -s {victim} {log}", victim, "")
    log.close()
    fresh = ConsoleLog(console / rundir.CONSOLE_LOG)
    with pytest.raises(DiskkitError, match="is a symbolic link"):
        fresh.read()
    assert victim_state(victim)[3] == VICTIM_TEXT


LINES, WIDTH, KEYS = 50, 190, 12  # the guest prints 50 lines of each file of an ISO: ~115 KiB in all
MAX_SIZE = 16384


def test_a_console_past_virtlogds_limit_keeps_being_logged(guest_image, tmp_path):
    """Regression: under a root launcher on 107's session daemon, virtlogd (uid 107) could not rotate
    console.log in root's run directory, so past its max_size the console stopped being logged and
    the launcher never saw the guest finish. virtlogd's max_size is set to 16 KiB here (virtlogd.conf
    under the session daemon's HOME) and the guest prints ~115 KiB: every line arrives, across rotations."""
    with qemu_scratch("rotate-") as root:
        user = QemuUser(root)
        config = user.home / ".config" / "libvirt"
        config.mkdir(parents=True)
        (config / "virtlogd.conf").write_text(f"max_size = {MAX_SIZE}\nmax_backups = 2\n")
        for d in (user.home / ".config", config):
            os.chown(d, QEMU_UID, QEMU_UID)
        user.virsh("list")  # starts the session daemon, whose virtlogd reads that file
        sock = user.home / ".cache" / "libvirt" / "libvirt-sock"
        cache = root / "root-cache"
        cache.mkdir()
        files = {f"key{k:02d}": "".join(f"{k:02d}-{i:02d} {'x' * WIDTH}\n" for i in range(LINES)) for k in range(KEYS)}
        manifests = root / "manifests"
        manifests.mkdir()
        (manifests / "cm.json").write_text(json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                                                       "metadata": {"name": "big", "namespace": "default"}, "data": files}))
        vmi = user.write_vmi("chatty", guest_image, extra=[({"name": "cm", "disk": {"bus": "virtio"}}, {"name": "cm", "configMap": {"name": "big"}})])
        result = run_launcher("run", NOREG, "--console", "--timeout", "600", "--connect", f"qemu+unix:///session?socket={sock}",
                              "--manifests", manifests, vmi, env={"DISKKIT_CACHE": str(cache)}, timeout=700)
        assert result.code == 0, result.err
        console = parse_console(result.out)
        assert console["done"], result.out[-2000:]
        [iso] = console["isos"].values()
        assert iso["files"] == {f"/{k}": v for k, v in files.items()}
        assert len(result.out) > 4 * MAX_SIZE
