"""Root never follows a path it did not make; DataVolume imports are bounded by their claim.

Each test is an attack by another local user (`nobody`) who owns a claim directory (or could plant a
socket directory): links planted under the names the launcher uses, pointing at a root-only 0600 file,
and a claim owner who swaps the importer's work files for links while an import runs. The launcher,
importer and upload server run for real, as root; the victim must come out untouched (content, owner,
mode) and the refusal must be one line naming the file and the rule. The bounded-import tests serve a
hostile HTTP source on loopback: an endless body, a 3000 MiB body for a 64Mi claim, a gzip bomb.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import pwd
import stat
import struct
import subprocess
import sys
import tarfile
import threading
import time
import zlib
from pathlib import Path

import pytest
import requests

from launcher.volumes.files import create_sparse
from tests.conftest import launcher_command, make_qcow2, run_diskkit, run_launcher
from tests.distribution import free_port
from tests.fileserver import FileServer
from tests.test_dv_import import Claims, dv
from tests.vmhost import qemu_scratch

MIB = 1 << 20
SECRET = b"root:only:0600\n"
NOBODY = pwd.getpwnam("nobody")
NOFOLLOW = "is a symbolic link; root never follows a link in a directory others can write"
NOT_REGULAR = "is not a regular file (a FIFO, device, socket or directory); only regular files are used here"


@pytest.fixture(autouse=True)
def _as_root():
    if os.geteuid() != 0:
        pytest.fail("these attacks are on a root launcher: run the suite as root (CI does)")


@pytest.fixture
def area():
    """A world-traversable scratch directory (pytest's are root's only), where `nobody` reaches its claims."""
    with qemu_scratch("hostfs-") as root:
        yield root


class Victim:
    """A root-owned 0600 file and a root-owned 0700 directory the attacker points links at."""

    def __init__(self, root: Path):
        self.dir = root / "rootonly"
        self.dir.mkdir(mode=0o700)
        self.file = self.dir / "secret"
        self.file.write_bytes(SECRET)
        self.file.chmod(0o600)
        self.before = self.state()

    def state(self):
        st, dst = os.lstat(self.file), os.lstat(self.dir)
        return (self.file.read_bytes(), st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode),
                sorted(p.name for p in self.dir.iterdir()), dst.st_uid, stat.S_IMODE(dst.st_mode))

    def assert_untouched(self) -> None:
        assert self.state() == self.before


@pytest.fixture
def victim(area) -> Victim:
    return Victim(area)


def as_nobody(*cmd: str | os.PathLike) -> None:
    proc = subprocess.run(["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups", *map(str, cmd)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def nobodys(path: Path) -> Path:
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    return path


def plant(directory: Path, name: str, target: Path) -> None:
    """The claim's owner, not root, makes the link (as an attacker would)."""
    as_nobody("ln", "-s", target, directory / name)
    assert (directory / name).is_symlink()


