"""Issue 29's refused attacks that no other test proved: a lying registry (a proxy in front of the real one),
hostile images pushed to the real registry, hostile specs. Each test names its attack; each asserts the one-line
refusal, a non-zero exit and an empty cache.

The attacks the audit found refused and other files already prove are listed in the table of the issue's report
(docs/security.md); this file holds the rest.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_qcow2, run, run_diskkit, run_launcher
from tests.refusals import assert_refused
from tests.faultproxy import Fault
from tests.fileserver import FileServer
from tests.lazyhost import control, disk_server
from tests.vmhost import qemu_scratch
from tests.imagecraft import Member, dir_, write_layout
from tests.test_dv_import import Claims, dv

NOREG = "--tls-verify=false"


def pull(cache: Path, ref: str, *extra: str):
    return run_launcher("pull", "--cache-dir", cache, NOREG, "--retry-times", "0", *extra, ref)


def raw_manifest(ref: str, *creds: str) -> tuple[bytes, str]:
    out = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", *creds, f"docker://{ref}"], capture_output=True, check=True).stdout
    return out, "sha256:" + hashlib.sha256(out).hexdigest()


def skopeo_copy(src: str, dest: str, *extra: str) -> None:
    run("skopeo", "copy", "-q", "--dest-tls-verify=false", *extra, src, f"docker://{dest}")


@pytest.fixture(scope="module")
def source_disk(tmp_path_factory) -> Path:
    return make_qcow2(tmp_path_factory.mktemp("src") / "guest.qcow2", size="16M", pattern=0x5A)


@pytest.fixture(scope="module")
def pushed(registry, source_disk) -> str:
    ref = f"{registry.host}/trust/refused:v1"
    result = run_diskkit("build", NOREG, source_disk, "-t", ref)
    assert result.code == 0, result.err
    return ref


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


# ------------------------------------------------------------------ a lying registry (a proxy in front of the real one)

def test_a_manifest_that_is_not_the_digest_it_was_pulled_by_is_refused(cache, registry, pushed, fault_proxy):
    """Attack: the registry answers a pull by digest with other manifest bytes (one bit changed, still valid JSON)."""
    body, digest = raw_manifest(pushed)
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", r"/manifests/", "flip", times=10, arg=body.index(b"mediaType") + 2))
    ref = pushed.replace(registry.host, proxy.host).split(":v1")[0] + "@" + digest
    # refused by the digest rule, checked twice (against the reference, then against the descriptor that named it)
    assert_refused(pull(cache, ref), digest, "does not match", cache=cache)


def test_a_config_that_is_not_its_digest_is_refused(cache, registry, pushed, fault_proxy):
    """Attack: the registry serves a config blob (the diffIDs that pin the layers) other than the manifest pins."""
    manifest = json.loads(raw_manifest(pushed)[0])
    config = manifest["config"]["digest"]
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", config, "flip", times=10, arg=2))
    result = pull(cache, pushed.replace(registry.host, proxy.host))
    assert_refused(result, "does not match its digest", cache=cache)


def test_credentials_are_not_sent_to_the_host_a_blob_is_redirected_to(cache, auth_registry, registry, source_disk, fault_proxy):
    """Attack: a private registry's answer redirects a layer to another host, hoping the node sends that host its
    credentials (as a blob store behind a registry). requests drops Authorization on a change of host, as Go's
    net/http does (src/net/http/client.go, shouldCopyHeaderOnRedirect) for containers/image's docker client. The
    other host serves the same bytes, so the pull succeeds and only what that host received is in question."""
    creds = f"{auth_registry.username}:{auth_registry.password}"
    private, public = f"{auth_registry.host}/trust/private:v1", f"{registry.host}/trust/private:v1"
    for ref, extra in ((private, ["--creds", creds]), (public, [])):
        assert run_diskkit("build", NOREG, *extra, source_disk, "-t", ref).code == 0
    layer = json.loads(raw_manifest(private, "--creds", creds)[0])["layers"][0]["digest"]
    liar, elsewhere = fault_proxy(auth_registry), fault_proxy(registry)
    liar.add(Fault("GET", layer, "redirect", times=10, arg=elsewhere.url(f"/v2/trust/private/blobs/{layer}")))
    result = pull(cache, private.replace(auth_registry.host, liar.host), "--creds", creds)
    assert result.code == 0, result.err
    assert any(path.endswith(layer) for path, _ in liar.credentials)  # the registry itself got them
    assert [p for _, p, _ in elsewhere.log if p.endswith(layer)], elsewhere.log  # the layer did come from elsewhere
    assert elsewhere.credentials == []


def _redirect_loop(registry, pushed, fault_proxy) -> str:
    proxy = fault_proxy(registry)
    repo = pushed.split("/", 1)[1].split(":")[0]
    proxy.add(Fault("GET", "/manifests/", "redirect", times=100, arg=proxy.url(f"/v2/{repo}/manifests/v1")))
    return pushed.replace(registry.host, proxy.host)


def test_a_manifest_redirected_to_itself_ends_in_one_line(cache, registry, pushed, fault_proxy):
    """Attack: the registry redirects a manifest request to itself without end, to hold the node forever. The client
    gives up after a bounded number of redirects, in one line; nothing is kept."""
    assert_refused(pull(cache, _redirect_loop(registry, pushed, fault_proxy)), "redirect", cache=cache)


@pytest.mark.parametrize("ref, rule", [
    ("../../etc/x:v1", "not an image reference"),
    ("{host}/../x:v1", "repository must be lowercase [a-z0-9._-] components"),
    ("{host}/a/..%2f..:v1", "repository must be lowercase [a-z0-9._-] components"),
    ("{host}/a/b:../../c", "invalid image reference"),
])
def test_image_names_with_dot_dot_are_refused(cache, registry, ref, rule):
    """Attack: an image name with `..` components or an encoded slash, to reach another repository's (or a host)
    path through the registry's URL or the cache's directories."""
    ref = ref.format(host=registry.host)
    assert_refused(pull(cache, ref), ref, rule, cache=cache)


# ------------------------------------------------------------------ hostile images pushed to the real registry

def _layout_with_config(tmp_path: Path, name: str, members: list[Member], edit) -> Path:
    """An OCI layout whose config (then manifest and index) `edit` rewrites after the fact, as a forger would."""
    layout = write_layout(tmp_path / name, [members])
    blobs = layout / "blobs" / "sha256"
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((blobs / index["manifests"][0]["digest"][7:]).read_text())
    config = json.loads((blobs / manifest["config"]["digest"][7:]).read_text())
    edit(config)

    def put(data: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return "sha256:" + digest, len(data)

    manifest["config"]["digest"], manifest["config"]["size"] = put(json.dumps(config).encode())
    index["manifests"][0]["digest"], index["manifests"][0]["size"] = put(json.dumps(manifest).encode())
    (layout / "index.json").write_text(json.dumps(index))
    return layout


def test_a_layer_whose_diffid_the_config_does_not_pin_is_refused(cache, registry, source_disk, tmp_path):
    """Attack: a manifest whose config pins other uncompressed bytes (diffID) than the layer it names inflates to."""
    members = [dir_("disk"), Member("disk/d.qcow2", source_disk.read_bytes())]
    layout = _layout_with_config(tmp_path, "diffid", members, lambda c: c["rootfs"].update(diff_ids=["sha256:" + "0" * 64]))
    ref = f"{registry.host}/trust/diffid:v1"
    skopeo_copy(f"oci:{layout}:t", ref)
    assert_refused(pull(cache, ref), "diff", cache=cache)


def test_an_index_with_only_a_foreign_architecture_is_refused(cache, registry, source_disk, tmp_path):
    """Attack: an index that offers this host no image (only arm64), hoping the node boots a foreign one."""
    layout = write_layout(tmp_path / "arm", [[dir_("disk"), Member("disk/d.qcow2", source_disk.read_bytes())]])
    blobs = layout / "blobs" / "sha256"
    entry = json.loads((layout / "index.json").read_text())["manifests"][0]
    entry.pop("annotations")
    entry["platform"] = {"architecture": "arm64", "os": "linux"}
    inner = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [entry]}).encode()
    digest = hashlib.sha256(inner).hexdigest()
    (blobs / digest).write_bytes(inner)
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.index.v1+json", "digest": "sha256:" + digest, "size": len(inner),
        "annotations": {"org.opencontainers.image.ref.name": "t"}}]}))
    ref = f"{registry.host}/trust/foreign:v1"
    skopeo_copy(f"oci:{layout}:t", ref, "--all")
    assert_refused(pull(cache, ref, "--platform", "linux/amd64"), "linux/amd64", cache=cache)


def test_a_disk_twice_in_one_layer_is_the_last_one_for_every_reader(cache, registry, source_disk, tmp_path):
    """Attack: the same /disk member twice in a tar, hoping the reviewer's reader (verify) keeps one and the node's
    (pull) the other. Both keep the last, as a tar extraction (and containerd's unpack for KubeVirt) does."""
    layout = write_layout(tmp_path / "twice", [[dir_("disk"), Member("disk/d.qcow2", source_disk.read_bytes()), Member("disk/d.qcow2", b"\1" * 4096)]])
    ref = f"{registry.host}/trust/twice:v1"
    skopeo_copy(f"oci:{layout}:t", ref)
    verified = run_diskkit("verify", NOREG, f"docker://{ref}")
    assert verified.code == 0 and "is raw, virtual size 4096 bytes" in verified.out, verified.out + verified.err
    result = pull(cache, ref)
    assert result.code == 0, result.err
    assert Path(result.out.strip()).read_bytes() == b"\1" * 4096


def _qcow2_header(tmp_path: Path, *fields: tuple[int, str, int]) -> bytes:
    disk = make_qcow2(tmp_path / "hostile.qcow2", size="16M")
    data = bytearray(disk.read_bytes())
    for offset, fmt, value in fields:  # QCowHeader fields, big-endian
        struct.pack_into(fmt, data, offset, value)
    return bytes(data)


def _qcow2_with_data_file(tmp_path: Path) -> bytes:
    # Made against a scratch file: qemu-img create sizes (zeroes) the data file it names, so never a host file
    # here; the header names it all the same, and that is what must be refused.
    disk = tmp_path / "hostile.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", f"data_file={tmp_path / 'data.raw'},data_file_raw=on", disk, "16M")
    return disk.read_bytes()


