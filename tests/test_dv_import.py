"""`launcher dv import` against real servers: a Python HTTP(S) server serving real files (basic auth
from a secretRef, CA from a certConfigMap), the distribution registry, and a fault-injecting proxy
for bodies cut short. Every failure leaves the claim as it was: no disk.img, no scratch files."""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import subprocess
from pathlib import Path

import pytest
import yaml

from diskkit.disk import qemuimg
from launcher.datavolumes import dvstate
from launcher.datavolumes.importer import Progress, install
from launcher.hostfs.dirfd import Dir
from launcher.spec.datavolume import parse_data_volume
from launcher.volumes.storage import LocalClaim, Storage
from tests.conftest import make_qcow2, run_diskkit, run_launcher
from tests.distribution import make_tls_files
from tests.faultproxy import Fault, FaultProxy
from tests.fileserver import FileServer
from tests.test_k8s import b64
from tests.testguest import ensure_testguest

MIB = 1 << 20
NOREG = "--tls-verify=false"


def dv(name: str, source: dict, size: str | None = "80Mi", **storage) -> dict:
    target = {"resources": {"requests": {"storage": size}}} if size else {}
    return {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume", "metadata": {"name": name},
            "spec": {"source": source, "storage": {**target, **storage}}}


class Claims:
    """A manifests directory and one claim directory per DataVolume, given to every command."""

    def __init__(self, root: Path):
        self.root = root
        self.manifests = root / "k8s"
        self.manifests.mkdir()
        self.dirs: dict[str, Path] = {}

    def add(self, *docs: dict) -> None:
        for doc in docs:
            name = doc["metadata"]["name"]
            (self.manifests / f"{doc['kind'].lower()}-{name}.yaml").write_text(yaml.safe_dump(doc))
            if doc["kind"] == "DataVolume":
                self.dirs[name] = self.root / f"claim-{name}"
                self.dirs[name].mkdir()

    def args(self) -> list[str]:
        out = ["--manifests", str(self.manifests)]
        for name, path in self.dirs.items():
            out += ["--pvc", f"{name}={path}"]
        return out

    def run(self, *args):
        return run_launcher("dv", *args, *self.args())

    def status(self, name: str) -> dict:
        result = self.run("status", name, "--json")
        assert result.code == 0, result.err
        return json.loads(result.out)

    def assert_untouched(self, name: str) -> None:
        """What a failed import may leave: its state file and locks, nothing else."""
        left = sorted(p.name for p in self.dirs[name].iterdir())
        assert left == [".datavolume.lock", ".datavolume.state.lock", "datavolume.json"], left