def one_line(err: str) -> str:
    """The refusal: the last line of stderr (progress lines may come before it), with no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and "Traceback" not in err, err
    return lines[-1]


@pytest.fixture
def claims(area) -> Claims:
    """DataVolume claims of `nobody` (the manifests stay root's)."""
    root = area / "k8s-root"
    root.mkdir()
    return Claims(root)


def nobody_claim(claims: Claims, *docs: dict) -> None:
    claims.add(*docs)
    for doc in docs:
        if doc["kind"] == "DataVolume":
            nobodys(claims.dirs[doc["metadata"]["name"]])


# ---------------------------------------------------------------- claims of VMs

def test_a_disk_img_link_in_a_claim_is_refused_not_attached(area, victim):
    """Attack: the claim's owner makes disk.img a link to a root-only file; the VM would attach it read-write."""
    claim = area / "claim"
    claim.mkdir()
    nobodys(claim)
    plant(claim, "disk.img", victim.file)
    vmi = area / "vmi.json"
    vmi.write_text(json.dumps({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "linked"},
        "spec": {"domain": {"devices": {"disks": [{"name": "data", "disk": {"bus": "virtio"}}]}, "resources": {"requests": {"memory": "64Mi"}}},
                 "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]}}))
    result = run_launcher("domain", "--pvc", f"data={claim}:40Mi", vmi)
    assert result.code != 0, result.out
    assert one_line(result.err).endswith(f"{claim / 'disk.img'}: {NOFOLLOW}"), result.err
    assert str(victim.file) not in result.out
    victim.assert_untouched()


def test_a_planted_staging_link_is_not_truncated_when_the_claim_image_is_created(area, victim):
    """Attack: `.disk.img.tmp` planted as a link to a root file; creating the claim's sparse image truncated
    and zeroed the target, chowned it to qemu, then attached it. The link is removed, never followed."""
    claim = area / "claim"
    claim.mkdir()
    nobodys(claim)
    plant(claim, ".disk.img.tmp", victim.file)
    create_sparse(claim / "disk.img", 8 * MIB)  # what claims.claim_disk calls for a claim without disk.img
    victim.assert_untouched()
    st = os.lstat(claim / "disk.img")
    assert stat.S_ISREG(st.st_mode) and st.st_size == 8 * MIB and (st.st_uid, st.st_gid) == (107, 107)
    assert sorted(p.name for p in claim.iterdir()) == ["disk.img"]


# ---------------------------------------------------------------- DataVolume state and locks

@pytest.mark.parametrize("name", [".datavolume.lock", ".datavolume.state.lock"])
def test_planted_lock_links_are_refused_not_chowned(claims, victim, name):
    """Attack: a lock file planted as a link to a root file; the importer chowned the target to 107 (qemu)."""
    nobody_claim(claims, dv("blank", {"blank": {}}, "16Mi"))
    plant(claims.dirs["blank"], name, victim.file)
    result = claims.run("import", "blank")
    assert result.code != 0, result.out
    assert one_line(result.err).endswith(f"{claims.dirs['blank'] / name}: {NOFOLLOW}"), result.err
    victim.assert_untouched()
    assert not (claims.dirs["blank"] / "disk.img").exists()


def test_a_state_file_link_is_not_read(claims, victim):
    """Attack: datavolume.json planted as a link to a root-only JSON file; `dv status` printed its message."""
    victim.file.write_text(json.dumps({"phase": "Failed", "message": "root-only-words"}))
    victim.before = victim.state()
    nobody_claim(claims, dv("blank", {"blank": {}}, "16Mi"))
    plant(claims.dirs["blank"], "datavolume.json", victim.file)
    status = claims.run("status", "blank", "--json")
    assert "root-only-words" not in status.out + status.err
    result = claims.run("import", "blank")
    assert result.code == 0, result.err
    victim.assert_untouched()
    assert not (claims.dirs["blank"] / "datavolume.json").is_symlink()  # replaced by a file of ours, not written through


def test_a_clone_from_a_claim_whose_disk_img_is_a_link_is_refused(claims, victim):
    """Attack: the owner of a source claim makes its disk.img a link to a root-only file and clones it into
    a claim of theirs; the importer (root) copied the root file into the new disk.img for their VM to read."""
    nobody_claim(claims, dv("src", {"blank": {}}, "16Mi"), dv("copy", {"pvc": {"name": "src"}}, "16Mi"))
    plant(claims.dirs["src"], "disk.img", victim.file)
    result = claims.run("import", "copy")
    assert result.code != 0, result.out
    assert one_line(result.err).endswith(f"{claims.dirs['src'] / 'disk.img'}: {NOFOLLOW}"), result.err
    assert not (claims.dirs["copy"] / "disk.img").exists()
    victim.assert_untouched()


# ---------------------------------------------------------------- the importer's work files, raced

# Watches until its stdin closes (the import is over; a bound of `seconds` if the test never says so).
ATTACKER = r"""
import os, sys, threading, time
claim, victim_file, victim_dir, seconds, dirs_only = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5] == "dirs"
done, end, over = set(), time.monotonic() + seconds, threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), over.set()), daemon=True).start()
print("watching", flush=True)
while time.monotonic() < end and not over.is_set():
    for name in os.listdir(claim):
        if name.startswith(".diskkit-") and not name.endswith(".moved") and name not in done:
            path = os.path.join(claim, name)
            try:
                is_dir = os.path.isdir(path) and not os.path.islink(path)
                if dirs_only and not is_dir:
                    continue
                os.rename(path, path + ".moved")
                os.symlink(victim_dir if is_dir else victim_file, path)
                done.add(name)
            except OSError:
                pass
    time.sleep(0.005)
print(" ".join(sorted(done)))
"""


def attack(claim: Path, victim: Victim, swap: str) -> subprocess.Popen:
    """The claim's owner, racing the import that follows: returns once it is watching the claim."""
    attacker = subprocess.Popen(["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups",
                                 sys.executable, "-c", ATTACKER, claim, victim.file, victim.dir, "60", swap],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert attacker.stdout.readline() == "watching\n", attacker.stderr.read()
    return attacker


class Trickle(http.server.BaseHTTPRequestHandler):
    """Serves a file a piece at a time: an import that lasts long enough for the claim's owner to act."""

    data = b""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.data)))
        self.end_headers()
        for at in range(0, len(self.data), 256 * 1024):
            self.wfile.write(self.data[at:at + 256 * 1024])
            time.sleep(0.1)


def serve(handler) -> http.server.ThreadingHTTPServer:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def small_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in (("planted-by-root", b"x" * (3 * MIB)),):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("content", ["kubevirt", "archive"])
def test_a_claim_owner_swapping_the_work_files_for_links_redirects_nothing(claims, victim, content):
    """Attack: while an http import runs, the claim's owner renames each `.diskkit-*` work file and
    directory away and puts a link to a root file (or root directory) under its name. qemu-img then read
    the root file as the source, and the importer truncated it to the claim's size, chmodded it 0660,
    chowned it to qemu and renamed the link to disk.img; an archive was unpacked into the root directory.
    (For the archive only directories are swapped: a swapped download fails the old importer before it unpacks.)
    The importer now works as the claim's owner: a link leads it only where the owner could go itself."""
    Trickle.data = small_tar() if content == "archive" else b"\xab" * (4 * MIB)
    httpd = serve(Trickle)
    try:
        source = {"http": {"url": f"http://127.0.0.1:{httpd.server_address[1]}/data"}}
        doc = dv("raced", source, "16Mi")
        doc["spec"]["contentType"] = content
        nobody_claim(claims, doc)
        claim = claims.dirs["raced"]
        attacker = attack(claim, victim, "dirs" if content == "archive" else "all")
        result = claims.run("import", "raced")
        out, err = attacker.communicate(timeout=30)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert attacker.returncode == 0, err
    assert out.strip(), "the attacker never saw a work file: the race was not run"
    victim.assert_untouched()
    # Working as `nobody`, the import either went through (the links came too late, or were swapped
    # for our work directory's fd) or stopped, in one line: at nobody's own permissions, or at the
    # link the owner swapped in for the work directory before the worker opened it.
    if result.code != 0:
        line = one_line(result.err)
        assert ("writing to claim raced failed (Permission denied: " in line
                or ".diskkit-work-" in line and "is a symbolic link; root never follows a link in a directory others can write" in line), line
    elif content == "kubevirt":
        disk = claim / "disk.img"
        assert not disk.is_symlink() and disk.read_bytes()[:4 * MIB] == Trickle.data
        assert disk.stat().st_uid == NOBODY.pw_uid
    else:
        assert (claim / "planted-by-root").read_bytes() == b"x" * (3 * MIB)
    assert not any(p.name.startswith(".diskkit-") and not p.is_symlink() for p in claim.iterdir()), sorted(claim.iterdir())


# ---------------------------------------------------------------- work in a user's claim is done as that user

def qcow2_of(path: Path, data: bytes) -> None:
    raw = path.with_suffix(".tmp")
    raw.write_bytes(data)
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, path], check=True, capture_output=True)
    raw.unlink()


