"""The node's disk server as an attacker sees it: a lying registry naming another image's layer
digest, another local user in the control socket's group without credentials (or without the TLS
client key) for a private image, a trickling registry, and the socket group. Real registries, a lying one only as a proxy in
front of a real one (tests/faultproxy.py), the server as root and its clients as other uids."""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests

from diskkit.errors import DiskkitError
from launcher.diskserver.exportid import ExportId
from launcher.diskserver.qemuid import KUBEVIRT_QEMU_ID, launcher_group
from tests.conftest import launcher_command, run, run_diskkit, run_launcher
from tests.distribution import make_client_ca, start_registry
from tests.faultproxy import Fault
from tests.imagecraft import Member, add_layer, dir_
from tests.lazyhost import control, disk_server, export_status, open_export, random_disk, wait_for
from tests.vmhost import qemu_scratch

NOREG = "--tls-verify=false"
MIB = 1 << 20
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
NOBODY = pwd.getpwnam("nobody")
KINDS = {"v2": ["--lazy"], "v1": ["--lazy", "--compression", "none"], "plain": ["--compression", "none"]}


# --- a liar naming the genuine image's layer digest -------------------------------------------------

def _manifest(registry, repository: str, reference: str) -> tuple[dict, str]:
    response = requests.get(registry.url(f"/v2/{repository}/manifests/{reference}"), headers={"Accept": OCI_MANIFEST}, timeout=60)
    response.raise_for_status()
    return response.json(), response.headers["Docker-Content-Digest"]


def _push_blob(registry, repository: str, data: bytes) -> dict:
    import hashlib

    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    start = requests.post(registry.url(f"/v2/{repository}/blobs/uploads/"), timeout=60)
    assert start.status_code == 202, start.text
    location = requests.compat.urljoin(registry.url("/"), start.headers["Location"])
    done = requests.put(location, params={"digest": digest}, data=data, headers={"Content-Type": "application/octet-stream"}, timeout=60)
    assert done.status_code == 201, done.text
    return {"digest": digest, "size": len(data)}


def genuine_and_liar(registry, fault_proxy, scratch: Path, kind: str) -> dict:
    """The genuine image (pinned by digest) and a liar that names its layer digest in a manifest of
    its own, with its own size, lazy TOC annotations and config: the liar's registry (a proxy in front
    of the real one) answers that digest with the bytes of the liar's own layer."""
    (scratch / "genuine").mkdir()
    (scratch / "liar").mkdir()
    # The same member path (/disk/disk.img): only the bytes differ.
    genuine_disk = random_disk(scratch / "genuine" / "disk.img", 4 * MIB, seed=41)
    liar_disk = random_disk(scratch / "liar" / "disk.img", 4 * MIB, seed=42)
    genuine_repo, liar_repo = f"trust/genuine-{kind}", f"trust/liar-{kind}"
    for disk, repo in ((genuine_disk, genuine_repo), (liar_disk, liar_repo)):
        built = run_diskkit("build", NOREG, *KINDS[kind], disk, "-t", f"{registry.host}/{repo}:own")
        assert built.code == 0, built.err
    genuine, genuine_digest = _manifest(registry, genuine_repo, "own")
    liar, _ = _manifest(registry, liar_repo, "own")
    true_layer, liar_layer = genuine["layers"][0]["digest"], liar["layers"][0]["digest"]
    # The genuine blob is in the liar's repository too (a mount), so the real registry takes the manifest.
    mount = requests.post(registry.url(f"/v2/{liar_repo}/blobs/uploads/"), params={"mount": true_layer, "from": genuine_repo}, timeout=60)
    assert mount.status_code == 201, mount.text
    liar["layers"][0]["digest"] = true_layer
    if kind != "v2":  # an uncompressed layer is its own diffID: the liar's config says so of the digest it names
        config = requests.get(registry.url(f"/v2/{liar_repo}/blobs/{liar['config']['digest']}"), timeout=60).json()
        config["rootfs"]["diff_ids"] = [true_layer]
        liar["config"].update(_push_blob(registry, liar_repo, json.dumps(config).encode()))
    put = requests.put(registry.url(f"/v2/{liar_repo}/manifests/lie"), data=json.dumps(liar).encode(),
                       headers={"Content-Type": OCI_MANIFEST}, timeout=60)
    assert put.status_code == 201, put.text
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", rf"^/v2/{liar_repo}/blobs/{true_layer}$", "rewrite", times=10**6, to=f"/v2/{liar_repo}/blobs/{liar_layer}"))
    return {"genuine": f"{registry.host}/{genuine_repo}@{genuine_digest}", "liar": f"{proxy.host}/{liar_repo}:lie",
            "layer": true_layer, "genuine_disk": genuine_disk.read_bytes(), "liar_disk": liar_disk.read_bytes(), "proxy": proxy}