QCOW2_BOMBS = {
    # a 32 PiB disk whose 256 MiB L1 table qemu-img would allocate to open it
    "l1-table": (lambda t: _qcow2_header(t, (24, ">Q", 1 << 55), (36, ">I", 1 << 25)), "Active L1 table too large"),
    # a refcount table of 2^31 clusters, to be read in full by qemu-img info
    "refcount-table": (lambda t: _qcow2_header(t, (56, ">I", 1 << 31)), "Reference count table too large"),
    # the guest's writes to go to a host file (KubeVirt refuses data files as it refuses backing files)
    "data-file": (_qcow2_with_data_file, "data file"),
}


@pytest.mark.parametrize("case", sorted(QCOW2_BOMBS))
def test_a_hostile_qcow2_in_an_image_is_refused_under_qemu_img_limits(cache, registry, tmp_path, case):
    """Attack: a registry image whose /disk qcow2 has a huge L1 table, a refcount table bomb or an external data
    file, to exhaust the node in qemu-img info or to have the guest reach a host file."""
    make, rule = QCOW2_BOMBS[case]
    members = [dir_("disk"), Member("disk/d.qcow2", make(tmp_path))]
    ref = f"{registry.host}/trust/qcow2-{case}:v1"
    skopeo_copy(f"oci:{write_layout(tmp_path / 'l', [members])}:t", ref)
    assert_refused(pull(cache, ref), "/disk/d.qcow2", rule, cache=cache)