def test_the_worker_as_a_claims_owner_has_that_users_ids_and_nothing_more():
    """launcher.hostfs.asowner: the forked worker has the owner's uid and gid (real, effective, saved), no
    groups, no capability in any set, no_new_privs, and is not dumpable (so the owner cannot ptrace it
    and read the copy of root's memory it was forked with). A worker that dies says so in one line."""
    from diskkit.errors import DiskkitError
    from launcher.hostfs import asowner

    def look(send):
        status = dict(line.rstrip("\n").split(":\t", 1) for line in open("/proc/self/status") if ":\t" in line)
        import ctypes

        dumpable = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
        return {"uids": os.getresuid(), "gids": os.getresgid(), "groups": os.getgroups(), "dumpable": dumpable,
                **{k: status[k] for k in ("CapInh", "CapPrm", "CapEff", "CapAmb", "NoNewPrivs")}}

    seen = asowner.run_as((NOBODY.pw_uid, NOBODY.pw_gid), look)
    assert seen == {"uids": [NOBODY.pw_uid] * 3, "gids": [NOBODY.pw_gid] * 3, "groups": [], "dumpable": 0,
                    "CapInh": "0" * 16, "CapPrm": "0" * 16, "CapEff": "0" * 16, "CapAmb": "0" * 16, "NoNewPrivs": "1"}
    with pytest.raises(DiskkitError, match=f"worker as uid {NOBODY.pw_uid}: ended without an answer \\(exit status 3\\)"):
        asowner.run_as((NOBODY.pw_uid, NOBODY.pw_gid), lambda send: os._exit(3))


