"""Build from upstream (issue 32 item 2): `diskkit build URL` and `-` read the disk once as it
arrives (hashed, decompressed, unwrapped into one temporary file), resume a dropped connection with
Range and If-Range, and check `--checksum` / `--checksum-file` (GNU and BSD formats, as
kubevirt/containerdisks pkg/hashsum/hashsum.go reads them) before anything is pushed.

The upstream is a real HTTP server on loopback (tests/upstream.py), the destination the real
registry; dropped connections and corrupt bytes come from the fault proxy in front of the upstream.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
import requests

from diskkit.errors import DiskkitError
from diskkit.source import checksum
from tests.conftest import make_qcow2, run
from tests.faultproxy import Fault, FaultProxy
from tests.upstream import Upstream

FAST = ["--tls-verify=false", "--retry-delay", "0.05"]


def _sha(path, algorithm="sha256") -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _xz(path):
    assert shutil.which("xz"), "xz is needed by this test"
    run("xz", "-k", "-0", "-T1", path)
    return path.with_name(path.name + ".xz")


@pytest.fixture
def site(tmp_path):
    """A directory served as an upstream: guest.qcow2 (the disk) and guest.qcow2.xz."""
    root = tmp_path / "site"
    root.mkdir()
    disk = make_qcow2(root / "guest.qcow2", size="32M", pattern=0x3C)
    _xz(disk)
    with Upstream(root) as upstream:
        yield upstream, disk


@pytest.fixture(scope="module")
def random_disk(tmp_path_factory):
    """4 MiB of random data in a 16 MiB disk, and its xz (seconds of xz's time: made once for the module)."""
    disk = tmp_path_factory.mktemp("random") / "guest.img"
    with open(disk, "wb") as f:
        f.write(os.urandom(4 << 20))
        f.truncate(16 << 20)
    return disk, _xz(disk)


@pytest.fixture
def big_site(tmp_path, random_disk):
    """An upstream whose xz file is 4 MiB of random data (xz cannot shrink it): a drop mid-way is mid-file.
    The files are the test's own copies: a test may replace them."""
    root = tmp_path / "site"
    root.mkdir()
    disk = root / "guest.img"
    with open(random_disk[0], "rb") as src, open(disk, "wb") as f:
        f.write(src.read(4 << 20))
        f.truncate(16 << 20)
    shutil.copyfile(random_disk[1], root / "guest.img.xz")
    with Upstream(root) as upstream:
        yield upstream, disk


@pytest.fixture
def tmpdir_env(tmp_path):
    """TMPDIR of its own, to see that nothing of a download is left behind."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    return scratch, {"TMPDIR": str(scratch), "XDG_CACHE_HOME": str(tmp_path / "cache")}


def _repo(registry) -> str:
    return f"{registry.host}/url-{uuid.uuid4().hex[:8]}"


def _disk_in(tmp_path, layout_dir):
    """The /disk file of an OCI layout, unpacked by umoci (another client)."""
    bundle = tmp_path / f"bundle-{uuid.uuid4().hex[:6]}"
    run("umoci", "unpack", "--image", f"{layout_dir}:v1", bundle)
    files = list((bundle / "rootfs" / "disk").iterdir())
    assert len(files) == 1
    return files[0]


def _tags(registry, ref: str) -> list[str]:
    repo = ref.split("/", 1)[1].rsplit(":", 1)[0]
    answer = requests.get(registry.url(f"/v2/{repo}/tags/list"), timeout=30)
    return answer.json().get("tags") or [] if answer.status_code == 200 else []


@pytest.mark.parametrize("style", ["gnu", "gnu-binary", "bsd", "sha512"])
def test_build_from_url_with_checksum_file(diskkit, registry, site, tmp_path, tmpdir_env, style):
    upstream, disk = site
    packed = disk.with_name("guest.qcow2.xz")
    line = {
        "gnu": f"{_sha(packed)}  guest.qcow2.xz\n",
        "gnu-binary": f"{_sha(packed)} *guest.qcow2.xz\n",
        "bsd": f"# guest.qcow2.xz: {packed.stat().st_size} bytes\nSHA256 (guest.qcow2.xz) = {_sha(packed)}\n",
        "sha512": f"{_sha(packed, 'sha512')}  ./guest.qcow2.xz\n",
    }[style]
    (disk.parent / "CHECKSUM").write_text(f"{'0' * 64}  guest.qcow2\n{line}")  # another file's entry first
    ref = f"{_repo(registry)}:v1"
    layout = tmp_path / "layout"
    scratch, env = tmpdir_env
    result = diskkit("build", upstream.url("guest.qcow2.xz"), "--checksum-file", upstream.url("CHECKSUM"), "-t", ref, "-t", f"oci:{layout}:v1",
                     "--json", *FAST, env=env)
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert out["disk"]["path"] == "/disk/guest.qcow2"
    assert out["disk"]["format"] == "qcow2"
    assert "verified over" in result.err
    assert _sha(_disk_in(tmp_path, layout)) == _sha(disk)  # the registry's bytes (the layout is copied from it)
    assert [name for name, _, _ in upstream.requests].count("guest.qcow2.xz") == 1  # read once
    assert list(scratch.iterdir()) == []


def test_dropped_connection_resumes_with_range(diskkit, registry, big_site, tmp_path, tmpdir_env):
    # The connection closes after the first MiB of the body (Content-Length says more).
    upstream, disk = big_site
    packed = disk.with_name("guest.img.xz")
    proxy = FaultProxy(upstream.host)
    try:
        proxy.add(Fault("GET", r"/guest\.img\.xz$", "truncate", arg=1 << 20))
        url = f"http://{proxy.host}/guest.img.xz"
        layout = tmp_path / "layout"
        scratch, env = tmpdir_env
        result = diskkit("build", url, "--checksum", f"sha256:{_sha(packed)}", "-t", f"{_repo(registry)}:v1", "-t", f"oci:{layout}:v1",
                         "--json", *FAST, env=env)
    finally:
        proxy.close()
    assert result.code == 0, result.err
    gets = [(rng, cond) for name, rng, cond in upstream.requests if name == "guest.img.xz"]
    assert len(gets) == 2, gets
    assert gets[0] == (None, None)
    rng, cond = gets[1]
    assert rng == f"bytes={1 << 20}-"  # from where the first answer stopped, not from 0
    assert cond and cond.startswith('"')  # pinned to the first answer's ETag
    assert upstream.sent == 2 * packed.stat().st_size - (1 << 20)  # the upstream sent it whole, then all but the first MiB
    assert "resuming from there" in result.err
    assert _sha(_disk_in(tmp_path, layout)) == _sha(disk)
    assert list(scratch.iterdir()) == []


def test_reset_connection_is_survived(diskkit, big_site, tmp_path):
    # A reset (RST) may also take bytes the client had not read yet: it resumes from what it got.
    upstream, disk = big_site
    proxy = FaultProxy(upstream.host)
    try:
        proxy.add(Fault("GET", r"/guest\.img\.xz$", "drop", arg=2 << 20))
        layout = tmp_path / "layout"
        result = diskkit("build", f"http://{proxy.host}/guest.img.xz", "-t", f"oci:{layout}:v1", *FAST)
    finally:
        proxy.close()
    assert result.code == 0, result.err
    assert len([name for name, _, _ in upstream.requests if name == "guest.img.xz"]) == 2
    assert _sha(_disk_in(tmp_path, layout)) == _sha(disk)


def test_file_changed_between_attempts_is_read_again(diskkit, registry, big_site, tmp_path, tmpdir_env):
    upstream, disk = big_site
    packed = disk.with_name("guest.img.xz")
    newer = tmp_path / "newer.img"
    with open(newer, "wb") as f:
        f.write(os.urandom(3 << 20))
        f.truncate(8 << 20)
    newer_xz = _xz(newer)

    def replace_upstream():  # the mirror published a new image while the first download was cut
        shutil.copyfile(newer_xz, packed)

    upstream.before["guest.img.xz"] = replace_upstream
    proxy = FaultProxy(upstream.host)
    try:
        proxy.add(Fault("GET", r"/guest\.img\.xz$", "truncate", arg=1 << 20))
        layout = tmp_path / "layout"
        scratch, env = tmpdir_env
        result = diskkit("build", f"http://{proxy.host}/guest.img.xz", "-t", f"oci:{layout}:v1", "--json", *FAST, env=env)
    finally:
        proxy.close()
    assert result.code == 0, result.err
    gets = [(rng, cond) for name, rng, cond in upstream.requests if name == "guest.img.xz"]
    assert [rng is None for rng, _ in gets] == [True, False, True], gets  # cut; If-Range refused (whole new file); read from 0
    assert "changed on the server" in result.err
    assert _sha(_disk_in(tmp_path, layout)) == _sha(newer)  # the new file alone, never two spliced
    assert list(scratch.iterdir()) == []


def test_corrupt_download_is_refused_before_any_push(diskkit, registry, site, tmpdir_env):
    # One flipped bit in the disk's data: a valid qcow2 still, that only the checksum can tell.
    upstream, disk = site
    proxy = FaultProxy(upstream.host)
    try:
        proxy.add(Fault("GET", r"/guest\.qcow2$", "flip", arg=disk.stat().st_size - 4096))
        url = f"http://{proxy.host}/guest.qcow2"
        ref = f"{_repo(registry)}:v1"
        scratch, env = tmpdir_env
        good = _sha(disk)
        result = diskkit("build", url, "--checksum", f"sha256:{good}", "-t", ref, *FAST, env=env)
    finally:
        proxy.close()
    assert result.code == 1
    errors = [line for line in result.err.splitlines() if line.startswith("diskkit:")]
    assert len(errors) == 1, result.err
    assert errors[0].startswith(f"diskkit: {url}: Digest did not match, expected sha256:{good}, got sha256:")
    assert errors[0].count("sha256:") == 2 and f"got sha256:{good}" not in errors[0]
    assert _tags(registry, ref) == []
    assert list(scratch.iterdir()) == []


def test_checksum_mismatch_names_url_and_both_digests(diskkit, registry, site, tmpdir_env):
    upstream, disk = site
    packed = disk.with_name("guest.qcow2.xz")
    wrong = "ab" * 32
    ref = f"{_repo(registry)}:v1"
    scratch, env = tmpdir_env
    result = diskkit("build", upstream.url("guest.qcow2.xz"), "--checksum", f"sha256:{wrong}", "-t", ref, *FAST, env=env)
    assert result.code == 1
    assert result.err.strip().splitlines()[-1] == (
        f"diskkit: {upstream.url('guest.qcow2.xz')}: Digest did not match, expected sha256:{wrong}, got sha256:{_sha(packed)} "
        "(--checksum); nothing was built"
    )
    assert _tags(registry, ref) == []
    assert list(scratch.iterdir()) == []


def test_missing_checksum_entry_fails_before_the_download(diskkit, site, tmp_path):
    upstream, disk = site
    (disk.parent / "SHA256SUMS").write_text(f"{'1' * 64}  other.qcow2.xz\n")
    result = diskkit("build", upstream.url("guest.qcow2.xz"), "--checksum-file", upstream.url("SHA256SUMS"), "-t", f"oci:{tmp_path / 'l'}:v1")
    assert result.code == 1
    assert f"--checksum-file {upstream.url('SHA256SUMS')}: has no sha256 or sha512 entry for guest.qcow2.xz" in result.err
    assert "guest.qcow2.xz" not in [name for name, _, _ in upstream.requests]


def test_pipe_with_checksum(registry, site, tmp_path, tmpdir_env):
    _, disk = site
    packed = disk.with_name("guest.qcow2.xz")
    ref = f"{_repo(registry)}:v1"
    layout = tmp_path / "layout"
    _, env = tmpdir_env
    with open(packed, "rb") as stdin:
        proc = subprocess.run([sys.executable, "-m", "diskkit", "build", "-", "--checksum", f"sha256:{_sha(packed)}", "-t", ref,
                               "-t", f"oci:{layout}:v1", "--json", *FAST], stdin=stdin, capture_output=True, text=True,
                              env={**os.environ, "CI": "true", **env})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["disk"]["path"] == "/disk/disk.qcow2"  # a pipe has no name: the format's
    assert _sha(_disk_in(tmp_path, layout)) == _sha(disk)


def test_pipe_of_a_tar_gz(tmp_path):
    disk = make_qcow2(tmp_path / "inner.qcow2", size="16M", pattern=0x11)
    archive = tmp_path / "disk.tar.gz"
    run("tar", "-czf", archive, "-C", tmp_path, "inner.qcow2")
    layout = tmp_path / "layout"
    with open(archive, "rb") as stdin:
        proc = subprocess.run([sys.executable, "-m", "diskkit", "build", "-", "-t", f"oci:{layout}:v1", "--json"], stdin=stdin,
                              capture_output=True, text=True, env={**os.environ, "CI": "true"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["disk"]["path"] == "/disk/inner.qcow2"
    assert _sha(_disk_in(tmp_path, layout)) == _sha(disk)


def test_missing_url_is_named_whole(diskkit, site, tmp_path):
    upstream, _ = site
    url = upstream.url("nothing.qcow2.xz")
    result = diskkit("build", url, "-t", f"oci:{tmp_path / 'l'}:v1")
    assert result.code == 1
    assert result.err.strip() == f"diskkit: {url}: expected status code 200, got 404 (Not Found)"


def test_convert_from_url(diskkit, site, tmp_path):
    upstream, disk = site
    out = tmp_path / "out.raw"
    result = diskkit("convert", "-O", "raw", upstream.url("guest.qcow2.xz"), out, "--checksum", f"sha256:{_sha(disk.with_name('guest.qcow2.xz'))}")
    assert result.code == 0, result.err
    raw = tmp_path / "expected.raw"
    run("qemu-img", "convert", "-O", "raw", disk, raw)
    assert _sha(out) == _sha(raw)
    piped = tmp_path / "piped.raw"
    with open(disk.with_name("guest.qcow2.xz"), "rb") as stdin:
        proc = subprocess.run([sys.executable, "-m", "diskkit", "convert", "-O", "raw", "-", piped], stdin=stdin, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert _sha(piped) == _sha(raw)


# The checksum files' formats, as upstreams write them (pure).

FEDORA = """-----BEGIN PGP SIGNED MESSAGE-----
Hash: SHA256

# Fedora-Cloud-Base-40.x86_64.qcow2: 397475840 bytes
SHA256 (Fedora-Cloud-Base-40.x86_64.qcow2) = ac58f3c35b73272d5986fa6d3bc44fd246b45df4c334e99a07b3bbd00684adee
SHA256 (Fedora-Cloud-Base-40.x86_64.raw.xz) = 1b2be1b82f4a9ab0b3b5b3c6a8c1f6e1e0a6b4d4c3e2f1a0b9c8d7e6f5a4b3c2
-----BEGIN PGP SIGNATURE-----
iQIzBAEBCAAdFiEE
-----END PGP SIGNATURE-----
"""


def test_checksum_file_formats():
    assert [str(e) for e in checksum.lookup(FEDORA, "Fedora-Cloud-Base-40.x86_64.qcow2", "f")] == [
        "sha256:ac58f3c35b73272d5986fa6d3bc44fd246b45df4c334e99a07b3bbd00684adee"]
    ubuntu = f"{'a' * 64} *noble-server-cloudimg-amd64.img\n{'b' * 64} *noble-server-cloudimg-arm64.img\n"
    assert [str(e) for e in checksum.lookup(ubuntu, "noble-server-cloudimg-arm64.img", "u")] == [f"sha256:{'b' * 64}"]
    debian = f"{'c' * 128}  debian-12-generic-amd64.qcow2\n"
    assert [str(e) for e in checksum.lookup(debian, "debian-12-generic-amd64.qcow2", "d")] == [f"sha512:{'c' * 128}"]
    with pytest.raises(DiskkitError, match="no sha256 or sha512 entry for x.qcow2 .2 entries"):
        checksum.lookup(ubuntu, "x.qcow2", "u")
    with pytest.raises(DiskkitError, match="twice with different sha256 digests"):
        checksum.lookup(f"{'a' * 64}  x.img\n{'b' * 64}  x.img\n", "x.img", "x")


def test_checksum_values():
    assert str(checksum.parse_value("SHA256:" + "A" * 64)) == "sha256:" + "a" * 64
    for bad in ("md5:" + "a" * 32, "sha256:" + "a" * 63, "a" * 64, "sha512:" + "g" * 128):
        with pytest.raises(DiskkitError):
            checksum.parse_value(bad)


def test_refusal_of_the_downloaded_disk_names_the_url(diskkit, site, tmp_path):
    # What qemu-img finds wrong is said of the URL, not of the temporary file the disk was written to.
    upstream, disk = site
    run("qemu-img", "create", "-q", "-f", "qcow2", "-b", disk, "-F", "qcow2", disk.with_name("child.qcow2"))
    url = upstream.url("child.qcow2")
    result = diskkit("build", url, "-t", f"oci:{tmp_path / 'l'}:v1")
    assert result.code == 1
    line = result.err.strip().splitlines()[-1]
    assert line.startswith(f"diskkit: {url}: ") and "backing file" in line, line
    assert "diskkit-build-" not in result.err


def test_server_errors_are_retried_then_given_up(diskkit, site, tmp_path):
    upstream, _ = site
    proxy = FaultProxy(upstream.host)
    try:
        proxy.add(Fault("GET", r"/guest\.qcow2$", "status", arg=503, times=2))
        url = f"http://{proxy.host}/guest.qcow2"
        ok = diskkit("build", url, "-t", f"oci:{tmp_path / 'a'}:v1", "--retry-delay", "0.05")
        assert ok.code == 0, ok.err
        assert [name for name, _, _ in upstream.requests] == ["guest.qcow2"]  # the proxy answered the two 503s
        proxy.add(Fault("GET", r"/guest\.qcow2$", "status", arg=503, times=3))
        failed = diskkit("build", url, "-t", f"oci:{tmp_path / 'b'}:v1", "--retry-delay", "0.05", "--retry-times", "2")
    finally:
        proxy.close()
    assert failed.code == 1
    assert failed.err.strip() == f"diskkit: {url}: HTTP 503 Service Unavailable (3 attempts)"


def test_platforms_from_urls_each_checked_by_name(diskkit, site, tmp_path):
    upstream, disk = site
    arm = make_qcow2(disk.with_name("arm.qcow2"), size="16M", pattern=0x77)
    (disk.parent / "SHA256SUMS").write_text(f"{_sha(disk)}  guest.qcow2\n{_sha(arm)}  arm.qcow2\n")
    result = diskkit("build", "--platform", f"linux/amd64={upstream.url('guest.qcow2')}", "--platform", f"linux/arm64={upstream.url('arm.qcow2')}",
                     "--checksum-file", disk.parent / "SHA256SUMS", "-t", f"oci:{tmp_path / 'l'}:v1", "--json")
    assert result.code == 0, result.err
    assert [m["disk"]["path"] for m in json.loads(result.out)["manifests"]] == ["/disk/guest.qcow2", "/disk/arm.qcow2"]
    assert result.err.count("verified over") == 2
    both = diskkit("build", "--platform", f"linux/amd64={upstream.url('guest.qcow2')}", "--platform", f"linux/arm64={upstream.url('arm.qcow2')}",
                   "--checksum", f"sha256:{_sha(disk)}", "-t", f"oci:{tmp_path / 'm'}:v1")
    assert both.code == 1 and "--checksum: names one input's digest; with several platforms give --checksum-file" in both.err


def test_local_file_checksum_and_pipe_without_a_name(diskkit, site, tmp_path):
    _, disk = site
    bad = diskkit("build", disk, "--checksum", f"sha512:{'0' * 128}", "-t", f"oci:{tmp_path / 'l'}:v1")
    assert bad.code == 1
    assert bad.err.strip() == f"diskkit: {disk}: Digest did not match, expected sha512:{'0' * 128}, got sha512:{_sha(disk, 'sha512')} (--checksum); nothing was built"
    good = diskkit("build", disk, "--checksum", f"sha512:{_sha(disk, 'sha512')}", "-t", f"oci:{tmp_path / 'l'}:v1")
    assert good.code == 0, good.err
    sums = tmp_path / "SUMS"
    sums.write_text(f"{_sha(disk)}  guest.qcow2\n")
    with open(disk, "rb") as stdin:
        proc = subprocess.run([sys.executable, "-m", "diskkit", "build", "-", "--checksum-file", sums, "-t", f"oci:{tmp_path / 'p'}:v1"],
                              stdin=stdin, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"diskkit: --checksum-file {sums}: stdin has no file name to look up; give --checksum sha256:HEX"


@pytest.mark.parametrize("kind", ["xz", "gzip", "zstd", "bzip2"])
def test_every_compression_unwraps_from_a_stream(tmp_path, kind):
    from diskkit.disk import payload

    disk = make_qcow2(tmp_path / "d.qcow2", size="8M", pattern=0x42)
    tool = {"xz": ["xz", "-k"], "gzip": ["gzip", "-k"], "zstd": ["zstd", "-q", "-k"], "bzip2": ["bzip2", "-k"]}[kind]
    suffix = {"xz": ".xz", "gzip": ".gz", "zstd": ".zst", "bzip2": ".bz2"}[kind]
    assert shutil.which(tool[0]), f"{tool[0]} is needed by this test"
    run(*tool, disk)
    with open(f"{disk}{suffix}", "rb", buffering=0) as stream:
        out = payload.unwrap_stream(stream, f"d.qcow2{suffix}", "stream", tmp_path / "out")
    assert (out.name, out.layers) == ("d.qcow2", (kind,))
    assert _sha(out.path) == _sha(disk)


def test_one_temporary_copy_however_deep_the_wrapping(site, tmp_path):
    # A .tar.xz from a URL, and the same file on disk: the disk is written once, nothing else is kept.
    from diskkit.disk import payload
    from diskkit.registry.options import RegistryOptions
    from diskkit.source import fetch

    upstream, disk = site
    run("tar", "-cf", disk.with_name("guest.tar"), "-C", disk.parent, "guest.qcow2")
    packed = _xz(disk.with_name("guest.tar"))
    fetched = fetch.download(upstream.url(packed.name), tmp_path / "fetched", [], RegistryOptions())
    local = payload.unwrap(packed, tmp_path / "local")
    for root, got in ((tmp_path / "fetched", fetched), (tmp_path / "local", local)):
        assert [p for p in root.rglob("*") if p.is_file()] == [got.path]
        assert (got.name, got.layers) == ("guest.qcow2", ("xz", "tar"))
        assert _sha(got.path) == _sha(disk)


def test_https_with_credentials_in_the_url(diskkit, site, tmp_path):
    # A private CA through REQUESTS_CA_BUNDLE; basic auth from the URL, never printed.
    from tests.distribution import make_tls_files
    from tests.fileserver import FileServer

    _, disk = site
    ca, cert, key = make_tls_files(tmp_path / "tls")
    with FileServer(disk.parent, credentials="ci:s3cret", tls=(cert, key)) as server:
        url = server.url("guest.qcow2.xz").replace("https://", "https://ci:s3cret@")
        untrusted = diskkit("build", url, "-t", f"oci:{tmp_path / 'a'}:v1", "--retry-times", "0")
        trusted = diskkit("build", url, "-t", f"oci:{tmp_path / 'b'}:v1", "--checksum", f"sha256:{_sha(disk.with_name('guest.qcow2.xz'))}",
                          env={"REQUESTS_CA_BUNDLE": str(ca)})
        wrong = diskkit("build", url.replace("s3cret", "nope"), "-t", f"oci:{tmp_path / 'c'}:v1", env={"REQUESTS_CA_BUNDLE": str(ca)})
    assert untrusted.code == 1
    assert untrusted.err.strip().startswith(f"diskkit: {server.url('guest.qcow2.xz')}: TLS verification failed")
    assert trusted.code == 0, trusted.err
    assert wrong.code == 1 and wrong.err.strip() == f"diskkit: {server.url('guest.qcow2.xz')}: expected status code 200, got 401 (Unauthorized)"
    assert "s3cret" not in untrusted.err + trusted.err + wrong.err and "nope" not in wrong.err


def _blob_statuses(err: str) -> list[str]:
    return [json.loads(line)["status"] for line in err.splitlines() if line.startswith("{") and '"event": "blob"' in line]


def test_url_and_pipe_builds_record_their_layer_pinned_by_the_checksum_checked(diskkit, registry, fault_proxy, site, tmp_path):
    # As a file build's record (diskkit/ops/buildrecord.py), keyed by the URL as shown (no credentials,
    # no query) and the checksum its bytes were verified against: an unchanged rebuild sends no layer.
    upstream, disk = site
    packed = disk.with_name("guest.qcow2.xz")
    digest = f"sha256:{_sha(packed)}"
    proxy = fault_proxy(registry)
    target = f"{proxy.host}/url-{uuid.uuid4().hex[:8]}:v1"
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    uploads = lambda: [p for m, p, _ in proxy.log if "/blobs/uploads/" in p and m in ("POST", "PATCH", "PUT")]  # noqa: E731

    first = diskkit("build", upstream.url("guest.qcow2.xz") + "?token=first-secret", "--checksum", digest, "-t", target, "--json", *FAST, env=env)
    assert first.code == 0, first.err
    assert _blob_statuses(first.err) == ["uploaded"] and uploads()
    records = list((tmp_path / "cache" / "diskkit" / "builds").glob("*.json"))
    assert len(records) == 2 and not any("secret" in r.read_text() for r in records)  # the layer's and the image's

    proxy.log.clear()
    again = diskkit("build", upstream.url("guest.qcow2.xz") + "?token=other-secret", "--checksum", digest, "-t", target, "--json", *FAST, env=env)
    assert again.code == 0, again.err
    assert _blob_statuses(again.err) == ["exists"] and uploads() == []
    assert json.loads(again.out)["digest"] == json.loads(first.out)["digest"]

    # no checksum, nothing pins a URL's bytes: no record is read or written
    unpinned = diskkit("build", upstream.url("guest.qcow2.xz"), "-t", target, "--json", *FAST, env=env)
    assert unpinned.code == 0, unpinned.err
    assert _blob_statuses(unpinned.err) == ["uploaded"]
    assert len(list((tmp_path / "cache" / "diskkit" / "builds").glob("*.json"))) == 2

    piped = []
    for _ in range(2):
        with open(packed, "rb") as stdin:
            proc = subprocess.run([sys.executable, "-m", "diskkit", "build", "-", "--checksum", digest, "-t", target, "--json", *FAST],
                                  stdin=stdin, capture_output=True, text=True, env={**os.environ, "CI": "true", **env})
        assert proc.returncode == 0, proc.stderr
        piped.append(_blob_statuses(proc.stderr))
    assert piped == [["uploaded"], ["exists"]]
    assert diskkit("verify", *FAST, target).code == 0


def _fetches(upstream, name: str = "guest.qcow2.xz") -> int:
    return [n for n, _, _ in upstream.requests].count(name)


def test_unchanged_pinned_url_rebuild_fetches_nothing(diskkit, registry, fault_proxy, site, tmp_path):
    # diskkit/ops/buildskip.py: the checksum names the bytes before they are fetched; the record of the
    # image that build wrote is used once the destination's tag still resolves to its manifest.
    upstream, disk = site
    packed = disk.with_name("guest.qcow2.xz")
    digest = f"sha256:{_sha(packed)}"
    (disk.parent / "SHA256SUMS").write_text(f"{_sha(packed)}  guest.qcow2.xz\n")
    proxy = fault_proxy(registry)
    target = f"{proxy.host}/url-{uuid.uuid4().hex[:8]}:v1"
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    url = upstream.url("guest.qcow2.xz")

    first = diskkit("build", url, "--checksum", digest, "-t", target, "--json", *FAST, env=env)
    assert first.code == 0, first.err
    assert _fetches(upstream) == 1 and "sourceFetched" not in json.loads(first.out)

    for how in (["--checksum", digest], ["--checksum-file", upstream.url("SHA256SUMS")]):
        proxy.log.clear()
        again = diskkit("build", url, *how, "-t", target, "--json", *FAST, env=env)
        assert again.code == 0, again.err
        assert _fetches(upstream) == 1, how  # not one request for the disk
        assert [(m, p) for m, p, _ in proxy.log if m not in ("GET", "HEAD")] == []  # nothing pushed
        assert json.loads(again.out) == {**json.loads(first.out), "sourceFetched": False}
        assert _blob_statuses(again.err) == ["exists"] and "not fetched" in again.err
    assert _fetches(upstream, "SHA256SUMS") == 1  # the checksum file is read: it is what names the bytes
    assert diskkit("verify", *FAST, target).code == 0


def test_pinned_url_rebuild_downloads_when_anything_differs(diskkit, registry, site, tmp_path):
    # Another checksum (the upstream published a new file), other options, the tag moved elsewhere,
    # an unreadable record, no checksum at all: each downloads as before.
    upstream, disk = site
    packed = disk.with_name("guest.qcow2.xz")
    sums = disk.parent / "SHA256SUMS"
    sums.write_text(f"{_sha(packed)}  guest.qcow2.xz\n")
    target = f"{_repo(registry)}:v1"
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    url, pinned = upstream.url("guest.qcow2.xz"), ["--checksum-file", upstream.url("SHA256SUMS")]

    def build(*extra) -> dict:
        result = diskkit("build", url, *extra, "-t", target, "--json", *FAST, env=env)
        assert result.code == 0, result.err
        return json.loads(result.out)

    first = build(*pinned)
    assert _fetches(upstream) == 1
    assert build(*pinned).get("sourceFetched") is False and _fetches(upstream) == 1

    labelled = build(*pinned, "--label", "shasum=x")  # other options: another image
    assert _fetches(upstream) == 2 and labelled["digest"] != first["digest"] and "sourceFetched" not in labelled
    assert build(*pinned)["digest"] == first["digest"] and _fetches(upstream) == 3  # the tag had moved to the labelled image

    other = make_qcow2(tmp_path / "other.qcow2", size="32M", pattern=0x5A)
    moved = diskkit("build", other, "-t", target, "--json", *FAST, env=env)  # the tag moved by another build
    assert moved.code == 0, moved.err
    assert build(*pinned)["digest"] == first["digest"] and _fetches(upstream) == 4
    assert build(*pinned).get("sourceFetched") is False and _fetches(upstream) == 4

    for record in (tmp_path / "cache" / "diskkit" / "builds").glob("*.json"):
        record.write_text("{not json")
    assert build(*pinned)["digest"] == first["digest"] and _fetches(upstream) == 5

    assert "sourceFetched" not in build() and "sourceFetched" not in build() and _fetches(upstream) == 7  # unpinned: always fetched

    make_qcow2(disk, size="32M", pattern=0x77)  # the upstream publishes a new disk and its checksum
    packed.unlink()
    _xz(disk)
    sums.write_text(f"{_sha(packed)}  guest.qcow2.xz\n")
    changed = build(*pinned)
    assert _fetches(upstream) == 8 and changed["digest"] != first["digest"] and "sourceFetched" not in changed


def test_unchanged_pinned_index_in_a_layout_fetches_nothing(diskkit, site, tmp_path):
    # An OCI layout is read back by its tag as a registry is; an index's record holds every platform's manifest.
    upstream, disk = site
    arm = make_qcow2(disk.with_name("arm.qcow2"), size="16M", pattern=0x77)
    (disk.parent / "SHA256SUMS").write_text(f"{_sha(disk)}  guest.qcow2\n{_sha(arm)}  arm.qcow2\n")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    args = ["build", "--platform", f"linux/amd64={upstream.url('guest.qcow2')}", "--platform", f"linux/arm64={upstream.url('arm.qcow2')}",
            "--checksum-file", upstream.url("SHA256SUMS"), "-t", f"oci:{tmp_path / 'l'}:v1", "--json"]
    first = diskkit(*args, env=env)
    assert first.code == 0, first.err
    again = diskkit(*args, env=env)
    assert again.code == 0, again.err
    assert json.loads(again.out) == {**json.loads(first.out), "sourceFetched": False}
    assert (_fetches(upstream, "guest.qcow2"), _fetches(upstream, "arm.qcow2")) == (1, 1)
    assert _blob_statuses(again.err) == ["exists", "exists"]