def test_an_oversize_gzip_layer_is_refused_at_its_descriptor_size(cache, source_disk, tmp_path):
    """Attack: a layer blob longer than its descriptor's size (a registry that sends more than it pinned)."""
    layout = write_layout(tmp_path / "big", [[dir_("disk"), Member("disk/d.qcow2", source_disk.read_bytes())]])
    blobs = layout / "blobs" / "sha256"
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((blobs / index["manifests"][0]["digest"][7:]).read_text())
    manifest["layers"][0]["size"] -= 100
    data = json.dumps(manifest).encode()
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    index["manifests"][0].update(digest="sha256:" + digest, size=len(data))
    (layout / "index.json").write_text(json.dumps(index))
    line = assert_refused(pull(cache, f"oci:{layout}:t"), cache=cache)
    # the byte past the descriptor's size is refused; were it not, the bytes within it fail the digest
    assert re.search(r"is longer than its descriptor's \d+ bytes|does not match its digest", line), line



# ------------------------------------------------------------------ DataVolume http imports: a lying web server

@pytest.fixture(scope="module")
def data_files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("www")
    with open(root / "data.img", "wb") as f:
        f.write(b"\xcd" * (1 << 20))
        f.truncate(4 << 20)
    return root


def test_a_datavolume_import_redirected_to_a_file_url_reads_nothing(tmp_path, data_files, fault_proxy):
    """Attack: the http source of a DataVolume redirects to file:// on the node (the spec itself refuses any URL that
    is not http:// or https://, tests/test_datavolume.py). Nothing is read and the claim keeps no disk."""
    secret = tmp_path / "host-secret.img"
    secret.write_bytes(b"host secret " * 1000)
    claims = Claims(tmp_path)
    with FileServer(data_files) as www:
        proxy = fault_proxy(www)
        proxy.add(Fault("GET", "/data.img", "redirect", times=10, arg=f"file://{secret}"))
        claims.add(dv("redirected", {"http": {"url": proxy.url("/data.img")}}, "8Mi"))
        result = claims.run("import", "redirected")
    assert result.code == 1, result.out
    assert "host secret" not in result.out + result.err
    last = result.err.strip().splitlines()[-1]  # the line before it is the progress line naming the import
    assert last.startswith("launcher: DataVolume default/redirected: ") and f"file://{secret}" in last, result.err
    claims.assert_untouched("redirected")