@pytest.mark.parametrize("source", ["raw", "qcow2", "archive", "clone"])
def test_an_import_into_a_users_claim_is_done_as_that_user(claims, area, victim, source):
    """Issue 29 item 3: where a claim belongs to a user, the importer works as that user (uid and gid of the
    claim directory, no groups, no capabilities), so nothing in the claim is written with root's rights.
    What it writes is that user's; qemu-img ran as the user on paths by name (a qcow2 is checked and
    converted). Before, disk.img and unpacked files were written by root and given to uid 107."""
    files = area / "www"
    files.mkdir()
    data = b"\xab" * (2 * MIB) + b"\x00" * MIB + b"\xcd" * MIB
    (files / "disk.raw").write_bytes(data)
    qcow2_of(files / "disk.qcow2", data)
    (files / "files.tar").write_bytes(small_tar())
    with FileServer(files) as www:
        docs = {
            "raw": [dv("mine", {"http": {"url": www.url("disk.raw")}}, "16Mi")],
            "qcow2": [dv("mine", {"http": {"url": www.url("disk.qcow2")}}, "16Mi")],
            "archive": [{**dv("mine", {"http": {"url": www.url("files.tar")}}, "16Mi")}],
            "clone": [dv("src", {"http": {"url": www.url("disk.qcow2")}}, "16Mi"), dv("mine", {"pvc": {"name": "src"}}, "16Mi")],
        }[source]
        if source == "archive":
            docs[0]["spec"]["contentType"] = "archive"
        nobody_claim(claims, *docs)
        claim = claims.dirs["mine"]
        # the owner's own link, to a root-only file, under a name the owner may choose: it is never read
        plant(claim, "planted", victim.file)
        if source == "clone":
            assert claims.run("import", "src").code == 0
        result = claims.run("import", "mine")
    assert result.code == 0, result.err
    victim.assert_untouched()
    if source == "archive":
        made = claim / "planted-by-root"
        assert made.read_bytes() == b"x" * (3 * MIB)
    else:
        made = claim / "disk.img"
        assert made.read_bytes()[:len(data)] == data and made.stat().st_size == 16 * MIB
    st = made.stat()
    assert (st.st_uid, st.st_gid) == (NOBODY.pw_uid, NOBODY.pw_gid), (st.st_uid, st.st_gid)
    assert claims.status("mine")["phase"] == "Succeeded"
    assert sorted(p.name for p in claim.iterdir() if p.name.startswith(".diskkit-")) == []


def test_a_registry_import_into_a_users_claim_uses_the_launchers_credentials(claims, area, auth_registry, tmp_path):
    """The worker that runs as the claim's owner cannot read the launcher's (root's) auth file: the
    credentials for the DataVolume's registry are looked up before it starts and handed to it alone."""
    disk = tmp_path / "data.qcow2"
    qcow2_of(disk, b"\xab" * MIB)
    ref = f"{auth_registry.host}/dv/private:v1"
    creds = f"{auth_registry.username}:{auth_registry.password}"
    from tests.conftest import run_diskkit

    assert run_diskkit("build", "--tls-verify=false", "--creds", creds, disk, "-t", ref).code == 0
    auth = area / "root-only-auth.json"
    import base64

    auth.write_text(json.dumps({"auths": {auth_registry.host: {"auth": base64.b64encode(creds.encode()).decode()}}}))
    auth.chmod(0o600)
    nobody_claim(claims, dv("private", {"registry": {"url": f"docker://{ref}"}}, "16Mi"))
    result = claims.run("import", "--tls-verify=false", "--authfile", auth, "private")
    assert result.code == 0, result.err
    image = claims.dirs["private"] / "disk.img"
    st = image.stat()
    assert (st.st_uid, image.read_bytes()[:MIB]) == (NOBODY.pw_uid, b"\xab" * MIB)


