"""GPG simple signatures through a registry's signature API (X-Registry-Supports-Signatures).

No registry here offers the API: only OpenShift's integrated registry does, and none can run here.
So this emulates OpenShift's API with a small extension in front of the real distribution registry
(tests/faultproxy.py): the /v2/ answer carries `X-Registry-Supports-Signatures: 1` and the
`/extensions/v2/<repo>/signatures/<digest>` GET and PUT are served from memory, in the shapes
containers/image's docker/docker_client.go speaks (extensionSignature, extensionSignatureList).
skopeo 1.9 (containers/image) reads and writes through the same emulation, which checks the shapes
from the other side. Which store wins is containers/image's (docker_image_src.go
GetSignaturesWithFormat, docker_image_dest.go PutSignaturesWithFormat): the API when the registry
advertises it, whatever lookaside registries.d names; the lookaside otherwise.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import threading

import pytest

from diskkit.errors import DiskkitError
from diskkit.signing import sigapi
from tests.conftest import run_diskkit, run_launcher
from tests.faultproxy import Fault, FaultProxy
from tests.test_gpg_signing import NOREG, build, disk, inspect, keys, one_line, policy, sig_dir, signed_by  # noqa: F401 (fixtures)

_ENDPOINT = re.compile(r"^/extensions/v2/(.+)/signatures/(sha256:[0-9a-f]{64})$")


class SignatureAPI:
    """The emulated extension: signatures per (repository, digest), PUTs checked for the shape
    OpenShift takes (schemaVersion 2, type atomic, name `<digest>@<32 hex>`)."""

    def __init__(self):
        self.store: dict[tuple[str, str], list[dict]] = {}
        self.lock = threading.Lock()

    def __call__(self, method: str, target: str, read_body):
        match = _ENDPOINT.match(target)
        if match is None:
            return None
        key = (match.group(1), match.group(2))
        with self.lock:
            if method == "GET":
                return 200, {"signatures": list(self.store.get(key, []))}
            if method == "PUT":
                sig = json.loads(read_body())
                if sig.get("schemaVersion") != 2 or sig.get("type") != "atomic" or not re.fullmatch(re.escape(key[1]) + r"@[0-9a-f]{32}", sig.get("name", "")):
                    return 400, {"errors": [{"code": "INVALID", "message": "bad signature"}]}
                base64.b64decode(sig["content"], validate=True)
                self.store.setdefault(key, []).append(sig)
                return 201, {}
        return 405, {"errors": []}

    def contents(self, repository: str, digest: str) -> list[bytes]:
        return [base64.b64decode(s["content"]) for s in self.store.get((repository, digest), [])]


@pytest.fixture
def api(registry):
    """(the emulated OpenShift registry, its store, a plain proxy to the same registry without the API)."""
    store = SignatureAPI()
    with FaultProxy(registry.host) as openshift, FaultProxy(registry.host) as plain:
        openshift.headers.append((r"^/v2/$", "X-Registry-Supports-Signatures", "1"))
        openshift.answer = store
        yield openshift, store, plain


def test_diskkit_signs_through_the_api_and_diskkit_launcher_and_skopeo_accept(api, keys, disk, tmp_path):
    openshift, store, _ = api
    ref = f"{openshift.host}/sigapi/mine:v1"
    digest = build(disk, ref, "--registries.d", keys["regd"], "--sign-by", keys["a"])
    # The API wins over the lookaside registries.d names (PutSignaturesWithFormat tries it first),
    # and the signature is there before the manifest is put.
    assert len(store.contents("sigapi/mine", digest)) == 1
    assert not sig_dir(keys, ref, digest).exists()
    puts = [i for i, (m, p, _) in enumerate(openshift.log) if m == "PUT"]
    sig_put = next(i for i in puts if openshift.log[i][1].startswith("/extensions/"))
    assert all(i > sig_put for i in puts if "/manifests/" in openshift.log[i][1]), openshift.log
    good = policy(tmp_path / "a.json", f"{openshift.host}/sigapi", signed_by(keys, "a"))
    bad = policy(tmp_path / "b.json", f"{openshift.host}/sigapi", signed_by(keys, "b"))
    assert inspect(keys, good, ref).code == 0
    line = one_line(inspect(keys, bad, ref))
    assert "Invalid GPG signature: No public key" in line, line
    # The launcher, with the policy and registries.d in its HOME.
    home = tmp_path / "home"
    (home / ".config/containers").mkdir(parents=True)
    shutil.copytree(keys["regd"], home / ".config/containers/registries.d")
    shutil.copy(good, home / ".config/containers/policy.json")
    pulled = run_launcher("pull", NOREG, "--cache-dir", tmp_path / "cache", ref, env={"HOME": str(home)})
    assert pulled.code == 0, pulled.err
    # skopeo (containers/image) reads the signature through the same API and accepts only key a.
    for pol, ok in ((good, True), (bad, False)):
        proc = subprocess.run(["skopeo", "--policy", str(pol), "--registries.d", str(keys["regd"]), "copy", "--src-tls-verify=false",
                               f"docker://{ref}", f"dir:{tmp_path}/{pol.stem}"], capture_output=True, text=True, check=False)
        assert (proc.returncode == 0) == ok, proc.stderr
    assert (tmp_path / "a/signature-1").read_bytes() == store.contents("sigapi/mine", digest)[0]


def test_unsigned_is_refused_and_the_lookaside_is_not_read_when_the_api_is_offered(api, keys, disk, tmp_path):
    openshift, store, plain = api
    ref = f"{openshift.host}/sigapi/unsigned:v1"
    digest = build(disk, ref)
    # A lookaside signature of the same repository is not what an API registry's image is checked on.
    signed_elsewhere = build(disk, f"{plain.host}/sigapi/unsigned:v1", "--registries.d", keys["regd"], "--sign-by", keys["a"])
    assert signed_elsewhere == digest and (sig_dir(keys, ref, digest) / "signature-1").exists()
    good = policy(tmp_path / "a.json", f"{openshift.host}/sigapi", signed_by(keys, "a"))
    line = one_line(inspect(keys, good, ref))
    assert "A signature was required, but no signature exists" in line, line
    assert any(m == "GET" and p == f"/extensions/v2/sigapi/unsigned/signatures/{digest}" for m, p, _ in openshift.log)
    home = tmp_path / "home"
    (home / ".config/containers").mkdir(parents=True)
    shutil.copytree(keys["regd"], home / ".config/containers/registries.d")
    shutil.copy(good, home / ".config/containers/policy.json")
    refused = run_launcher("pull", NOREG, "--cache-dir", tmp_path / "cache", ref, env={"HOME": str(home)})
    assert "A signature was required, but no signature exists" in one_line(refused)
    assert not (tmp_path / "cache").exists() or not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))
    # Another key's signature, stored through the API, is refused too.
    signed_b = run_diskkit("copy", NOREG, "--registries.d", keys["regd"], "--sign-by", keys["b"], f"docker://{ref}", f"docker://{ref}")
    assert signed_b.code == 0, signed_b.err
    assert len(store.contents("sigapi/unsigned", digest)) == 1
    line = one_line(inspect(keys, good, ref))
    assert "Invalid GPG signature: No public key" in line, line


def test_copies_carry_signatures_between_the_api_and_a_lookaside_and_a_plain_registry_is_never_asked(api, keys, disk, tmp_path):
    openshift, store, plain = api
    regd = ["--registries.d", keys["regd"]]
    src = f"{openshift.host}/sigapi/carried:v1"
    digest = build(disk, src, *regd, "--sign-by", keys["a"])
    signature = store.contents("sigapi/carried", digest)[0]
    # API -> lookaside: the plain registry's lookaside gets the API's signature.
    to_plain = f"{plain.host}/sigapi/onplain:v1"
    copied = run_diskkit("copy", NOREG, *regd, f"docker://{src}", f"docker://{to_plain}")
    assert copied.code == 0, copied.err
    assert (sig_dir(keys, to_plain, digest) / "signature-1").read_bytes() == signature
    assert inspect(keys, policy(tmp_path / "p.json", f"{plain.host}/sigapi", signed_by(keys, "a", signedIdentity={
        "type": "exactRepository", "dockerRepository": f"{openshift.host}/sigapi/carried"})), to_plain).code == 0
    # lookaside -> API, adding a new signature: the carried one and the new one, nothing twice.
    back = f"{openshift.host}/sigapi/back:v1"
    copied = run_diskkit("copy", NOREG, *regd, "--sign-by", keys["b"], f"docker://{to_plain}", f"docker://{back}")
    assert copied.code == 0, copied.err
    assert store.contents("sigapi/back", digest)[0] == signature and len(store.contents("sigapi/back", digest)) == 2
    again = run_diskkit("copy", NOREG, *regd, f"docker://{to_plain}", f"docker://{back}")
    assert again.code == 0 and len(store.contents("sigapi/back", digest)) == 2, again.err
    # The registry without the header is never asked the extension path.
    assert plain.log and not any(p.startswith("/extensions/") for _, p, _ in plain.log), plain.log


def test_skopeo_signs_through_the_api_and_diskkit_accepts(api, keys, disk, tmp_path):
    openshift, store, plain = api
    source = f"{plain.host}/sigapi/skplain:v1"
    build(disk, source)
    ref = f"{openshift.host}/sigapi/byskopeo:v1"
    anything = tmp_path / "any.json"
    anything.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
    proc = subprocess.run(["skopeo", "--policy", str(anything), "--registries.d", str(keys["regd"]), "copy", "--src-tls-verify=false",
                           "--dest-tls-verify=false", "--sign-by", keys["a"], f"docker://{source}", f"docker://{ref}"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert sum(len(v) for k, v in store.store.items() if k[0] == "sigapi/byskopeo") == 1
    assert inspect(keys, policy(tmp_path / "a.json", f"{openshift.host}/sigapi", signed_by(keys, "a")), ref).code == 0
    line = one_line(inspect(keys, policy(tmp_path / "b.json", f"{openshift.host}/sigapi", signed_by(keys, "b")), ref))
    assert "Invalid GPG signature: No public key" in line, line


def test_a_signature_the_api_refuses_leaves_no_tag(api, keys, disk, tmp_path):
    openshift, store, _ = api
    ref = f"{openshift.host}/sigapi/refused:v1"
    openshift.add(Fault("PUT", r"^/extensions/", "status", arg=400, times=100))
    r = run_diskkit("build", NOREG, "--no-lazy", disk, "-t", ref, "--registries.d", keys["regd"], "--sign-by", keys["a"])
    line = one_line(r)
    assert "uploading signature to /extensions/v2/sigapi/refused/signatures/sha256:" in line and "HTTP 400" in line, line
    assert not any(m == "PUT" and "/manifests/" in p for m, p, _ in openshift.log), openshift.log
    assert run_diskkit("inspect", NOREG, ref).code != 0  # no tag points at an unsigned image


def test_the_signature_list_is_read_as_containers_image_reads_it():
    listed = sigapi.parse_list(json.dumps({"signatures": [
        {"schemaVersion": 2, "name": "n1", "type": "atomic", "content": base64.b64encode(b"one").decode()},
        {"schemaVersion": 1, "name": "n2", "type": "atomic", "content": base64.b64encode(b"old").decode()},
        {"schemaVersion": 2, "name": "n3", "type": "other", "content": base64.b64encode(b"else").decode()},
    ]}).encode(), "here")
    assert sigapi.atomic_contents(listed) == [b"one"]
    assert sigapi.parse_list(b"{}", "here") == []
    for body in (b"[]", b'{"signatures": {}}', b'{"signatures": [{"content": "!!"}]}', b"garbage"):
        with pytest.raises(DiskkitError, match="decoding signature list"):
            sigapi.parse_list(body, "here")
    entry = sigapi.new_entry("sha256:" + "a" * 64, b"sig", set())
    assert re.fullmatch("sha256:" + "a" * 64 + "@[0-9a-f]{32}", entry["name"]) and entry["schemaVersion"] == 2 and entry["type"] == "atomic"
    assert base64.b64decode(entry["content"]) == b"sig"


def test_an_http_lookaside_staging_is_passed_over_where_the_api_keeps_signatures_and_refused_where_not(api, keys, disk, tmp_path):
    # docker_image_dest.go SupportsSignatures / PutSignaturesWithFormat: supportsSignatures is tried
    # before signatureBase, so an http(s) staging (putOneSignature: "Writing directly to a https
    # lookaside ... is not supported") is never written where the registry offers the API.
    openshift, store, plain = api
    regd = tmp_path / "regd"
    regd.mkdir()
    (regd / "default.yaml").write_text(f"default-docker:\n  lookaside: file://{keys['lookaside']}\n"
                                       f"docker:\n  {openshift.host}:\n    lookaside-staging: https://sigs.invalid/staging\n"
                                       f"  {plain.host}:\n    lookaside-staging: https://sigs.invalid/staging\n")
    ref = f"{openshift.host}/sigapi/staged:v1"
    digest = build(disk, ref, "--registries.d", regd, "--sign-by", keys["a"])
    assert len(store.contents("sigapi/staged", digest)) == 1
    assert inspect(keys, policy(tmp_path / "a.json", f"{openshift.host}/sigapi", signed_by(keys, "a")), ref).code == 0
    # skopeo (containers/image) does the same with this registries.d
    anything = tmp_path / "any.json"
    anything.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
    proc = subprocess.run(["skopeo", "--policy", str(anything), "--registries.d", str(regd), "copy", "--src-tls-verify=false",
                           "--dest-tls-verify=false", "--sign-by", keys["a"], f"docker://{ref}", f"docker://{openshift.host}/sigapi/staged-skopeo:v1"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr

    # a copy carrying a lookaside signature into the API registry through the same registries.d
    src = f"{plain.host}/sigapi/staged-src:v1"
    assert build(disk, src, "--registries.d", keys["regd"], "--sign-by", keys["b"]) == digest
    carried = run_diskkit("copy", NOREG, "--registries.d", regd, f"docker://{src}", f"docker://{openshift.host}/sigapi/staged-copy:v1")
    assert carried.code == 0, carried.err
    assert len(store.contents("sigapi/staged-copy", digest)) == 1

    # the plain registry keeps no signatures itself: refused before anything moves, in one line
    openshift.log.clear()
    plain.log.clear()
    refused = run_diskkit("build", NOREG, "--no-lazy", disk, "-t", f"{plain.host}/sigapi/unstaged:v1", "--registries.d", regd, "--sign-by", keys["a"])
    line = one_line(refused)
    assert "Writing directly to a https lookaside is not supported. Configure a lookaside-staging: location" in line, line
    assert not any(m in ("PUT", "POST", "PATCH") for m, _, _ in plain.log), plain.log
    refused = run_diskkit("copy", NOREG, "--registries.d", regd, f"docker://{src}", f"docker://{plain.host}/sigapi/unstaged-copy:v1")
    assert "Writing directly to a https lookaside is not supported" in one_line(refused)
    assert not any(m in ("PUT", "POST", "PATCH") for m, _, _ in plain.log), plain.log