@pytest.fixture
def claims(tmp_path) -> Claims:
    return Claims(tmp_path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The test guest as qcow2, the same as raw, and a raw data disk with a pattern and holes."""
    root = tmp_path_factory.mktemp("www")
    guest = root / "guest.qcow2"
    guest.write_bytes((ensure_testguest() / "testguest-poweroff.qcow2").read_bytes())
    subprocess.run(["qemu-img", "convert", "-O", "raw", guest, root / "guest.img"], check=True)
    with open(root / "data.img", "wb") as f:
        f.write(b"\xcd" * MIB)
        f.seek(20 * MIB)
        f.write(b"\xef" * MIB)
        f.truncate(24 * MIB)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", "guest.qcow2", "-F", "qcow2", root / "backed.qcow2"], check=True)
    # compressed as cloud images are published; two gzip members, as pigz and `cat a.gz b.gz` make
    data = (root / "data.img").read_bytes()
    (root / "data.img.gz").write_bytes(gzip.compress(data[: 12 * MIB]) + gzip.compress(data[12 * MIB :]))
    # xz around a qcow2 (decompressed, then converted): the data disk's, as the guest's compressed
    # clusters would keep xz busy for seconds to no purpose
    subprocess.run(["qemu-img", "convert", "-O", "qcow2", root / "data.img", root / "data.qcow2"], check=True)
    (root / "data.qcow2.xz").write_bytes(lzma.compress((root / "data.qcow2").read_bytes()))
    (root / "cut.img.gz").write_bytes((root / "data.img.gz").read_bytes()[:4000])
    return root


@pytest.fixture(scope="module")
def www(files):
    with FileServer(files) as server:
        yield server


def sha(path: Path, length: int | None = None) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(length) if length else f.read()).hexdigest()


def test_http_imports_of_qcow2_and_raw_fill_their_claims(claims, www, files):
    claims.add(dv("guest", {"http": {"url": www.url("guest.qcow2")}}),
               dv("data", {"http": {"url": www.url("data.img")}}, "40Mi"))
    assert [row["phase"] for row in json.loads(claims.run("ls", "--json").out)] == ["Pending", "Pending"]
    for name in ("guest", "data"):
        result = claims.run("import", name)
        assert result.code == 0, result.err
        assert result.out.strip() == str(claims.dirs[name] / "disk.img")
        status = claims.status(name)
        assert (status["phase"], status["progress"], status["message"]) == ("Succeeded", "100.0%", "Import Complete")
    guest, data = claims.dirs["guest"] / "disk.img", claims.dirs["data"] / "disk.img"
    # raw, sized to the claim (CDI grows the image to the PVC), the image's bytes first, sparse
    assert qemuimg.info(guest).format == "raw" and guest.stat().st_size == 80 * MIB
    assert sha(guest, 64 * MIB) == sha(files / "guest.img")
    assert data.stat().st_size == 40 * MIB and sha(data, 24 * MIB) == sha(files / "data.img")
    assert data.stat().st_blocks * 512 <= 3 * MIB  # the 2 MiB written, holes elsewhere
    assert guest.stat().st_blocks * 512 < 30 * MIB
    assert not [p for p in claims.dirs["guest"].iterdir() if p.name.startswith(".diskkit-")]
    again = claims.run("import", "guest")
    assert again.code == 0 and "already Succeeded" in again.err


def test_gzip_and_xz_sources_are_decompressed_on_the_way(claims, www, files):
    claims.add(dv("gz", {"http": {"url": www.url("data.img.gz")}}, "24Mi"),
               dv("xz", {"http": {"url": www.url("data.qcow2.xz")}}),
               dv("cutgz", {"http": {"url": www.url("cut.img.gz")}}, "24Mi"))
    for name in ("gz", "xz"):
        result = claims.run("import", name)
        assert result.code == 0, result.err
    assert sha(claims.dirs["gz"] / "disk.img") == sha(files / "data.img")
    assert sha(claims.dirs["xz"] / "disk.img", 24 * MIB) == sha(files / "data.img")
    cut = claims.run("import", "cutgz")
    assert cut.code == 1 and "the gzip stream ends before its end marker (truncated)" in cut.err, cut.err
    claims.assert_untouched("cutgz")


class Seen:
    """What install reports: each percent, and the importer phases it names."""

    def __init__(self):
        self.percents: list[float] = []
        self.stages: list[str] = []

    def __call__(self, percent: float, force: bool = False) -> None:
        self.percents.append(percent)

    def stage(self, name: str) -> None:
        self.stages.append(name)


def _target(claim: Path):
    return dvstate.resolve(parse_data_volume(dv("guest", {"http": {"url": "http://unused/x"}}), "DataVolume"),
                           Storage({"guest": LocalClaim(claim)}))


def test_conversion_progress_comes_from_qemu_img(tmp_path, files):
    claim = tmp_path / "claim"
    claim.mkdir()
    target = _target(claim)
    seen = Seen()
    with Dir.open(claim) as into, into.mkdir(".diskkit-work-test") as work:
        (work.proc / "download").write_bytes((files / "guest.qcow2").read_bytes())
        install(target, into, work, "download", "guest.qcow2", seen, tolerance=10)
        assert work.names() == []
    assert seen.percents and seen.percents[-1] == 100.0 and seen.percents == sorted(seen.percents), seen.percents
    assert seen.stages == ["Convert"]
    assert (claim / "disk.img").stat().st_size == 80 * MIB


def test_progress_only_grows_across_cdis_phases_and_names_them(claims, www, tmp_path):
    # CDI's importer adds to one progress counter only what exceeds the value so far
    # (pkg/image/qemu.go reportProgress, pkg/util/prometheus/prometheus.go updateProgress), through
    # its processing phases (pkg/importer/data-processor.go: TransferScratch, Convert). It went
    # "ImportInProgress 25% 50% 75% 25% 50% 75% Succeeded": the conversion started again at 0 unnamed.
    claims.add(dv("grows", {"http": {"url": www.url("guest.qcow2")}}))
    result = claims.run("import", "grows")
    assert result.code == 0, result.err
    lines = [line for line in result.err.splitlines() if line.startswith("launcher: DataVolume default/grows: ImportInProgress")]
    assert lines[0] == "launcher: DataVolume default/grows: ImportInProgress, TransferScratch: fetching the source into scratch space in the claim"
    assert "launcher: DataVolume default/grows: ImportInProgress, Convert: qemu-img convert to a raw disk.img" in lines, lines
    said = [int(line.split("ImportInProgress ")[1].split("%")[0]) for line in lines if "%" in line]
    assert said and said == sorted(said) and len(set(said)) == len(said), lines
    assert all(line.endswith(("(TransferScratch)", "(Convert)")) for line in lines if "%" in line), lines
    # The recorded progress too: a second phase starting from 0 never takes it back.
    claim = tmp_path / "claim"
    claim.mkdir()
    target = _target(claim)
    dvstate.record(target, progress="0.00%")
    told: list[str] = []
    progress = Progress(target, told.append)
    progress.stage("TransferScratch")
    for percent in (30.0, 60.0, 80.0, 100.0):
        progress(percent, force=True)
    progress.stage("Convert")
    for percent in (0.0, 10.0, 60.0):
        progress(percent, force=True)
        assert dvstate.read_status(target).progress == "100.00%"
    assert [t.split(": ", 1)[1] for t in told] == ["ImportInProgress, TransferScratch: fetching the source into scratch space in the claim",
                                                   "ImportInProgress 25% (TransferScratch)", "ImportInProgress 50% (TransferScratch)",
                                                   "ImportInProgress 75% (TransferScratch)", "ImportInProgress, Convert: qemu-img convert to a raw disk.img"]


def test_bad_sources_fail_the_datavolume_and_leave_the_claim_alone(claims, www, files):
    proxy = FaultProxy(www.host)
    try:
        proxy.add(Fault("GET", "/guest.qcow2", "truncate", times=100, arg=3 * MIB))
        claims.add(
            dv("missing", {"http": {"url": www.url("nowhere.qcow2")}}),
            dv("cut", {"http": {"url": proxy.url("/guest.qcow2")}}),
            dv("backed", {"http": {"url": www.url("backed.qcow2")}}),
            dv("small", {"http": {"url": www.url("guest.qcow2")}}, "32Mi"),
        )
        expected = {
            "missing": "Unable to connect to http data source: expected status code 200, got 404. Status: 404 File not found",
            "cut": "the connection closed after",
            "backed": "expected no backing file, but found guest.qcow2",
            "small": "virtual image size 67108864 is larger than the reported available storage 33554432. A larger PVC is required",
        }
        for name, message in expected.items():
            result = claims.run("import", name)
            assert result.code == 1, result.err
            lines = result.err.strip().splitlines()
            assert lines[-1].startswith(f"launcher: DataVolume default/{name}: ") and message in lines[-1], result.err
            status = claims.status(name)
            assert status["phase"] == "Failed" and message in status["message"]
            claims.assert_untouched(name)
        assert "(3 attempts)" in claims.status("cut")["message"]
        assert [entry[2] for entry in proxy.log if entry[1] == "/guest.qcow2"] == [200, 200, 200]
    finally:
        proxy.close()


def test_a_body_cut_once_is_fetched_again(claims, www, files):
    with FaultProxy(www.host) as proxy:
        proxy.add(Fault("GET", "/data.img", "truncate", times=1, arg=MIB + 5))
        claims.add(dv("data", {"http": {"url": proxy.url("/data.img")}}, "24Mi"))
        result = claims.run("import", "data")
        assert result.code == 0, result.err
        assert len(proxy.log) == 2  # a server without Range support: the second GET starts over
    assert sha(claims.dirs["data"] / "disk.img") == sha(files / "data.img")


def test_https_with_a_ca_from_a_configmap_and_basic_auth_from_a_secret(claims, files, tmp_path):
    ca, cert, key = make_tls_files(tmp_path / "tls" / "ca")
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "endpoint"},
              "data": {"accessKeyId": b64("importer"), "secretKey": b64("s3cret")}}
    wrong = {**secret, "metadata": {"name": "wrong"}, "data": {"accessKeyId": b64("importer"), "secretKey": b64("nope")}}
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ca"}, "data": {"ca.pem": ca.read_text()}}
    with FileServer(files, credentials="importer:s3cret", tls=(cert, key)) as server:
        url = server.url("guest.qcow2")
        claims.add(secret, wrong, configmap,
                   dv("good", {"http": {"url": url, "secretRef": "endpoint", "certConfigMap": "ca"}}),
                   dv("noca", {"http": {"url": url, "secretRef": "endpoint"}}),
                   dv("badauth", {"http": {"url": url, "secretRef": "wrong", "certConfigMap": "ca"}}))
        good = claims.run("import", "good")
        assert good.code == 0, good.err
        noca = claims.run("import", "noca")
        assert noca.code == 1 and "TLS verification failed" in noca.err and "certConfigMap" in noca.err, noca.err
        badauth = claims.run("import", "badauth")
        assert badauth.code == 1 and "got 401" in badauth.err, badauth.err
    assert sha(claims.dirs["good"] / "disk.img", 64 * MIB) == sha(files / "guest.img")
    claims.assert_untouched("noca")
    claims.assert_untouched("badauth")


def test_registry_imports_plain_and_with_credentials_from_a_secret(claims, registry, auth_registry, tmp_path):
    disk = make_qcow2(tmp_path / "data.qcow2", "48M", pattern=0xAB)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "pull"},
              "stringData": {"accessKeyId": auth_registry.username, "secretKey": auth_registry.password}}
    refs = {}
    for name, reg, extra in (("plain", registry, []), ("private", auth_registry, ["--creds", f"{auth_registry.username}:{auth_registry.password}"])):
        refs[name] = f"{reg.host}/dv/data:v1"
        built = run_diskkit("build", NOREG, *extra, disk, "-t", refs[name])
        assert built.code == 0, built.err
    claims.add(secret,
               dv("plain", {"registry": {"url": f"docker://{refs['plain']}"}}, "56Mi"),
               dv("private", {"registry": {"url": f"docker://{refs['private']}", "secretRef": "pull"}}, "56Mi"),
               dv("denied", {"registry": {"url": f"docker://{refs['private']}"}}, "56Mi"))
    for name in ("plain", "private"):
        result = claims.run("import", NOREG, name)
        assert result.code == 0, result.err
        image = claims.dirs[name] / "disk.img"
        assert image.stat().st_size == 56 * MIB
        assert subprocess.run(["qemu-img", "compare", "-q", "-f", "raw", "-F", "qcow2", image, disk]).returncode == 0
        with open(image, "rb") as f:
            assert f.read(MIB) == b"\xab" * MIB
    denied = claims.run("import", NOREG, "denied")
    assert denied.code == 6 and "DataVolume default/denied" in denied.err, denied.err
    claims.assert_untouched("denied")


def test_blank_and_clone(claims, www):
    claims.add(dv("golden", {"http": {"url": www.url("data.img")}}, "24Mi"),
               dv("scratch", {"blank": {}}, "16Mi"),
               dv("copy", {"pvc": {"name": "golden"}}, "32Mi"))
    early = claims.run("import", "copy")
    assert early.code == 1 and "source claim default/golden holds no disk.img yet" in early.err, early.err
    for name in ("golden", "scratch", "copy"):
        result = claims.run("import", name)
        assert result.code == 0, result.err
    blank = claims.dirs["scratch"] / "disk.img"
    assert blank.stat().st_size == 16 * MIB and blank.stat().st_blocks == 0
    copy = claims.dirs["copy"] / "disk.img"
    assert copy.stat().st_size == 32 * MIB and sha(copy, 24 * MIB) == sha(claims.dirs["golden"] / "disk.img")
    assert claims.status("copy")["message"] == "Clone Complete"


def test_a_claim_waiting_for_its_first_consumer_is_not_imported(claims, www):
    sc = {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "local-wffc"},
          "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "WaitForFirstConsumer"}
    claims.add(sc, dv("later", {"http": {"url": www.url("guest.qcow2")}}, storageClassName="local-wffc"))
    assert claims.status("later")["phase"] == "WaitForFirstConsumer"
    result = claims.run("import", "later")
    assert result.code == 1, result.err
    assert "in state WaitForFirstConsumer: storage class local-wffc binds claim later when a VM using it starts" in result.err
    assert not (claims.dirs["later"] / "disk.img").exists()


def test_registry_over_tls_with_a_ca_from_a_configmap(claims, tls_registry, tmp_path):
    disk = make_qcow2(tmp_path / "data.qcow2", "16M", pattern=0x5A)
    ref = f"{tls_registry.host}/dv/tls:v1"
    built = run_diskkit("build", "--cert-dir", tls_registry.ca_dir, disk, "-t", ref)
    assert built.code == 0, built.err
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "registry-ca"},
                 "data": {"ca.crt": (tls_registry.ca_dir / "ca.crt").read_text()}}
    claims.add(configmap,
               dv("trusted", {"registry": {"url": f"docker://{ref}", "certConfigMap": "registry-ca"}}, "16Mi"),
               dv("untrusted", {"registry": {"url": f"docker://{ref}"}}, "16Mi"))
    trusted = claims.run("import", "trusted")
    assert trusted.code == 0, trusted.err
    with open(claims.dirs["trusted"] / "disk.img", "rb") as f:
        assert f.read(MIB) == b"\x5a" * MIB
    untrusted = claims.run("import", "untrusted")
    assert untrusted.code == 1 and "DataVolume default/untrusted" in untrusted.err, untrusted.err
    claims.assert_untouched("untrusted")


def _tar(path: Path, entries: list[tuple[str, bytes | None, str]], compress: bool = False) -> Path:
    """entries: (name, data for a file or None for a directory, kind: file|dir|symlink|hardlink|fifo)."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data, kind in entries:
            info = tarfile.TarInfo(name)
            info.mode = 0o6755 if kind == "file" else 0o755  # setuid bits must not survive
            if kind == "file":
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE}[kind]
            if kind in ("symlink", "hardlink"):
                info.linkname = "/etc/passwd"
            tar.addfile(info)
    path.write_bytes(gzip.compress(buffer.getvalue()) if compress else buffer.getvalue())
    return path