def test_an_import_as_the_owner_cannot_write_where_the_owner_cannot(claims, area, victim):
    """The attack the owner is left with: make the importer's own names lead into a root-only directory.
    As the owner, the importer is refused there by the kernel (one line), and nothing of root's changes.
    The work directory is swapped for a link to the root-only directory before the download lands in it."""
    Trickle.data = b"\xab" * (4 * MIB)
    httpd = serve(Trickle)
    try:
        nobody_claim(claims, dv("raced", {"http": {"url": f"http://127.0.0.1:{httpd.server_address[1]}/data"}}, "16Mi"))
        claim = claims.dirs["raced"]
        attacker = attack(claim, victim, "dirs")
        result = claims.run("import", "raced")
        out, err = attacker.communicate(timeout=30)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert attacker.returncode == 0 and out.strip(), err
    assert result.code != 0
    line = one_line(result.err)
    # The swap lands after the importer entered its work directory (the kernel refuses the owner) or
    # before it looked (the link itself is refused): either way one line, and root's files untouched.
    assert (line.startswith(f"launcher: DataVolume default/raced: writing to claim raced failed (Permission denied: {claim}/.diskkit-")
            or (line.startswith(f"launcher: DataVolume default/raced: {claim}/.diskkit-")
                and line.endswith("is a symbolic link; root never follows a link in a directory others can write"))), line
    victim.assert_untouched()
    assert not (claim / "disk.img").exists()


# ---------------------------------------------------------------- the upload server