def nbd_head(url: str, out: Path, length: int = MIB) -> bytes:
    """The export's first `length` bytes, as a real NBD client reads them."""
    run("qemu-img", "dd", "-f", "raw", "-O", "raw", f"if={url}", f"of={out}", f"bs={length}", "count=1")
    return out.read_bytes()


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_image_naming_another_images_layer_digest_never_answers_for_it(tmp_path, registry, fault_proxy, kind):
    """Attack: export poisoning. A registry names the genuine image's layer digest in its own manifest
    (its own TOC, or none) and trickles, so its blob never completes and the lie never shows; the
    genuine image, pinned by digest and opened afterwards, must read back its own bytes, never the
    export the liar's open made. Before: both were one export, keyed by (layer digest, member)."""
    images = genuine_and_liar(registry, fault_proxy, tmp_path, kind)
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "1K"):  # nothing prefetched: the liar's blob never completes
        lie = open_export(cache, images["liar"])
        assert (lie["layer"], lie["member"]) == (images["layer"], "disk/disk.img")
        assert nbd_head(lie["url"], tmp_path / "lie.img") == images["liar_disk"][:MIB]  # its chunks passed its own TOC
        true = open_export(cache, images["genuine"])
        assert true["layer"] == images["layer"] and true["export"] != lie["export"]
        assert nbd_head(true["url"], tmp_path / "true.img") == images["genuine_disk"][:MIB]
        # Nor does the liar's export answer to the genuine image's name on any socket.
        assert nbd_head(lie["url"], tmp_path / "lie-again.img") == images["liar_disk"][:MIB]
        assert not export_status(cache, lie["export"])["verified"]


def test_a_user_in_the_socket_group_cannot_poison_an_export_through_the_control_protocol(shared, registry, fault_proxy):
    """Attack: export poisoning through the control protocol. Another local user in the socket group
    runs the lying registry and asks the root server to open its image first; root's VM of the genuine
    image must still read the genuine bytes."""
    images = genuine_and_liar(registry, fault_proxy, shared, "v2")
    cache = shared / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "1K"):
        lie = _as_other_user(cache, {"op": "open", "image": images["liar"], "registry": {"tls_verify": False}, "clients": 0})
        assert lie["ok"] and lie["layer"] == images["layer"], lie
        true = open_export(cache, images["genuine"])
        assert true["export"] != lie["export"]
        assert nbd_head(true["url"], shared / "true.img") == images["genuine_disk"][:MIB]


@pytest.mark.parametrize("kind", ["v2", "v1"])
def test_a_liar_that_completes_first_does_not_deny_the_genuine_image(tmp_path, registry, fault_proxy, kind):
    """Attack: a liar naming the genuine layer digest completes fast, so its export fails its blob
    digest; the genuine image opened afterwards must still be served, and join the cache. Before: it
    was answered with the failed export (an I/O error) until the server restarted."""
    images = genuine_and_liar(registry, fault_proxy, tmp_path, kind)
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        lie = open_export(cache, images["liar"])
        failed = wait_for(lambda: (s := export_status(cache, lie["export"]))["failed"] and s, 120, "the liar's blob digest to fail")
        assert "does not match its content" in failed["failed"]
        true = open_export(cache, images["genuine"])
        run("nbdcopy", true["url"], tmp_path / "true.img")
        assert (tmp_path / "true.img").read_bytes() == images["genuine_disk"]
        status = wait_for(lambda: (s := export_status(cache, true["export"]))["installed"] and s, 120, "the genuine disk to be installed")
        assert Path(status["installed"]).read_bytes() == images["genuine_disk"]