def test_archive_content_fills_the_claims_filesystem(claims, files):
    # CDI contentType: archive: the tar's files land in the claim (a virtiofs share's source), no disk.img
    _tar(files / "share.tar.gz", [("./", None, "dir"), ("./app", None, "dir"), ("./app/config.txt", b"answer=42\n", "file"),
                                  ("readme", b"hello\n", "file")], compress=True)
    with FileServer(files) as server:
        claims.add(dv("share", {"http": {"url": server.url("share.tar.gz")}}, "10Mi", accessModes=["ReadWriteMany"]) |
                   {"spec": {"contentType": "archive", "source": {"http": {"url": server.url("share.tar.gz")}},
                             "storage": {"resources": {"requests": {"storage": "10Mi"}}}}})
        result = claims.run("import", "share")
    assert result.code == 0, result.err
    claim = claims.dirs["share"]
    assert result.out.strip() == str(claim)
    assert (claim / "app" / "config.txt").read_bytes() == b"answer=42\n" and (claim / "readme").read_bytes() == b"hello\n"
    assert (claim / "readme").stat().st_mode & 0o7777 == 0o755  # no setuid from the archive
    assert not (claim / "disk.img").exists()
    status = claims.status("share")
    assert status["phase"] == "Succeeded" and status["disk"] is None
    assert not [p for p in claim.iterdir() if p.name.startswith(".diskkit-")]