@contextlib.contextmanager
def upload_server(area: Path, claims: Claims, name: str):
    """`launcher serve --upload-listen` as root; yields the DataVolume's upload URL and its auth header."""
    host = f"127.0.0.1:{free_port()}"
    cache = area / "cache"
    proc = subprocess.Popen(launcher_command("serve", "--no-disks", "--upload-listen", host, "--cache-dir", cache, *claims.args()),
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(300):
            try:
                requests.get(f"http://{host}/", timeout=1)
                break
            except requests.ConnectionError:
                time.sleep(0.1)
        token = run_launcher("dv", "token", name, "--cache-dir", cache).out.strip()
        yield f"http://{host}/diskkit/v1/uploads/default/{name}", {"Authorization": f"Bearer {token}"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_an_upload_part_link_is_refused_not_appended_to(area, claims, victim):
    """Attack: `.diskkit-upload.part` planted as a link to a root file (a crontab, say); the server told the
    client the target's size as its offset, and the next PUT appended the client's bytes to the root file."""
    nobody_claim(claims, dv("up", {"upload": {}}, "16Mi"))
    plant(claims.dirs["up"], ".diskkit-upload.part", victim.file)
    with upload_server(area, claims, "up") as (url, auth):
        status = requests.get(url, headers=auth, timeout=10)
        assert str(len(SECRET)) not in status.text or status.status_code != 200, status.text
        body = b"* * * * * root sh -c 'id > /tmp/pwned'\n"
        start = len(SECRET)
        put = requests.put(url, headers={**auth, "Content-Range": f"bytes {start}-{start + len(body) - 1}/{start + len(body)}"},
                           data=body, timeout=10)
        assert put.status_code >= 400, put.text
        message = put.json()["message"]
        assert "\n" not in message and message.endswith(NOFOLLOW), message
    victim.assert_untouched()


def test_an_upload_into_a_users_claim_is_stored_and_converted_as_that_user(area, claims, victim):
    """Issue 29 item 3, for the upload server: in a user's claim the user opens the part file (the server
    writes through that fd) and a child as the user checks and converts it. The part and disk.img are the
    user's; before, root created both and gave disk.img to uid 107."""
    nobody_claim(claims, dv("up", {"upload": {}}, "16Mi"))
    claim = claims.dirs["up"]
    plant(claim, "planted", victim.file)
    files = area / "files"
    files.mkdir()
    qcow2_of(files / "disk.qcow2", b"\xee" * MIB)
    body = (files / "disk.qcow2").read_bytes()
    with upload_server(area, claims, "up") as (url, auth):
        half = len(body) // 2
        put = requests.put(url, headers={**auth, "Content-Range": f"bytes 0-{half - 1}/{len(body)}"}, data=body[:half], timeout=30)
        assert put.status_code == 200, put.text
        part = os.lstat(claim / ".diskkit-upload.part")
        assert (part.st_uid, part.st_gid) == (NOBODY.pw_uid, NOBODY.pw_gid)
        put = requests.put(url, headers={**auth, "Content-Range": f"bytes {half}-{len(body) - 1}/{len(body)}"}, data=body[half:], timeout=30)
        assert put.status_code == 200, put.text
        import hashlib

        done = requests.post(f"{url}/complete", headers=auth, timeout=60, json={"size": len(body), "sha256": hashlib.sha256(body).hexdigest()})
        assert done.status_code == 200, done.text
        assert done.json()["phase"] == "Succeeded"
    disk = claim / "disk.img"
    st = os.lstat(disk)
    assert (st.st_uid, st.st_gid) == (NOBODY.pw_uid, NOBODY.pw_gid) and stat.S_ISREG(st.st_mode)
    assert disk.read_bytes()[:MIB] == b"\xee" * MIB and st.st_size == 16 * MIB
    assert not any(p.name.startswith(".diskkit-") for p in claim.iterdir())
    victim.assert_untouched()


def test_an_upload_part_fifo_is_refused_not_opened(area, claims):
    """Attack: `.diskkit-upload.part` planted as a FIFO; the server's open for writing blocked for ever,
    holding the DataVolume's work lock (every later request: 503)."""
    nobody_claim(claims, dv("up", {"upload": {}}, "16Mi"))
    as_nobody("mkfifo", claims.dirs["up"] / ".diskkit-upload.part")
    with upload_server(area, claims, "up") as (url, auth):
        body = bytes(4096)
        try:
            put = requests.put(url, headers={**auth, "Content-Range": f"bytes 0-{len(body) - 1}/{len(body)}"}, data=body, timeout=20)
        except requests.exceptions.ReadTimeout:
            pytest.fail("the upload server hung opening the FIFO")
        assert put.status_code >= 400, put.text
        message = put.json()["message"]
        assert "\n" not in message and message.endswith(f".diskkit-upload.part: {NOT_REGULAR}"), message
    assert stat.S_ISFIFO(os.lstat(claims.dirs["up"] / ".diskkit-upload.part").st_mode)


def test_an_upload_larger_than_the_claim_is_refused_before_it_is_stored(area, claims):
    """Attack: an upload client (holding a valid token) offers 3000 MiB for a 16Mi claim; the server wrote
    whatever it was sent into the claim directory. Now the offer is refused by its size, in one line."""
    claims.add(dv("big", {"upload": {}}, "16Mi"))
    with upload_server(area, claims, "big") as (url, auth):
        body = bytes(MIB)
        put = requests.put(url, data=body, timeout=30, headers={**auth, "Content-Range": f"bytes 0-{len(body) - 1}/{3000 * MIB}"})
        assert put.status_code == 413, put.text
        message = put.json()["message"]
        assert "\n" not in message and "more than the claim holds" in message and "A larger PVC is required" in message, message
    assert not (claims.dirs["big"] / ".diskkit-upload.part").exists()


# ---------------------------------------------------------------- launcher serve --socket-dir

@pytest.mark.parametrize("planted", ["link", "other-users-dir", "other-users-parent"])
def test_a_socket_dir_planted_by_another_user_is_refused(area, victim, planted):
    """Attack: another user plants the --socket-dir path as a link to a root directory (the root server
    chmodded its target 0755), or owns the directory or a parent of it (and can swap it for a link under
    the server, which then chowns and chmods its sockets through it)."""
    where = area / "public"
    where.mkdir(mode=0o777)
    where.chmod(0o1777)
    sockets = where / "sockets"
    if planted == "link":
        as_nobody("ln", "-s", victim.dir, sockets)
    elif planted == "other-users-dir":
        as_nobody("mkdir", sockets)
    else:
        as_nobody("mkdir", where / "theirs")
        sockets = where / "theirs" / "sockets"
        sockets.mkdir()  # root's own directory, in a directory of theirs
    cache = area / "cache"
    proc = subprocess.Popen(launcher_command("serve", "--socket-dir", sockets, "--cache-dir", cache, "--exit-when-idle", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, err
    rule = {"link": NOFOLLOW, "other-users-dir": f"belongs to uid {NOBODY.pw_uid}",
            "other-users-parent": f"is inside {where / 'theirs'}, which another user can write (uid {NOBODY.pw_uid}"}[planted]
    assert rule in one_line(err) and f"--socket-dir {sockets}" in err, err
    victim.assert_untouched()
    assert not (victim.dir / "control.sock").exists()


# ---------------------------------------------------------------- root's node cache

@pytest.fixture(scope="module")
def layout():
    """A small image in an OCI layout anyone can read: what root pulls in the attacks below."""
    with qemu_scratch("cache-image-") as root:
        where = root / "layout"
        built = run_diskkit("build", make_qcow2(root / "g.qcow2", size="16M"), "-t", f"oci:{where}:v1")
        assert built.code == 0, built.err
        yield where


CACHE_RULE = "root uses only a cache of root's that no other user can write (use this one as its owner, or give root its own)"


@pytest.mark.parametrize("command", ["pull", "run", "gc"])
@pytest.mark.parametrize("planted", ["their-cache", "open-cache", "link", "their-parent"])
def test_root_uses_no_cache_another_user_could_plant_links_in(area, victim, layout, command, planted):
    """Attack: another user owns the cache root is pointed at (or can write it, or the directory it is in)
    and plants its locks/, chunks/ and tmp/ as links to a root-only directory, or the cache itself as one:
    root made its lock files, chunk index and staging where the links led (issue 38, item 5). Refused
    before anything is made, as the disk server refuses such a cache."""
    public = area / "public"
    public.mkdir()
    public.chmod(0o1777)
    cache = public / "cache"
    if planted == "their-cache":
        as_nobody("mkdir", cache)
    elif planted == "open-cache":
        cache.mkdir()
        cache.chmod(0o777)
    elif planted == "link":
        plant(public, "cache", victim.dir)
    else:
        as_nobody("mkdir", public / "theirs")
        cache = public / "theirs" / "cache"
        cache.mkdir(mode=0o700)  # root's own, in a directory of theirs: swapped for theirs at any time
    if planted in ("their-cache", "open-cache"):
        for name in ("locks", "chunks", "tmp"):
            plant(cache, name, victim.dir)
    before = sorted(p.name for p in cache.iterdir())
    vmi = area / "vmi.json"
    vmi.write_text(json.dumps({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "planted"},
                               "spec": {"domain": {"devices": {}, "resources": {"requests": {"memory": "64Mi"}}}, "volumes": [{"name": "root", "containerDisk": {"image": "127.0.0.1:9/x:v1"}}]}}))
    args = {"pull": ["pull", f"oci:{layout}:v1"], "run": ["run", "--tls-verify=false", "--timeout", "60", vmi], "gc": ["gc"]}[command]
    result = run_launcher(*args, env={"DISKKIT_CACHE": str(cache)}, timeout=120)
    assert result.code == 1, result.err
    rule = {"their-cache": f"{cache}: belongs to uid {NOBODY.pw_uid}; {CACHE_RULE}",
            "open-cache": f"{cache}: can be written by other users (mode 777); {CACHE_RULE}",
            "link": f"{cache}: {NOFOLLOW}",
            "their-parent": f"{cache}: is inside {public / 'theirs'}, which another user can write (uid {NOBODY.pw_uid}, mode 755);"
                            f" it could be swapped for a link"}[planted]
    assert one_line(result.err) == f"launcher: {rule}", result.err
    victim.assert_untouched()
    assert sorted(p.name for p in cache.iterdir()) == before  # nothing made


# ---------------------------------------------------------------- bounded imports

SENT: dict[str, int] = {}
CAP = 1024 * MIB  # what the hostile source gives at most, so the old importer finishes (sparse zeros)


class Hostile(http.server.BaseHTTPRequestHandler):
    """/endless: zeros with no length; /huge: Content-Length 3000 MiB; /bomb.gz: a gzip of 1 GiB of zeros."""

    bomb = b""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        if self.path == "/bomb.gz":
            self.send_header("Content-Length", str(len(self.bomb)))
            self.end_headers()
            self._send(self.bomb)
            return
        if self.path == "/huge":
            self.send_header("Content-Length", str(3000 * MIB))
        self.send_header("Connection", "close")
        self.end_headers()
        zeros = bytes(MIB)
        for _ in range(CAP // MIB):
            if not self._send(zeros):
                return

    def _send(self, data: bytes) -> bool:
        try:
            self.wfile.write(data)
        except OSError:
            return False
        SENT[self.path] = SENT.get(self.path, 0) + len(data)
        return True


@pytest.fixture(scope="module")
def hostile():
    # A full flush resets the compressor, so every further 16 MiB of zeros deflates to the same bytes:
    # compressed twice, repeated, and closed with the trailer (CRC-32 and size) of all of it.
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(16 * MIB)
    first = z.compress(zeros) + z.flush(zlib.Z_FULL_FLUSH)
    block = z.compress(zeros) + z.flush(zlib.Z_FULL_FLUSH)
    last = z.flush()[:-8]
    crc = 0
    for _ in range(CAP // len(zeros)):
        crc = zlib.crc32(zeros, crc)
    Hostile.bomb = first + block * (CAP // len(zeros) - 1) + last + struct.pack("<II", crc, CAP % (1 << 32))
    assert len(Hostile.bomb) < 2 * MIB
    httpd = serve(Hostile)
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("path, what", [
    ("/endless", "sent more than"),
    ("/huge", f"is {3000 * MIB} bytes"),
    ("/bomb.gz", "inflates to more than"),
])
def test_an_import_stops_at_the_claims_size(claims, hostile, path, what):
    """Attack: a source that never ends, one of 3000 MiB for a 64Mi claim, a gzip bomb. The importer wrote
    (or inflated) all of it before the size check; now it stops at the claim's size plus qcow2 overhead,
    in one line, with nothing left in the claim. CDI's importer is bounded the same way, by a scratch
    volume the claim's size (pkg/importer/http-datasource.go Transfer), and refuses with the words of
    pkg/image/qemu.go ErrLargerPVCRequired, "A larger PVC is required"."""
    claims.add(dv("bounded", {"http": {"url": hostile + path}}, "64Mi"))
    SENT.pop(path, None)
    result = claims.run("import", "bounded")
    assert result.code != 0, result.out
    line = one_line(result.err)
    limit = 64 * MIB + 2 * MIB + 4 * MIB
    assert f"the source {what}" in line and f"{limit} bytes)" in line and "A larger PVC is required" in line, line
    # what the source got to send: the limit at most, plus what sockets buffer (never the whole body)
    assert SENT.get(path, 0) <= limit + 32 * MIB, SENT
    claims.assert_untouched("bounded")


# ---------------------------------------------------------------- URL credentials

def test_url_credentials_are_never_printed_or_recorded(claims, area):
    """Attack surface: a DataVolume URL's `user:pass@` (and ?token=) was printed in the progress line."""
    files = area / "www"
    files.mkdir()
    (files / "data.img").write_bytes(b"\xcd" * MIB)
    with FileServer(files, credentials="alice:s3cret-pw") as www:
        url = f"http://alice:s3cret-pw@{www.host}/data.img?token=t0ken-value"
        claims.add(dv("creds", {"http": {"url": url}}, "16Mi"))
        result = claims.run("import", "creds")
        assert result.code == 0, result.err
        missing = dv("gone", {"http": {"url": f"http://alice:s3cret-pw@{www.host}/missing.img?token=t0ken-value"}}, "16Mi")
        claims.add(missing)
        failed = claims.run("import", "gone")
        assert failed.code != 0
    recorded = "".join(p.read_text() for p in claims.root.glob("claim-*/datavolume.json"))
    for text in (result.out, result.err, failed.out, failed.err, recorded):
        assert "s3cret-pw" not in text and "t0ken-value" not in text, text
    assert f"http://{www.host}/data.img" in result.err, result.err
    from launcher.spec.datavolume import shown_url

    assert shown_url(url) == f"http://{www.host}/data.img"