def test_a_liars_small_layer_under_the_genuine_digest_does_not_deny_the_genuine_image(tmp_path, registry, fault_proxy):
    """Attack: small layers read whole are remembered for the next lookup. A registry answered the
    genuine image's small upper layer digest with other bytes; they were remembered before their digest
    was checked, and the genuine image, opened next, was refused ("does not match its digest")."""
    layout = tmp_path / "layout"
    assert run_diskkit("build", "--lazy", random_disk(tmp_path / "d.img", 2 * MIB, seed=48), "-t", f"oci:{layout}:base").code == 0
    add_layer(layout, "base", "two", [dir_("etc"), Member("etc/motd", b"hello\n")])
    genuine, liar = f"{registry.host}/trust/small:two", f"{registry.host}/trust/small-liar:two"
    for ref in (genuine, liar):
        pushed = run_diskkit("push", NOREG, f"oci:{layout}:two", ref)
        assert pushed.code == 0, pushed.err
    upper = json.loads(run_diskkit("inspect", NOREG, "--json", genuine).out)["layers"][-1]
    other = _push_blob(registry, "trust/small-liar", os.urandom(upper["size"] + 100))
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", rf"^/v2/trust/small-liar/blobs/{upper['digest']}$", "rewrite", times=10**6, to=f"/v2/trust/small-liar/blobs/{other['digest']}"))
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "1K"):
        lie = control(cache, {"op": "open", "image": liar.replace(registry.host, proxy.host), "registry": {"tls_verify": False}})
        assert not lie["ok"] and "does not match its digest" in lie["error"], lie
        true = open_export(cache, genuine)
        assert true["ok"]


def test_an_export_directory_recording_another_identity_is_never_served(tmp_path, registry):
    """A lazy/<name> directory whose source.json describes another export (written by an older server
    keyed by less, or for other bytes) is never reopened under that name nor reused."""
    disk = random_disk(tmp_path / "d.img", 2 * MIB, seed=43)
    ref = f"{registry.host}/trust/reuse:v2"
    assert run_diskkit("build", NOREG, "--lazy", disk, "-t", ref).code == 0
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "1K"):
        answer = open_export(cache, ref)
    source = cache / "lazy" / answer["export"] / "source.json"
    recorded = json.loads(source.read_text())
    assert ExportId.from_json(recorded["identity"]).name == answer["export"]
    recorded["layout"]["chunks"], recorded["layout"]["member_digests"] = ["0" * 64] * 2, None  # other pins, same name
    source.write_text(json.dumps(recorded))
    with disk_server(cache):
        probe = subprocess.run(["qemu-img", "info", answer["url"]], capture_output=True, text=True)
        assert probe.returncode != 0
        again = open_export(cache, ref)  # the image itself is opened afresh, its directory made again
        assert again["export"] == answer["export"]
        assert nbd_head(again["url"], tmp_path / "again.img") == disk.read_bytes()[:MIB]
        assert json.loads(source.read_text())["identity"] == ExportId.from_json(recorded["identity"]).to_json()


# --- credentials: the node's serve only the node's own user -----------------------------------------