@pytest.mark.parametrize("entries,member,rule", [
    ([("../escape", b"x", "file")], "../escape", "its name leaves the claim"),
    ([("/abs", b"x", "file")], "/abs", "its name leaves the claim"),
    ([("ok", b"x", "file"), ("link", None, "symlink")], "link", "links are not unpacked"),
    ([("hard", None, "hardlink")], "hard", "links are not unpacked"),
    ([("pipe", None, "fifo")], "pipe", "only regular files and directories are unpacked"),
    (None, None, "cannot process a non tar file as an archive"),
])
def test_bad_archives_fail_and_leave_the_claim_alone(claims, files, tmp_path, entries, member, rule):
    name = f"bad-{abs(hash(rule)) % 10000}.tar"
    if entries is None:
        (files / name).write_bytes(b"\x00" * 4096 + b"not a tar")
    else:
        _tar(files / name, entries)
    with FileServer(files) as server:
        doc = dv("arch", {"http": {"url": server.url(name)}}, "10Mi")
        doc["spec"]["contentType"] = "archive"
        claims.add(doc)
        result = claims.run("import", "arch")
    assert result.code != 0
    line = result.err.strip().splitlines()[-1]
    assert rule in line and (member is None or f"{member}: " in line), line
    claims.assert_untouched("arch")
