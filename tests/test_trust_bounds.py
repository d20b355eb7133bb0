"""Bounded inputs (diskkit.limits): what a registry, an image's author or a file says about a length,
a size or a count is bounded before anything is allocated or written, and the refusal is one line.

The hostile image: a lazy TOC is in the blob and pinned by the manifest's annotation, so the liar is
the image's author. Its TOC gives chunk 0 an 8 GiB gzip member and chunk 1 (new content) a 50 GiB one,
back to back, as a real 58 GiB blob would hold them. The blob is a sparse file planted in a real
registry's storage under a digest it does not have (the registry serves it as any blob; nothing
reads that far before the lie is refused). Every process it is thrown at runs under an address-space
limit (`prlimit --as`), so that where it would allocate the lengths it fails at once rather than
taking the machine's memory, and its peak RSS is measured (wait4's ru_maxrss, or /proc VmHWM)."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import http.server
import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import zlib
from pathlib import Path

import blake3
import pytest
import requests

from diskkit import limits
from diskkit.errors import DiskkitError
from diskkit.layers import lazytoc
from diskkit.registry.options import RegistryOptions
from diskkit.signing.options import TrustOptions
from tests.conftest import launcher_command, run_diskkit, run_launcher
from tests.distribution import start_registry
from tests.lazyhost import control, stop_spawned_server, wait_for
from tests.procs import terminate
from tests.test_gpg_signing import build, keys, one_line, policy, signed_by  # noqa: F401 (fixtures)
from tests.test_signature_api import api  # noqa: F401 (fixture)

NOREG = "--tls-verify=false"
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
LIES = {0: 8 * GIB, 1: 50 * GIB}  # chunk -> the gzip member length the hostile TOC states
AS_LIMIT = 2 * GIB  # far below any lie: an allocation of one fails at once instead of paging the node out
RSS_LIMIT = 200 * MIB
REPO = "bounds/huge"


# --- the rule, pure -------------------------------------------------------------------------------

def test_the_toc_parse_refuses_a_member_longer_than_its_chunk_and_a_chunk_over_64_mib():
    """lazytoc.parse, which every reader of a TOC goes through (the pull, its delta plan and parallel
    inflater, the disk server's walk, verify), bounds what a TOC can make a reader allocate."""
    def parse(doc: dict):
        data = json.dumps(doc).encode()
        loc = lazytoc.TocLocation(1 << 40, len(data), "sha256:" + hashlib.sha256(data).hexdigest())
        return lazytoc.parse(data, loc, "layer", lazytoc.VERSION_GZIP)

    pins = ["0" * 64] * 2
    fine = {"version": 2, "disk": "disk/d.img", "offset": 1536, "size": 2 * MIB, "chunkSize": MIB, "memberBlake3s": pins,
            "members": [[1024, limits.member_limit(MIB)], [1024 + limits.member_limit(MIB), 5]]}
    assert parse(fine).members[0][1] == limits.member_limit(MIB)
    with pytest.raises(limits.TooLarge, match=r"gzip member of chunk 1 \(a 1048576-byte chunk\) is 53687091200 bytes, more than 1053696; refused"):
        parse({**fine, "members": [[1024, 5], [1029, 50 * GIB]]})
    with pytest.raises(limits.TooLarge, match="chunk size is 68719476736 bytes, more than 67108864"):
        parse({**fine, "size": 64 * GIB, "chunkSize": 64 * GIB, "memberBlake3s": pins[:1], "members": [[1024, 40 * GIB]]})


# --- the hostile image ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def liar(tmp_path_factory):
    """A registry of this module's own holding v1 (a 4 MiB lazy image) and v2, the lie."""
    work = tmp_path_factory.mktemp("bounds")
    registry = start_registry(work / "registry")
    try:
        rng = random.Random(38)
        disk = work / "v1.img"
        disk.write_bytes(rng.randbytes(4 * MIB))
        built = run_diskkit("build", NOREG, disk, "-t", f"{registry.host}/{REPO}:v1")
        assert built.code == 0, built.err
        _plant_v2(registry, rng.randbytes(MIB))
        yield registry
    finally:
        registry.stop()


def _plant_v2(registry, new_chunk: bytes) -> None:
    accept = {"Accept": "application/vnd.oci.image.manifest.v1+json"}
    manifest = requests.get(registry.url(f"/v2/{REPO}/manifests/v1"), headers=accept, timeout=30).json()
    layer = manifest["layers"][0]
    data = registry.blob_data_path(layer["digest"]).read_bytes()
    notes = layer["annotations"]
    at, size = int(notes[lazytoc.ANNOTATION_TOC_OFFSET]), int(notes[lazytoc.ANNOTATION_TOC_SIZE])
    toc = json.loads(zlib.decompress(data[at : at + size], 31))
    members = toc["members"]
    stored = [data[o : o + n] for o, n in members]
    stored[1] = gzip.compress(new_chunk, mtime=0)  # chunk 1 changed: the node holds all the others
    toc[lazytoc.CONTENT_FIELD][1] = blake3.blake3(new_chunk).hexdigest()
    toc["memberBlake3s"][1] = blake3.blake3(stored[1]).hexdigest()
    placed, pos = [], members[0][0]
    for i, member in enumerate(stored):
        placed.append([pos, LIES.get(i, len(member))])
        pos += placed[-1][1]
    toc["members"] = placed
    doc = json.dumps(toc, separators=(",", ":"), sort_keys=True).encode()
    toc_member = gzip.compress(doc, mtime=0)
    between, rest = data[sum(members[-1]) : at], data[at + size :]
    toc_at = pos + len(between)
    total = toc_at + len(toc_member) + len(rest)
    fake = "sha256:" + hashlib.sha256(b"fifty GiB of lies").hexdigest()
    path = registry.blob_data_path(fake)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(total)  # sparse: the lie costs the test nothing
        for offset, piece in [(0, data[: members[0][0]]), *zip((o for o, _ in placed), stored), (pos, between), (toc_at, toc_member + rest)]:
            os.pwrite(f.fileno(), piece, offset)
    link = registry.root / "docker/registry/v2/repositories" / REPO / "_layers/sha256" / fake[7:] / "link"
    link.parent.mkdir(parents=True)
    link.write_text(fake)
    config = json.loads(registry.blob_data_path(manifest["config"]["digest"]).read_bytes())
    config["rootfs"]["diff_ids"] = ["sha256:" + hashlib.sha256(b"never reached").hexdigest()]
    config_bytes = json.dumps(config).encode()
    manifest["config"].update(digest=_push_blob(registry, config_bytes), size=len(config_bytes))
    layer.update(digest=fake, size=total)
    notes.update({lazytoc.ANNOTATION_TOC_OFFSET: str(toc_at), lazytoc.ANNOTATION_TOC_SIZE: str(len(toc_member)),
                  lazytoc.ANNOTATION_TOC_DIGEST: "sha256:" + hashlib.sha256(doc).hexdigest()})
    put = requests.put(registry.url(f"/v2/{REPO}/manifests/v2"), data=json.dumps(manifest).encode(),
                       headers={"Content-Type": manifest["mediaType"]}, timeout=30)
    assert put.status_code == 201, put.text


def _push_blob(registry, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    started = requests.post(registry.url(f"/v2/{REPO}/blobs/uploads/"), timeout=30)
    location = started.headers["Location"]
    location = location if location.startswith("http") else registry.url(location)
    done = requests.put(location, params={"digest": digest}, data=data, headers={"Content-Type": "application/octet-stream"}, timeout=30)
    assert done.status_code == 201, done.text
    return digest


# Linux starts a child's peak RSS at its parent's (fork copies the high-water mark, exec keeps the max):
# measured straight from a pytest worker that has grown, the command would be charged for it. A small
# process in between forks the command and reports the command's own peak on the pipe it is given.
PEAK_OF = """
import os, sys
report = int(sys.argv[1])
pid = os.fork()
if pid == 0:
    os.close(report)
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
os.write(report, str(usage.ru_maxrss).encode())
sys.exit(os.waitstatus_to_exitcode(status) % 256)
"""


def limited(command: list[str], timeout: float = 300, **popen) -> tuple[int, str, str, int]:
    """(exit status, stdout, stderr, peak RSS in bytes) of `command` under AS_LIMIT."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        peak_r, peak_w = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-c", PEAK_OF, str(peak_w), "prlimit", f"--as={AS_LIMIT}", "--", *command],
                                    stdout=out, stderr=err, env={**os.environ, "CI": "true"}, pass_fds=(peak_w,),
                                    start_new_session=True, **popen)
            os.close(peak_w)
            peak_w = -1
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the command too, not only the process measuring it
                proc.wait()
            peak = os.read(peak_r, 64)
        finally:
            os.close(peak_r)
            if peak_w != -1:
                os.close(peak_w)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"), int(peak or 0) * KIB


def refused_in_one_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, (code, err[-3000:])
    return lines[0]


LIE = rf"gzip member of chunk 0 \(a {MIB}-byte chunk\) is {8 * GIB} bytes, more than {limits.member_limit(MIB)}; refused"


@pytest.mark.parametrize("path", ["delta", "whole"])
def test_launcher_pull_refuses_a_50_gib_member_in_one_line_under_200_mib(liar, tmp_path, path):
    """Attack (issue 38, 3): with v1 cached the pull plans v2 by chunks and asked for the 50 GiB member
    in one buffer (`bytearray(length)`): MemoryError. Without v1 the parallel inflater cuts members
    from the stream: it refused the lie already, and is kept refusing it (now by the TOC's parse)."""
    cache = tmp_path / "cache"
    if path == "delta":
        first = run_launcher("pull", "--cache-dir", cache, NOREG, f"{liar.host}/{REPO}:v1")
        assert first.code == 0, first.err
    def pulled() -> set[Path]:
        return {p for area in ("disks", "refs") for p in (cache / area).rglob("*") if p.is_file()}

    held = pulled()
    code, _, err, rss = limited(launcher_command("pull", "--cache-dir", cache, NOREG, f"{liar.host}/{REPO}:v2"))
    line = refused_in_one_line(code, err)
    assert re.search(LIE, line) if path == "delta" else str(8 * GIB) in line, line  # the inflater's own words before
    assert rss < RSS_LIMIT, rss
    assert pulled() == held and not [p for p in (cache / "tmp").rglob("*") if p.is_file()]


def test_the_disk_server_refuses_a_50_gib_member_on_open_and_stays_small(liar, tmp_path):
    """Attack (issue 38, 3): one open of the lie made root's node-wide server's prefetch threads ask for
    the members whole (40-50 GiB): without a memory limit the server, and every lazy VM's disk with it,
    went down. Now the open is refused in one line and the server serves on, its peak RSS small."""
    cache = tmp_path / "cache"
    cache.mkdir()
    log = open(tmp_path / "serve.log", "ab")
    server = subprocess.Popen(["prlimit", f"--as={AS_LIMIT}", "--", *launcher_command("serve", "--cache-dir", cache, NOREG)],
                              stdout=log, stderr=log, env={**os.environ, "CI": "true"})
    try:
        def ready():
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            with contextlib.suppress(OSError, ValueError):
                return control(cache, {"op": "status"}, timeout=5).get("ok")
        wait_for(ready, 30, "the disk server to answer")
        answer = control(cache, {"op": "open", "image": f"{liar.host}/{REPO}:v2", "registry": {"tls_verify": False, "retries": 1}})
        assert not answer.get("ok") and re.search(LIE, answer.get("error", "")) and "\n" not in answer["error"], answer
        # Still serving: the genuine image opens.
        assert control(cache, {"op": "open", "image": f"{liar.host}/{REPO}:v1", "registry": {"tls_verify": False}}).get("ok")
        status = Path(f"/proc/{server.pid}/status").read_text()
        peak = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * KIB
        assert peak < RSS_LIMIT, peak
    finally:
        terminate(server)
        log.close()


RANGE_READ = """
import sys
from diskkit.errors import DiskkitError
from diskkit.registry.client import Registry
from diskkit.registry.options import RegistryOptions
from diskkit.registry.ranges import BlobRanges
host, repo, digest, size, length = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
try:
    BlobRanges(Registry(host, RegistryOptions(tls_verify=False, retries=0)), repo, digest, size).read(0, length)
except DiskkitError as exc:
    print(exc.line())
"""


def test_a_range_costs_memory_only_as_its_bytes_arrive(liar):
    """diskkit.registry.ranges.BlobRanges, which the disk server and the delta pull read every range
    with: a 50 GiB range of a blob whose descriptor claims 60 GiB, of which a few MiB arrive, ends in one
    line under 200 MiB. Before, the range's buffer was allocated whole first (`bytearray(length)`), so
    whatever length a caller let through was memory before a byte came."""
    accept = {"Accept": "application/vnd.oci.image.manifest.v1+json"}
    manifest = requests.get(liar.url(f"/v2/{REPO}/manifests/v1"), headers=accept, timeout=30).json()
    digest = manifest["layers"][0]["digest"]
    code, out, err, rss = limited([sys.executable, "-c", RANGE_READ, liar.host, REPO, digest, str(60 * GIB), str(50 * GIB)])
    assert code == 0 and "range ended early" in out, (code, out, err[-2000:])
    assert rss < RSS_LIMIT, rss


# --- signatures -----------------------------------------------------------------------------------

@pytest.fixture
def dir_image(registry, keys, tmp_path) -> tuple[Path, Path]:  # noqa: F811 (the keys fixture)
    """A dir: image and a policy that requires its signature-N files (key a, exact reference)."""
    ref = f"{registry.host}/bounds/indir:v1"
    build(_tiny_disk(tmp_path), ref)
    image = tmp_path / "img"
    copied = run_diskkit("copy", NOREG, f"docker://{ref}", f"dir:{image}")
    assert copied.code == 0, copied.err
    pol = tmp_path / "dir.json"
    pol.write_text(json.dumps({"default": [{"type": "reject"}], "transports": {"dir": {"": [
        signed_by(keys, "a", signedIdentity={"type": "exactReference", "dockerReference": ref})]}}}))
    return image, pol


def _tiny_disk(tmp_path: Path) -> Path:
    disk = tmp_path / "tiny.raw"
    disk.write_bytes(b"\x5a" * MIB)
    return disk


@pytest.mark.parametrize("planted", ["link to /dev/zero", "fifo"])
def test_a_dir_signature_that_is_not_a_regular_file_is_refused_unread(dir_image, planted):
    """Attack (issue 38, 10): `signature-1 -> /dev/zero` was read whole (2.7 GB RSS, then a traceback)
    and a FIFO there hung the read; each is now refused in one line, naming the file, before a byte
    is read (diskkit.limits.read_regular: O_NONBLOCK, fstat, regular files only)."""
    image, pol = dir_image
    sig = image / "signature-1"
    if planted == "fifo":
        os.mkfifo(sig)
    else:
        sig.symlink_to("/dev/zero")
    code, _, err, rss = limited([*_diskkit(), "inspect", "--signature-policy", str(pol), f"dir:{image}"], timeout=120)
    line = refused_in_one_line(code, err)
    kind = "a FIFO" if planted == "fifo" else "a character device"
    assert f"{image}/signature-1: is not a regular file ({kind}); refused" in line, line
    assert rss < RSS_LIMIT, rss


def _diskkit() -> list[str]:
    return [sys.executable, "-m", "diskkit"]


def test_a_dir_signature_over_4_mib_is_refused(dir_image):
    """containers/image's MaxSignatureBodySize holds for a dir: image's files too (directory_src.go reads them whole)."""
    image, pol = dir_image
    (image / "signature-1").write_bytes(b"\x00simple-signing\n" + bytes(limits.MAX_SIGNATURE_BYTES))
    line = one_line(run_diskkit("inspect", "--signature-policy", pol, f"dir:{image}"))
    assert f"{image}/signature-1: the signature is larger than {limits.MAX_SIGNATURE_BYTES} bytes; refused" in line, line


class _Stalling(http.server.BaseHTTPRequestHandler):
    """A lookaside that starts a signature and never finishes it."""

    release: threading.Event

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "4096")
        self.end_headers()
        self.wfile.write(b"\x00simple-signing\n")
        self.wfile.flush()
        self.release.wait(120)


def test_a_lookaside_that_stalls_mid_signature_is_one_line_after_the_timeout(registry, keys, tmp_path):  # noqa: F811
    """Attack (issue 38, 10): a lookaside that sends a signature's first bytes and then nothing ended
    in a urllib3 ReadTimeoutError traceback; now it is the registry options' timeout and one line."""
    ref = f"{registry.host}/bounds/stalled:v1"
    build(_tiny_disk(tmp_path), ref)
    release = threading.Event()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Stalling", (_Stalling,), {"release": release}))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        regd = tmp_path / "registries.d"
        regd.mkdir()
        (regd / "site.yaml").write_text(f"default-docker:\n  lookaside: http://127.0.0.1:{server.server_address[1]}\n")
        pol = policy(tmp_path / "a.json", f"{registry.host}/bounds", signed_by(keys, "a"))
        from diskkit.signing.trust import enforce_ref

        with pytest.raises(DiskkitError) as refused:
            enforce_ref(f"docker://{ref}", TrustOptions(pol, regd), RegistryOptions(tls_verify=False, timeout=2))
        line = refused.value.line()
        assert "/signature-1: the signature: " in line and "timed out" in line.lower() and "\n" not in line, line
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_the_signature_apis_list_is_cut_at_128_before_any_gpg_runs(api, keys, tmp_path):  # noqa: F811
    """Attack (issue 38, 10): the registry signature API's list may hold ~60,000 signatures in its
    4 MiB, each checked by a gpg process (~10 min per read). containers/image caps a lookaside at
    maxLookasideSignatures (128, docker/docker_image_src.go) and the API's list only by its size
    (iolimits.MaxSignatureListBodySize); the count cap holds for every store here."""
    openshift, store, _ = api
    ref = f"{openshift.host}/sigapi/many:v1"
    digest = build(_tiny_disk(tmp_path), ref)
    import base64
    entry = {"schemaVersion": 2, "type": "atomic", "content": base64.b64encode(b"\x00simple-signing\nnot a signature").decode()}
    store.store[("sigapi/many", digest)] = [{**entry, "name": f"{digest}@{i:032x}"} for i in range(2000)]
    pol = policy(tmp_path / "a.json", f"{openshift.host}/sigapi", signed_by(keys, "a"))
    line = one_line(run_diskkit("inspect", NOREG, "--signature-policy", pol, ref))
    assert "server provided 2000 signatures, more than 128; assuming that's unreasonable and a server error" in line, line


# --- the disk server's log ------------------------------------------------------------------------

def test_the_disk_servers_log_is_its_own_users_alone(tmp_path):
    """Attack (issue 38, 10): serve/server.log in a root cache was world-readable (0644 under the usual
    umask): it names every image the node's users opened and why it failed. It is 0600 now, an old one
    made so when a server is next spawned, and a link in its place is never followed."""
    from launcher.diskserver.spawn import ensure_server
    from launcher.node.cache import Cache

    cache = Cache(tmp_path / "cache")
    serve = tmp_path / "cache" / "serve"
    serve.mkdir(parents=True)
    log = serve / "server.log"
    log.write_text("an older server's lines\n")
    log.chmod(0o644)
    try:
        ensure_server(cache)
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        assert log.read_text().startswith("an older server's lines\n")
    finally:
        stop_spawned_server(tmp_path / "cache")


# --- delta pulls and what they tell the registry ----------------------------------------------------

def test_chunk_reuse_can_be_turned_off_and_then_no_range_tells_the_registry_what_the_node_holds(registry, fault_proxy, tmp_path):
    """A delta pull asks the registry only for the chunks the node lacks, which tells it which ones
    the node holds (docs/security.md). DISKKIT_REUSE_CHUNKS=0 turns reuse off: the layer is fetched
    whole, the only range asked is its TOC's (for the parallel inflater), nothing is taken from the cache."""
    from tests.test_delta_pull import _disks, build as build_delta, manifest_digest_layer, pull

    v1, v2, _ = _disks(tmp_path)
    ref1, _ = build_delta(registry.host, v1, "noreuse:v1"), build_delta(registry.host, v2, "noreuse:v2")
    cache = tmp_path / "cache"
    pull(cache, ref1)
    proxy = fault_proxy(registry)
    pulled = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", f"{proxy.host}/delta/noreuse:v2", env={"DISKKIT_REUSE_CHUNKS": "0"})
    assert pulled.code == 0, pulled.err
    assert json.loads(pulled.out)["reused"] == 0
    toc_at = int(manifest_digest_layer(proxy, "noreuse:v2")["annotations"][lazytoc.ANNOTATION_TOC_OFFSET])
    assert [r for r in proxy.ranges if not r[1].startswith(f"bytes={toc_at}-")] == [], proxy.ranges
    # With reuse on (the default), the same pull takes v1's chunks: the switch is what made the difference.
    again = run_launcher("pull", "--cache-dir", tmp_path / "again", NOREG, "--json", ref1)
    assert again.code == 0, again.err
    assert pull(tmp_path / "again", f"{proxy.host}/delta/noreuse:v2")[0]["reused"] > 0