def _as_other_user(cache: Path, request: dict, env: dict | None = None, groups: str | None = None) -> dict:
    """`request` sent by uid nobody, in the control socket's group (and 107, the old one), as a launcher
    of another user sends it: with `ask` (true, or the client's registry options), the client's own
    request built by launcher.diskserver.client."""
    code = ("import json, sys; from pathlib import Path; from launcher.diskserver.control import request\n"
            "req = json.loads(sys.argv[2])\n"
            "ask = req.pop('ask', None)\n"
            "if ask:\n"
            "    from diskkit.registry.options import RegistryOptions\n"
            "    from launcher.diskserver.client import registry_request\n"
            "    req.update(registry_request(req['image'], RegistryOptions(**(ask if isinstance(ask, dict) else {'tls_verify': False}))))\n"
            "print(json.dumps(request(Path(sys.argv[1]), req)))")
    extra = groups or f"{launcher_group(None)},{KUBEVIRT_QEMU_ID}"
    proc = subprocess.run(["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", f"--groups={extra}",
                           sys.executable, "-c", code, cache / "serve" / "control.sock", json.dumps(request)],
                          capture_output=True, text=True, env={"PATH": os.environ["PATH"], "HOME": "/nonexistent", **(env or {})},
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _nobody_reads_head(shared: Path, url: str) -> bytes:
    """The export's first MiB, as the other user reads it over NBD into a directory of its own."""
    mine = shared / "nobody"
    mine.mkdir()
    os.chown(mine, NOBODY.pw_uid, NOBODY.pw_gid)
    got = subprocess.run(["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups",
                          "qemu-img", "dd", "-f", "raw", "-O", "raw", f"if={url}", f"of={mine / 'head.img'}", f"bs={MIB}", "count=1"],
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    return (mine / "head.img").read_bytes()


@pytest.fixture
def shared():
    """A directory other users can traverse (pytest's are root's alone): caches their clients reach."""
    with qemu_scratch("trust-") as root:
        yield root


@pytest.fixture
def private_image(tmp_path, auth_registry) -> tuple[str, bytes, Path]:
    """A lazy image in a registry that wants credentials; the node's auth file for it."""
    disk = random_disk(tmp_path / "private.img", 2 * MIB, seed=44)
    ref = f"{auth_registry.host}/trust/private:v2"
    built = run_diskkit("build", NOREG, "--creds", f"{auth_registry.username}:{auth_registry.password}", "--lazy", disk, "-t", ref)
    assert built.code == 0, built.err
    node_auth = auth_registry.auth_file(tmp_path / "node" / "auth.json")
    node_auth.parent.chmod(0o700)
    return ref, disk.read_bytes(), node_auth


def test_another_user_without_credentials_is_refused_a_private_image(shared, auth_registry, private_image):
    """Attack: credentials crossing users. A local user in the control socket's group, with no
    credentials for a private image, asked a root server for it; the server fetched it with the node's
    auth file and answered with an export. Now it is fetched for with the client's own credentials
    (none: anonymously), refused in one line with the registry's 401, even while an export of the same
    image runs for root; root still uses the server's file."""
    ref, data, node_auth = private_image
    cache = shared / "cache"
    cache.mkdir()
    with disk_server(cache, f"--authfile={node_auth}", "--prefetch-rate", "1K"):
        mine = control(cache, {"op": "open", "image": ref})  # root: the node's file
        assert mine["ok"], mine
        for request in ({"op": "open", "image": ref, "registry": {"tls_verify": False}},
                        {"op": "open", "image": ref, "registry": {"tls_verify": False}, "ask": True},
                        {"op": "open", "image": ref},  # no options at all: still not the server's
                        {"op": "files", "image": ref, "paths": ["/boot/vmlinuz"], "registry": {"tls_verify": False}}):
            answer = _as_other_user(cache, request)
            assert not answer["ok"], answer
            error = answer["error"]
            assert "\n" not in error and "HTTP 401" in error and "anonymous" in error and auth_registry.host in error, error
        again = control(cache, {"op": "open", "image": ref, "registry": {"tls_verify": False}})  # root's options, the node's file
        assert again["ok"] and again["export"] == mine["export"], again


def test_another_user_with_its_own_credentials_gets_the_export(shared, auth_registry, private_image):
    """The same user with credentials of its own (its auth file, looked up by the client as a pull
    would and sent inline, never as a path) is served, on its own NBD socket."""
    ref, data, node_auth = private_image
    cache = shared / "cache"
    cache.mkdir()
    own = shared / "nobody-auth.json"
    auth_registry.auth_file(own)
    own.chmod(0o644)  # readable by nobody; the server never reads it
    with disk_server(cache):  # no auth file of its own at all
        answer = _as_other_user(cache, {"op": "open", "image": ref, "registry": {"tls_verify": False}, "ask": True, "clients": 0},
                                env={"REGISTRY_AUTH_FILE": str(own)})
        assert answer["ok"], answer
        assert answer["socket"].endswith(f"nbd-{NOBODY.pw_uid}.sock")
        assert _nobody_reads_head(shared, answer["url"]) == data[:MIB]


def test_a_user_reads_no_export_it_was_not_answered_with(tmp_path, shared, registry, auth_registry, private_image):
    """Attack: export names are hashes of what any manifest tells. A user with a socket of its own
    (from an open of a public image) asked it for the private export root opened; it was served. Its
    status listed every export of the node's other users too."""
    ref, data, node_auth = private_image
    public = f"{registry.host}/trust/public:v2"
    assert run_diskkit("build", NOREG, "--lazy", random_disk(tmp_path / "public.img", MIB, seed=45), "-t", public).code == 0
    cache = shared / "cache"
    cache.mkdir()
    with disk_server(cache, f"--authfile={node_auth}", "--prefetch-rate", "1K"):
        private = control(cache, {"op": "open", "image": ref, "clients": 0})
        assert private["ok"], private
        mine = _as_other_user(cache, {"op": "open", "image": public, "registry": {"tls_verify": False}, "clients": 0})
        assert mine["ok"], mine
        url = f"nbd+unix:///{private['export']}?socket={mine['socket']}"
        probe = subprocess.run(["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups", "qemu-img", "info", url],
                               capture_output=True, text=True)
        assert probe.returncode != 0, probe.stdout
        own = subprocess.run(["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups", "qemu-img", "info", mine["url"]],
                             capture_output=True, text=True)
        assert own.returncode == 0, own.stderr
        # Nor is it told what root's VMs read: its status lists its own export alone.
        listed = _as_other_user(cache, {"op": "status"})["exports"]
        assert [e["export"] for e in listed] == [mine["export"]], listed
        assert {e["export"] for e in control(cache, {"op": "status"})["exports"]} == {mine["export"], private["export"]}


@pytest.fixture(scope="module")
def mtls_registry(tmp_path_factory):
    """A registry that takes only clients with a certificate its client CA signed (`http.tls.clientcas`)."""
    reg = start_registry(tmp_path_factory.mktemp("mtls"), tls=True, client_certs=True)
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture
def mtls_image(tmp_path, mtls_registry) -> tuple[str, bytes, Path]:
    """A lazy image only a client certificate opens; the node's certs.d-style directory (its CA and
    its client certificate and key, root's alone)."""
    node = mtls_registry.client_ca.issue(tmp_path / "node-certs", "node", mtls_registry.ca_dir / "ca.crt")
    disk = random_disk(tmp_path / "mtls.img", 2 * MIB, seed=49)
    ref = f"{mtls_registry.host}/trust/mtls:v2"
    built = run_diskkit("build", "--cert-dir", node, "--lazy", disk, "-t", ref)
    assert built.code == 0, built.err
    return ref, disk.read_bytes(), node


@pytest.mark.parametrize("held", ["exported", "pulled"])
def test_a_user_without_the_client_key_gets_no_byte_of_an_mtls_image(shared, mtls_registry, mtls_image, held):
    """Attack: the node's TLS identity lent to another user. The server's --cert-dir holds the CA and the
    node's client certificate and key; a user in the socket group, refused by the mTLS registry on its
    own, asked root's server for the image (already on the node: exported for root's VM, or pulled into
    the cache) and read it over NBD. Now its request presents its own identity or none: refused in one
    line, exit 6, no socket, nothing listed; root still reads it. Trust (ca.crt) and identity
    (NAME.cert/NAME.key) as containers/image's pkg/tlsclientconfig/tlsclientconfig.go reads them; the
    re-check of an image already held as keps/sig-node/2535-ensure-secret-pulled-images does it."""
    ref, data, node = mtls_image
    cache = shared / "cache"
    cache.mkdir()
    if held == "pulled":
        pulled = run_launcher("pull", "--cert-dir", node, "--cache-dir", cache, ref)
        assert pulled.code == 0, pulled.err
    with disk_server(cache, "--tls-verify=true", f"--cert-dir={node}", "--prefetch-rate", "1K"):
        mine = control(cache, {"op": "open", "image": ref, "clients": 0})
        assert mine["ok"], mine
        assert nbd_head(mine["url"], shared / "root.img") == data[:MIB]
        for request in ({"op": "open", "image": ref, "registry": {"tls_verify": True}},
                        {"op": "open", "image": ref, "ask": {"tls_verify": True}},
                        {"op": "open", "image": ref},  # the server's own options: still not its identity
                        {"op": "open", "image": ref, "registry": {"tls_verify": True, "cert_dir": str(node)}},  # naming root's directory
                        {"op": "open", "image": f"{ref.rsplit(':', 1)[0]}@{mine['digest']}", "registry": {"tls_verify": False}},
                        {"op": "files", "image": ref, "paths": ["/boot/vmlinuz"], "registry": {"tls_verify": True}}):
            answer = _as_other_user(cache, request)
            assert not answer["ok"], (request, answer)
            error = answer["error"]
            assert "\n" not in error and mtls_registry.host in error and "client certificate" in error, error
            assert answer["exit"] == 6, answer
        assert not (cache / "serve" / f"nbd-{NOBODY.pw_uid}.sock").exists()
        assert _as_other_user(cache, {"op": "status"})["exports"] == []
        assert control(cache, {"op": "open", "image": ref, "clients": 0})["export"] == mine["export"]


def test_a_user_with_its_own_client_certificate_gets_the_mtls_image(shared, mtls_registry, mtls_image):
    """The same user presenting a certificate of its own (read by its client from its own --cert-dir and
    sent inline) is served on its own NBD socket; one the registry's CA did not sign is refused."""
    ref, data, node = mtls_image
    ca = mtls_registry.ca_dir / "ca.crt"
    theirs = mtls_registry.client_ca.issue(shared / "nobody-certs", "nobody", ca)
    stranger = make_client_ca(shared / "other-ca.crt").issue(shared / "stranger-certs", "stranger", ca)
    for directory in (theirs, stranger):
        for path in (directory, *directory.iterdir()):
            os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    cache = shared / "cache"
    cache.mkdir()
    with disk_server(cache, "--tls-verify=true", f"--cert-dir={node}"):
        refused = _as_other_user(cache, {"op": "open", "image": ref, "ask": {"tls_verify": True, "cert_dir": str(stranger)}, "clients": 0})
        assert not refused["ok"] and "refused the TLS client certificate" in refused["error"], refused
        answer = _as_other_user(cache, {"op": "open", "image": ref, "ask": {"tls_verify": True, "cert_dir": str(theirs)}, "clients": 0})
        assert answer["ok"], answer
        assert answer["socket"].endswith(f"nbd-{NOBODY.pw_uid}.sock")
        assert _nobody_reads_head(shared, answer["url"]) == data[:MIB]


def test_trust_and_identity_are_read_apart(tmp_path):
    """What a client of another user is served with (pure): its own credentials and identity or none,
    the node's CAs and policy; a privileged client keeps the files it names."""
    from diskkit.registry.authfile import Credentials
    from diskkit.registry.options import RegistryOptions
    from diskkit.registry.tlsfiles import Identity
    from launcher.diskserver.clientoptions import for_client

    own = RegistryOptions(cert_dir="/node/certs", authfile="/node/auth.json", signature_policy="/node/policy.json")
    sent = (("reg.example", Credentials("u", "p")),)
    identity = (("reg.example", Identity(b"cert", b"key", "the client's")),)
    other = for_client({"tls_verify": True, "cert_dir": "/elsewhere", "authfile": "/root/auth.json", "signature_policy": "/any"}, (), (), own, False)
    assert (other.inline_credentials, other.inline_identities) == ((), ())  # never the node's files
    assert (other.cert_dir, other.authfile, other.signature_policy) == ("/node/certs", None, "/node/policy.json")
    assert for_client(None, sent, identity, own, False).inline_identities == identity
    privileged = for_client({"cert_dir": "/root/certs"}, (), (), own, True)
    assert (privileged.cert_dir, privileged.authfile, privileged.inline_identities) == ("/root/certs", "/node/auth.json", None)
    for smuggled in ({"inline_identities": []}, {"inline_credentials": []}, {"no_such_option": 1}):
        with pytest.raises(DiskkitError, match="not ones a request may set"):
            for_client(smuggled, (), (), own, False)


def test_only_root_names_the_user_its_qemu_runs_as(tmp_path, shared, registry):
    """A root launcher on the qemu user's session daemon (launcher.runtime.sessiond) is answered with
    that user's NBD socket (`qemu_uid`); another user naming a uid not its own gets its own socket."""
    public = f"{registry.host}/trust/for-qemu:v2"
    assert run_diskkit("build", NOREG, "--lazy", random_disk(tmp_path / "public.img", MIB, seed=46), "-t", public).code == 0
    cache = shared / "cache"
    cache.mkdir()
    with disk_server(cache):
        for_qemu = control(cache, {"op": "open", "image": public, "clients": 0, "qemu_uid": KUBEVIRT_QEMU_ID})
        assert for_qemu["ok"] and for_qemu["socket"].endswith(f"nbd-{KUBEVIRT_QEMU_ID}.sock"), for_qemu
        assert Path(for_qemu["socket"]).lstat().st_uid == KUBEVIRT_QEMU_ID
        assert control(cache, {"op": "open", "image": public, "clients": 0})["socket"].endswith("/nbd.sock")
        claimed = _as_other_user(cache, {"op": "open", "image": public, "registry": {"tls_verify": False}, "clients": 0,
                                         "qemu_uid": KUBEVIRT_QEMU_ID})
        assert claimed["ok"] and claimed["socket"].endswith(f"nbd-{NOBODY.pw_uid}.sock"), claimed


# --- per-image locks --------------------------------------------------------------------------------

def test_a_trickling_registry_holds_up_no_other_images_open(tmp_path, registry, fault_proxy):
    """Attack: one registry trickles its manifest; every other VM's open on the node waited behind
    it (a server-wide lock held while manifests, headers and TOCs were fetched). Now an open of an
    image on another registry is answered while the first is still stuck."""
    slow_ref, fast_ref = f"{registry.host}/trust/slow:v2", f"{registry.host}/trust/fast:v2"
    for ref, seed in ((slow_ref, 46), (fast_ref, 47)):
        assert run_diskkit("build", NOREG, "--lazy", random_disk(tmp_path / f"{seed}.img", MIB, seed=seed), "-t", ref).code == 0
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", r"/manifests/", "stall", times=1, arg=90))
    cache = tmp_path / "cache"
    cache.mkdir()
    answered: list[str] = []
    with disk_server(cache):
        def slow():
            control(cache, {"op": "open", "image": slow_ref.replace(registry.host, proxy.host), "registry": {"tls_verify": False, "retries": 0}}, timeout=300)
            answered.append("slow")

        stuck = threading.Thread(target=slow)
        stuck.start()
        try:
            wait_for(lambda: not proxy.pending, 60, "the slow registry to hold the manifest")
            fast = open_export(cache, fast_ref)
            answered.append("fast")
            assert answered == ["fast"] and stuck.is_alive()
            assert fast["ok"]
        finally:
            proxy.close()  # the stalled request is reset: the slow open ends
            stuck.join(timeout=120)
        assert answered == ["fast", "slow"]


# --- the control socket's group -----------------------------------------------------------------------

def test_the_control_socket_is_never_open_to_whatever_group_107_is(shared):
    """Attack: the control socket's group was numeric 107 whatever that is on the host (sgx, docker):
    its members could ask a root server for anything. Now it is the qemu user's group (KubeVirt's);
    107 only where that is the group named qemu or kvm."""
    cache = shared / "cache"
    cache.mkdir()
    gid_107 = grp.getgrgid(KUBEVIRT_QEMU_ID)
    qemu_group = pwd.getpwnam("qemu").pw_gid
    with disk_server(cache):
        sock = os.stat(cache / "serve" / "control.sock")
        assert (sock.st_gid, stat.S_IMODE(sock.st_mode)) == (qemu_group, 0o660)
        code = "import sys, socket; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])"
        member = subprocess.run(["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={KUBEVIRT_QEMU_ID}", "--clear-groups",
                                 sys.executable, "-c", code, cache / "serve" / "control.sock"], capture_output=True, text=True)
        if gid_107.gr_gid == qemu_group:
            assert member.returncode == 0, member.stderr  # 107 is the qemu user's group here
        else:
            assert member.returncode != 0 and "Permission denied" in member.stderr, (gid_107.gr_name, member.stderr)


def test_socket_group_names_a_group_or_the_server_refuses_to_start(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    nogroup = grp.getgrgid(NOBODY.pw_gid)
    with disk_server(cache, "--socket-group", nogroup.gr_name):
        assert os.stat(cache / "serve" / "control.sock").st_gid == nogroup.gr_gid
    refused = subprocess.run(launcher_command("serve", "--cache-dir", tmp_path / "other", "--socket-group", "no-such-group-here"),
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].endswith("--socket-group no-such-group-here: names no group on this host"), refused.stderr
    assert not (tmp_path / "other" / "serve" / "control.sock").exists()


def test_launcher_group_rules():
    """The default as libvirt's and KubeVirt's names give it, from the host's databases (pure)."""
    class Entry:
        def __init__(self, name, gid):
            self.gr_name, self.gr_gid, self.pw_gid = name, gid, gid

    def groups(table):
        def by_name(name):
            for gid, entry_name in table.items():
                if entry_name == name:
                    return Entry(name, gid)
            raise KeyError(name)
        return by_name, lambda gid: Entry(table[gid], gid) if gid in table else (_ for _ in ()).throw(KeyError(gid))

    def no_user(name):
        raise KeyError(name)

    sgx_host = {107: "sgx", 995: "qemu"}
    by_name, by_gid = groups(sgx_host)
    assert launcher_group(None, lambda name: Entry("qemu", 995), by_name, by_gid) == 995  # the qemu user's group
    assert launcher_group(None, no_user, by_name, by_gid) is None  # never sgx
    by_name, by_gid = groups({107: "kvm"})
    assert launcher_group(None, no_user, by_name, by_gid) == 107
    assert launcher_group("kvm", no_user, by_name, by_gid) == 107
    assert launcher_group("107", no_user, by_name, by_gid) == 107
    with pytest.raises(DiskkitError, match="names no group on this host"):
        launcher_group("108", no_user, by_name, by_gid)
    with pytest.raises(DiskkitError, match="names no group on this host"):
        launcher_group("sgx", no_user, by_name, by_gid)


def test_an_export_identity_holds_everything_that_pins_its_bytes():
    """What differs between two opens of one layer digest makes two exports (pure)."""
    from dataclasses import replace

    from launcher.diskserver.layout import Layout

    pinned = Layout("reg.example", "a/b", "sha256:" + "1" * 64, 10 << 20, "disk/disk.img", 1536, 4 << 20, 1 << 20,
                    tuple("a" * 64 for _ in range(4)), toc="sha256:" + "2" * 64, around="sha256:" + "3" * 64)
    assert replace(pinned).name == pinned.name and len(pinned.name) == 64
    assert pinned.identity.source is None  # pinned chunks: the same bytes from any registry
    assert replace(pinned, registry="other.example", repository="c/d").name == pinned.name
    for change in ({"chunks": tuple("b" * 64 for _ in range(4))}, {"toc": "sha256:" + "4" * 64}, {"around": "sha256:" + "5" * 64},
                   {"layer_size": 11 << 20}, {"member": "disk/other.img"}, {"offset": 2048}, {"chunk_size": 2 << 20},
                   {"diff_id": "sha256:" + "6" * 64}):
        assert replace(pinned, **change).name != pinned.name, change
    plain = replace(pinned, chunks=None, toc=None)
    assert plain.identity.source == ("reg.example", "a/b")  # nothing checks its chunks: tied to where they come from
    assert replace(plain, repository="c/d").name != plain.name and replace(plain, registry="other.example").name != plain.name
    assert ExportId.from_json(pinned.identity.to_json()) == pinned.identity
    with pytest.raises(ValueError):
        ExportId.from_json({**pinned.identity.to_json(), "extra": 1})


def test_an_exports_kept_piece_is_read_only_from_the_file_it_wrote(tmp_path):
    """KnownRanges reads a TOC out of an export's kept tail: a link planted in its place (to a file
    of the same size) is not followed, the range is fetched instead; the real file is read."""
    from launcher.diskserver.blobranges import KnownRanges

    class Fetched:
        size = 100

        def __init__(self):
            self.asked = []

        def read(self, start, length):
            self.asked.append((start, length))
            return b"R" * length

    secret = tmp_path / "secret"
    secret.write_bytes(b"S" * 40)
    tail = tmp_path / "tail"
    tail.symlink_to(secret)
    fetched = Fetched()
    assert KnownRanges(fetched, {(60, 40): tail}).read(70, 10) == b"R" * 10 and fetched.asked == [(70, 10)]
    tail.unlink()
    tail.write_bytes(bytes(range(40)))
    assert KnownRanges(fetched, {(60, 40): tail}).read(70, 10) == bytes(range(10, 20)) and fetched.asked == [(70, 10)]