def test_a_datavolume_secret_is_not_sent_to_the_host_an_import_is_redirected_to(tmp_path, data_files, fault_proxy):
    """Attack: the http source given basic auth from a Secret (secretRef) redirects to another host, hoping the node
    sends that host the Secret's credentials. The other host serves the file, so the import succeeds."""
    claims = Claims(tmp_path)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "endpoint"},
              "data": {"accessKeyId": base64.b64encode(b"importer").decode(), "secretKey": base64.b64encode(b"s3cret").decode()}}
    with FileServer(data_files, credentials="importer:s3cret") as private, FileServer(data_files) as public:
        liar, elsewhere = fault_proxy(private), fault_proxy(public)
        liar.add(Fault("GET", "/data.img", "redirect", times=10, arg=elsewhere.url("/data.img")))
        claims.add(secret, dv("moved", {"http": {"url": liar.url("/data.img"), "secretRef": "endpoint"}}, "8Mi"))
        result = claims.run("import", "moved")
    assert result.code == 0, result.err
    assert liar.credentials and elsewhere.credentials == [], (liar.credentials, elsewhere.credentials)
    assert [p for _, p, _ in elsewhere.log if p == "/data.img"], elsewhere.log
    assert (claims.dirs["moved"] / "disk.img").read_bytes()[: 1 << 20] == b"\xcd" * (1 << 20)


# ------------------------------------------------------------------ hostile VMI input

def test_a_secret_name_with_slashes_is_a_name_never_a_host_path(tmp_path):
    """Attack: a Secret volume naming `../../../etc/shadow` (and an absolute path), hoping the launcher reads a host
    file as the Secret. Names are looked up among the manifests' objects, never joined to a path."""
    layout = tmp_path / "layout"
    assert run_diskkit("build", make_qcow2(tmp_path / "g.qcow2", size="16M"), "-t", f"oci:{layout}:v1").code == 0
    manifests = tmp_path / "k8s"
    manifests.mkdir()
    (manifests / "secret.json").write_text(json.dumps({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "shadow"}, "data": {}}))
    for name in ("../../../etc/shadow", "/etc/shadow"):
        vmi = tmp_path / "vmi.json"
        vmi.write_text(json.dumps({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "vm"},
            "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}},
                                "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}, {"name": "sec", "disk": {"bus": "virtio"}}]}},
                     "volumes": [{"name": "root", "containerDisk": {"image": f"oci:{layout}:v1"}},
                                 {"name": "sec", "secret": {"secretName": name}}]}}))
        result = run_launcher("domain", "--manifests", manifests, vmi, env={"DISKKIT_CACHE": str(tmp_path / "cache")})
        assert result.code == 1, result.out
        assert result.err.strip() == f'launcher: spec.volumes[1].secret: secrets "{name}" not found in namespace default', result.err
        assert result.out == ""


# ------------------------------------------------------------------ another local user

NOBODY = 65534


def as_nobody(*cmd) -> subprocess.CompletedProcess:
    # through a shell: setpriv alone was seen to exec a path in another user's 0700 directory
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
                           "/bin/sh", "-c", '"$@"', "sh", *map(str, cmd)], capture_output=True, text=True)


