"""Uploads: `diskkit upload` against the real upload server of `launcher serve`, with a fault-injecting
proxy in front of it to cut the connection half-way; WaitForFirstConsumer, tokens and bad images."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.conftest import launcher_command, run_diskkit, run_launcher
from tests.distribution import free_port
from tests.faultproxy import Fault, FaultProxy
from tests.test_dv_import import Claims, dv
from tests.testguest import ensure_testguest

MIB = 1 << 20
WFFC_CLASS = {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "local-wffc"},
              "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "WaitForFirstConsumer"}


class Serve:
    """`launcher serve --upload-listen` as a process, its stderr collected."""

    def __init__(self, claims: Claims, cache: Path):
        self.cache = cache
        self.host = f"127.0.0.1:{free_port()}"
        self.url = f"http://{self.host}"
        cmd = launcher_command("serve", "--no-disks", "--upload-listen", self.host, "--cache-dir", cache, *claims.args())
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                if "serving uploads on" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        assert ready.wait(30) and self.proc.poll() is None, "\n".join(self.lines)

    def token(self, name: str) -> str:
        result = run_launcher("dv", "token", name, "--cache-dir", self.cache)
        assert result.code == 0, result.err
        return result.out.strip()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def serve(tmp_path):
    started = []

    def start(claims: Claims) -> Serve:
        started.append(Serve(claims, tmp_path / "cache"))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def guest(tmp_path) -> Path:
    path = tmp_path / "guest.qcow2"
    path.write_bytes((ensure_testguest() / "testguest-poweroff.qcow2").read_bytes())
    return path


def upload(name: str, path: Path, url: str, token: str, *extra: str):
    return run_diskkit("upload", name, path, "--url", url, "--token", token, "--json", *extra)


def events(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_an_upload_cut_half_way_resumes_where_it_stopped(tmp_path, serve, guest):
    claims = Claims(tmp_path)
    claims.add(dv("up", {"upload": {}}))
    server = serve(claims)
    assert claims.status("up")["phase"] == "UploadReady"
    cut = 5 * MIB + 123
    with FaultProxy(server.host) as proxy:
        proxy.add(Fault("PUT", "/diskkit/v1/uploads/default/up$", "cut", times=1, arg=cut))
        # and the answer to `complete` is lost after the server did the work
        proxy.add(Fault("POST", "/complete$", "truncate", times=1, arg=0))
        result = upload("up", guest, proxy.url("/"), server.token("up"))
        assert result.code == 0, result.err
        assert [(method, status) for method, _, status in proxy.log] == [
            ("GET", 200), ("PUT", 0), ("GET", 200), ("PUT", 200), ("POST", 200), ("GET", 200)]
    resumed = [e for e in events(result.err) if e["event"] == "resume"]
    assert [e["offset"] for e in resumed] == [cut]  # the second PUT sent only the rest
    digest = hashlib.sha256(guest.read_bytes()).hexdigest()
    answer = json.loads(result.out)
    assert (answer["phase"], answer["sha256"]) == ("Succeeded", digest)
    disk = claims.dirs["up"] / "disk.img"
    assert disk.stat().st_size == 80 * MIB  # grown to the claim
    assert subprocess.run(["qemu-img", "compare", "-q", "-f", "raw", "-F", "qcow2", disk, guest]).returncode == 0
    assert not (claims.dirs["up"] / ".diskkit-upload.part").exists()
    status = claims.status("up")
    assert (status["phase"], status["progress"], status["message"]) == ("Succeeded", "100.0%", "Upload Complete")
    again = upload("up", guest, server.url, server.token("up"))
    assert again.code == 1 and "has already Succeeded" in again.err


def test_wait_for_first_consumer_is_refused_at_once(tmp_path, serve, guest):
    claims = Claims(tmp_path)
    claims.add(WFFC_CLASS, dv("later", {"upload": {}}, storageClassName="local-wffc"))
    server = serve(claims)
    started = time.monotonic()
    result = upload("later", guest, server.url, server.token("later"), "--wait", "600")
    assert time.monotonic() - started < 300  # refused, not waited for (--wait is 600)
    assert result.code == 1
    assert result.err.strip().splitlines()[-1] == "diskkit: DataVolume default/later: cannot upload to DataVolume in state WaitForFirstConsumer"
    assert claims.status("later")["phase"] == "WaitForFirstConsumer"
    assert sorted(p.name for p in claims.dirs["later"].iterdir() if not p.name.startswith(".datavolume")) == []


def test_wrong_tokens_and_bad_images_are_refused(tmp_path, serve, guest):
    claims = Claims(tmp_path)
    claims.add(dv("up", {"upload": {}}), dv("other", {"upload": {}}), dv("small", {"upload": {}}, "32Mi"))
    server = serve(claims)
    refusal = "upload refused: the upload token is missing, invalid, expired or for another DataVolume (HTTP 401)"
    for token in (server.token("other"), server.token("up")[:-2] + "AA", "nonsense"):
        result = upload("up", guest, server.url, token)
        assert result.code == 1 and result.err.strip().splitlines()[-1] == f"diskkit: DataVolume default/up: {refusal}", result.err
    backed = tmp_path / "backed.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(guest), "-F", "qcow2", backed], check=True)
    result = upload("up", backed, server.url, server.token("up"))
    assert result.code == 1 and f"expected no backing file, but found {guest}" in result.err, result.err
    result = upload("small", guest, server.url, server.token("small"))
    assert result.code == 1 and "A larger PVC is required" in result.err, result.err
    for name in ("up", "small"):
        assert sorted(p.name for p in claims.dirs[name].iterdir() if not p.name.startswith(".datavolume")) == ["datavolume.json"]
        assert claims.status(name)["phase"] == "UploadReady"  # a good file may still come
    good = upload("up", guest, server.url, server.token("up"))
    assert good.code == 0, good.err


def test_checksum_mismatch_and_virtctl_one_shot_post(tmp_path, serve, guest):
    claims = Claims(tmp_path)
    claims.add(dv("up", {"upload": {}}), dv("cdi", {"upload": {}}))
    server = serve(claims)
    data = guest.read_bytes()
    base = f"{server.url}/diskkit/v1/uploads/default/up"
    auth = {"Authorization": f"Bearer {server.token('up')}"}
    put = requests.put(base, data=data, headers={**auth, "Content-Range": f"bytes 0-{len(data) - 1}/{len(data)}"})
    assert put.status_code == 200 and put.json() == {"offset": len(data)}
    wrong = requests.post(f"{base}/complete", json={"size": len(data), "sha256": "0" * 64}, headers=auth)
    assert wrong.status_code == 422 and "the upload starts over" in wrong.json()["message"]
    assert requests.get(base, headers=auth).json()["offset"] == 0
    assert not (claims.dirs["up"] / "disk.img").exists()
    # virtctl image-upload: one POST of the whole file to the upload proxy's path
    post = requests.post(f"{server.url}/v1beta1/upload", data=data, headers={"Authorization": f"Bearer {server.token('cdi')}"})
    assert post.status_code == 200 and post.json()["phase"] == "Succeeded", post.text
    assert subprocess.run(["qemu-img", "compare", "-q", "-f", "raw", "-F", "qcow2", claims.dirs["cdi"] / "disk.img", guest]).returncode == 0


def test_an_archive_upload_fills_the_claims_filesystem(tmp_path, serve):
    # CDI allows contentType archive for upload sources: the tar's files land in the claim
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in (("etc/app.conf", b"mode=lazy\n"), ("index.html", b"<p>hi</p>\n")):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    archive = tmp_path / "site.tar"
    archive.write_bytes(buffer.getvalue())
    claims = Claims(tmp_path)
    doc = dv("site", {"upload": {}}, "10Mi")
    doc["spec"]["contentType"] = "archive"
    claims.add(doc)
    server = serve(claims)
    result = upload("site", archive, server.url, server.token("site"))
    assert result.code == 0, result.err
    claim = claims.dirs["site"]
    assert (claim / "etc" / "app.conf").read_bytes() == b"mode=lazy\n" and (claim / "index.html").read_bytes() == b"<p>hi</p>\n"
    assert not (claim / "disk.img").exists() and not (claim / ".diskkit-upload.part").exists()
    assert json.loads(result.out)["phase"] == "Succeeded"