@pytest.fixture
def scratch():
    with qemu_scratch("trust-") as root:
        yield root


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_another_user_cannot_pull_into_or_collect_the_nodes_cache(scratch, tmp_path):
    """Attack: a local user pulls its own image into root's node cache (to be found there by digest or tag
    later), or runs gc on it to take disks running VMs use. The cache is root's: both are refused in one line
    and the cache is as it was."""
    layout = scratch / "layout"
    assert run_diskkit("build", make_qcow2(tmp_path / "g.qcow2", size="16M"), "-t", f"oci:{layout}:v1").code == 0
    layout.chmod(0o755)
    cache = scratch / "cache"
    assert run_launcher("pull", "--cache-dir", cache, f"oci:{layout}:v1").code == 0
    before = listing(cache)
    python = Path(sys.executable)
    for args in (["pull", "--cache-dir", cache, f"oci:{layout}:v1"], ["gc", "--cache-dir", cache]):
        result = as_nobody(python, "-m", "launcher", *args)
        assert result.returncode != 0, result.stdout
        # a root cache is root's alone (0700): the option's check refuses it before the launcher opens anything
        assert result.stderr.strip().splitlines()[-1] == f"Error: Invalid value for '--cache-dir': Directory '{cache}' is not readable.", result.stderr
    assert listing(cache) == before


def test_another_user_cannot_ask_a_root_disk_server_for_an_export(scratch, registry):
    """Attack: a local user outside the control socket's group asks root's disk server to open an image (with the
    node's credentials) or to say what it serves. The socket refuses the connection: Permission denied."""
    cache = scratch / "cache"
    cache.mkdir()
    ref = f"{registry.host}/trust/refused:v1"
    code = ("import json, sys, pathlib; from launcher.diskserver.control import request; "
            "print(json.dumps(request(pathlib.Path(sys.argv[1]), json.loads(sys.argv[2]), 10)))")
    with disk_server(cache):
        for req in ({"op": "status"}, {"op": "open", "image": ref, "registry": {"tls_verify": False}, "clients": 0}):
            result = as_nobody(sys.executable, "-c", code, cache / "serve" / "control.sock", json.dumps(req))
            assert result.returncode != 0 and "PermissionError" in result.stderr and result.stdout == "", (result.stdout, result.stderr)
        assert control(cache, {"op": "status"}).get("ok")  # the server itself answers its own users


def _server_refusal(tmp_path: Path, registry, case: str) -> tuple[Path, list[dict], str, str]:
    if case == "backing-file":
        disk = tmp_path / "backed.qcow2"
        run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "/etc/passwd", "-F", "raw", disk)
        data, rule = disk.read_bytes(), "expected no backing file, but found /etc/passwd"
    else:
        data, rule = _qcow2_with_data_file(tmp_path), "expected no external data file"
    ref = f"{registry.host}/trust/server-{case}:v1"
    # uncompressed, so the server reads the disk at offsets itself instead of sending the caller to pull
    layout = write_layout(tmp_path / "l", [[dir_("disk"), Member("disk/d.qcow2", data)]], gzipped=False)
    pushed = run_diskkit("push", NOREG, f"oci:{layout}:t", ref)
    assert pushed.code == 0, pushed.err
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        answers = [control(cache, {"op": "open", "image": ref, "registry": {"tls_verify": False}}) for _ in range(2)]
    return cache, answers, ref, rule


@pytest.mark.parametrize("case", ["backing-file", "data-file"])
def test_the_disk_server_refuses_a_qcow2_that_reaches_outside_as_pull_does(tmp_path, registry, case):
    """Attack: an image whose qcow2 names a backing file (/etc/passwd) or an external data file, opened through the
    node's disk server rather than `launcher pull`, hoping that path skips the header check; opened again, hoping
    the first try left an export behind that is served without it."""
    cache, answers, ref, rule = _server_refusal(tmp_path, registry, case)
    for answer in answers:
        assert not answer["ok"], answer
        assert answer["error"].startswith(f"docker://{ref}: /disk/d.qcow2: {rule}"), answer
        assert "\n" not in answer["error"]
    assert [p for p in (cache / "disks").rglob("*") if p.is_file()] == []


def test_the_disk_server_leaves_nothing_of_a_refused_qcow2(tmp_path, registry):
    """Attack: as above; a refusal must leave nothing half-written in the cache."""
    cache, answers, _, _ = _server_refusal(tmp_path, registry, "backing-file")
    assert not any(answer["ok"] for answer in answers)
    assert [p for p in (cache / "lazy").rglob("*") if p.is_file()] == []
