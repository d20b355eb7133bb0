"""Signed containerDisks against a real registry: sigstore keys, .sig attachments, policy.json.

Debian's skopeo 1.9 has sigstore compiled out ("Debian-local change: sigstore disabled", for signing
and for policy checks alike; test_skopeo_here_has_no_sigstore pins that), so the other side for the
key and signature formats is tests/keypeer, built from Go's crypto and golang.org/x/crypto (the
libraries cosign and containers/image use), and `openssl` for the raw signatures.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from diskkit.oci.reference import parse_docker_name
from diskkit.signing import policy as policy_mod
from tests.conftest import make_qcow2, run_diskkit, run_launcher, sigstore_keys
from tests.vmhost import QEMU_UID

NOREG = "--tls-verify=false"
ROOT = Path(__file__).resolve().parent.parent
SIG_MIME = "application/vnd.dev.cosign.simplesigning.v1+json"
SIG_ANNOTATION = "dev.cosignproject.cosign/signature"


@pytest.fixture(scope="module")
def keypeer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("keypeer") / "keypeer"
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": "/usr/share/gocode", "GOCACHE": str(out.parent / "gocache")}
    proc = subprocess.run(["go", "build", "-o", str(out), str(ROOT / "tests/keypeer/main.go")], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, f"building tests/keypeer failed (golang-go and golang-golang-x-crypto-dev needed):\n{proc.stderr}"
    return out


@pytest.fixture(scope="module")
def trust(tmp_path_factory) -> dict:
    """Two diskkit keys (a, b), a passphrase file and a registries.d that enables attachments."""
    d = tmp_path_factory.mktemp("trust")
    sigstore_keys(d, "correct horse")
    regd = d / "registries.d"
    regd.mkdir()
    (regd / "default.yaml").write_text("default-docker:\n  use-sigstore-attachments: true\n")
    return {"dir": d, "pass": d / "pass", "a": d / "a", "b": d / "b", "regd": regd}


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Path:
    return make_qcow2(tmp_path_factory.mktemp("disk") / "signed.qcow2", size="16M", pattern=0x3C)


@pytest.fixture(scope="module")
def other_disk(tmp_path_factory) -> Path:
    return make_qcow2(tmp_path_factory.mktemp("disk2") / "other.qcow2", size="16M", pattern=0x4D)


def signing_flags(trust: dict, key: str = "a") -> list:
    return ["--registries.d", trust["regd"], "--sign-by-sigstore-private-key", f"{trust[key]}.private", "--sign-passphrase-file", trust["pass"]]


def build_signed(disk: Path, ref: str, trust: dict, key: str = "a") -> str:
    # --no-lazy: a VM test below boots it from a full pull (lazy signed images: the disk-server test).
    r = run_diskkit("build", NOREG, "--no-lazy", disk, "-t", ref, *signing_flags(trust, key))
    assert r.code == 0, r.err
    return r.last_line


def write_policy(path: Path, scope: str, requirement: dict, default: str = "reject") -> Path:
    path.write_text(json.dumps({"default": [{"type": default}], "transports": {"docker": {scope: [requirement]}}}))
    return path


def keyed(trust: dict, key: str = "a", identity: dict | None = None) -> dict:
    req = {"type": "sigstoreSigned", "keyPath": f"{trust[key]}.pub"}
    if identity:
        req["signedIdentity"] = identity
    return req


def probe(ref: str, pol: Path, trust: dict):
    """Whether the policy lets `ref` be used: diskkit inspect enforces it before reading anything else."""
    return run_diskkit("inspect", NOREG, "--signature-policy", pol, "--registries.d", trust["regd"], ref)


def attachment(registry, repo: str, digest: str) -> dict:
    r = requests.get(registry.url(f"/v2/{repo}/manifests/sha256-{digest[7:]}.sig"), headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    assert r.status_code == 200, r.text
    return r.json()


def blob(registry, repo: str, digest: str) -> bytes:
    r = requests.get(registry.url(f"/v2/{repo}/blobs/{digest}"))
    assert r.status_code == 200
    return r.content


# --- keys ---------------------------------------------------------------------------------------


def test_generate_key_is_read_by_go_crypto(trust, keypeer, tmp_path):
    private, public = Path(f"{trust['a']}.private"), Path(f"{trust['a']}.pub")
    assert private.stat().st_mode & 0o777 == 0o600
    text = private.read_text()
    # containers/image writes and skopeo 1.9 reads only this label (signature/sigstore/copied.go).
    assert text.startswith("-----BEGIN ENCRYPTED COSIGN PRIVATE KEY-----\n")
    envelope = json.loads(base64.b64decode("".join(text.strip().splitlines()[1:-1])))
    assert envelope["kdf"]["name"] == "scrypt" and envelope["kdf"]["params"] == {"N": 32768, "r": 8, "p": 1}
    assert envelope["cipher"]["name"] == "nacl/secretbox" and len(base64.b64decode(envelope["cipher"]["nonce"])) == 24
    assert public.read_text().startswith("-----BEGIN PUBLIC KEY-----")
    payload = tmp_path / "payload"
    payload.write_bytes(b'{"any":"bytes"}')
    signed = subprocess.run([keypeer, "sign", private, trust["pass"]], stdin=payload.open("rb"), capture_output=True, text=True, check=False)
    assert signed.returncode == 0, signed.stderr
    verified = subprocess.run([keypeer, "verify", public, signed.stdout.strip()], stdin=payload.open("rb"), capture_output=True, text=True, check=False)
    assert verified.returncode == 0, verified.stderr
    wrong = tmp_path / "wrong"
    wrong.write_text("not it\n")
    assert subprocess.run([keypeer, "sign", private, wrong], stdin=payload.open("rb"), capture_output=True, check=False).returncode != 0
    again = run_diskkit("generate-sigstore-key", "--output-prefix", trust["a"], "--passphrase-file", trust["pass"])
    assert again.code != 0 and "refusing to overwrite" in again.err


def test_key_made_by_go_signs_in_diskkit(registry, trust, keypeer, disk, tmp_path):
    subprocess.run([keypeer, "keygen", tmp_path / "go", trust["pass"]], check=True)
    ref = f"{registry.host}/sign/gokey:v1"
    r = run_diskkit("build", NOREG, disk, "-t", ref, "--registries.d", trust["regd"],
                    "--sign-by-sigstore-private-key", tmp_path / "go.private", "--sign-passphrase-file", trust["pass"])
    assert r.code == 0, r.err
    digest = r.last_line
    layer = attachment(registry, "sign/gokey", digest)["layers"][0]
    payload = blob(registry, "sign/gokey", layer["digest"])
    verified = subprocess.run([keypeer, "verify", tmp_path / "go.pub", layer["annotations"][SIG_ANNOTATION]], input=payload, capture_output=True, check=False)
    assert verified.returncode == 0, verified.stderr
    ok = run_diskkit("verify", NOREG, "--key", f"{trust['a']}.pub", "--key", tmp_path / "go.pub", ref)
    assert ok.code == 0, ok.err
    assert f"signed by {tmp_path / 'go.pub'} as {ref}" in ok.out and str(trust["a"]) not in ok.out


def test_wrong_passphrase_pushes_nothing(registry, trust, disk, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text("nope\n")
    r = run_diskkit("build", NOREG, disk, "-t", f"{registry.host}/sign/wrongpass:v1", "--registries.d", trust["regd"],
                    "--sign-by-sigstore-private-key", f"{trust['a']}.private", "--sign-passphrase-file", wrong)
    assert r.code != 0 and len(r.err.strip().splitlines()) == 1 and "wrong passphrase" in r.err, r.err
    assert requests.get(registry.url("/v2/sign/wrongpass/tags/list")).status_code == 404


def test_signing_needs_attachments_enabled(registry, trust, disk, tmp_path):
    empty = tmp_path / "regd"
    empty.mkdir()
    r = run_diskkit("build", NOREG, disk, "-t", f"{registry.host}/sign/noattach:v1", "--registries.d", empty,
                    "--sign-by-sigstore-private-key", f"{trust['a']}.private", "--sign-passphrase-file", trust["pass"])
    assert r.code != 0 and "writing sigstore attachments is disabled by configuration" in r.err, r.err
    assert requests.get(registry.url("/v2/sign/noattach/tags/list")).status_code == 404


# --- the attachment ---------------------------------------------------------------------------


def test_build_stores_a_cosign_attachment(registry, trust, disk, tmp_path):
    ref = f"{registry.host}/sign/attach:v1"
    digest = build_signed(disk, ref, trust)
    manifest = attachment(registry, "sign/attach", digest)
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    [layer] = manifest["layers"]
    assert layer["mediaType"] == SIG_MIME
    payload = blob(registry, "sign/attach", layer["digest"])
    body = json.loads(payload)
    assert body["critical"] == {
        "identity": {"docker-reference": ref},
        "image": {"docker-manifest-digest": digest},
        "type": "cosign container image signature",
    }
    config = json.loads(blob(registry, "sign/attach", manifest["config"]["digest"]))
    assert config["rootfs"] == {"type": "layers", "diff_ids": [layer["digest"]]}
    # openssl, not diskkit, checks the ECDSA signature over the payload bytes.
    (tmp_path / "payload").write_bytes(payload)
    (tmp_path / "sig").write_bytes(base64.b64decode(layer["annotations"][SIG_ANNOTATION]))
    for key, expect in (("a", 0), ("b", 1)):
        proc = subprocess.run(["openssl", "dgst", "-sha256", "-verify", f"{trust[key]}.pub", "-signature", tmp_path / "sig", tmp_path / "payload"], capture_output=True, check=False)
        assert proc.returncode == expect, proc.stdout
    # A second signature by another key is added beside the first, as skopeo does.
    r = run_diskkit("push", NOREG, *signing_flags(trust, "b"), f"docker://{ref}", f"docker://{ref}")
    assert r.code == 0, r.err
    assert len(attachment(registry, "sign/attach", digest)["layers"]) == 2
    both = run_diskkit("verify", NOREG, "--key", f"{trust['a']}.pub", "--key", f"{trust['b']}.pub", ref)
    assert both.code == 0 and both.out.count("signed by") == 2, both.out


def test_multi_platform_build_signs_index_and_each_manifest(registry, trust, disk, other_disk):
    ref = f"{registry.host}/sign/multi:v1"
    r = run_diskkit("build", NOREG, "--platform", f"linux/amd64={disk}", "--platform", f"linux/arm64={other_disk}",
                    "-t", ref, *signing_flags(trust), "--json")
    assert r.code == 0, r.err
    result = json.loads(r.out)
    index = requests.get(registry.url(f"/v2/sign/multi/manifests/{result['digest']}"), headers={"Accept": "application/vnd.oci.image.index.v1+json"}).json()
    children = [m["digest"] for m in index["manifests"]]
    assert sorted(result["signed"]) == sorted(children + [result["digest"]])
    for digest in result["signed"]:
        payload = json.loads(blob(registry, "sign/multi", attachment(registry, "sign/multi", digest)["layers"][0]["digest"]))
        assert payload["critical"]["image"]["docker-manifest-digest"] == digest
    pol = write_policy(Path(registry.root).parent / "multi-policy.json", f"{registry.host}/sign", keyed(trust))
    ok = probe(ref, pol, trust)
    assert ok.code == 0, ok.err
    # push --all signs the copied index and each manifest too; without --all only the one copied.
    copied = f"{registry.host}/sign/multi-copy:v1"
    r = run_diskkit("push", NOREG, "--all", "--json", *signing_flags(trust, "b"), f"docker://{ref}", f"docker://{copied}")
    assert r.code == 0, r.err
    assert sorted(json.loads(r.out)["signed"]) == sorted(result["signed"])
    one = f"{registry.host}/sign/multi-one:v1"
    r = run_diskkit("push", NOREG, "--platform", "linux/arm64", "--json", *signing_flags(trust, "b"), f"docker://{ref}", f"docker://{one}")
    assert r.code == 0, r.err
    assert json.loads(r.out)["signed"] == [json.loads(r.out)["digest"]] and json.loads(r.out)["digest"] in children


# --- policy -------------------------------------------------------------------------------------


def test_push_enforces_the_policy(registry, trust, disk, other_disk, tmp_path):
    signed = f"{registry.host}/sign/policy:v1"
    build_signed(disk, signed, trust)
    unsigned = f"{registry.host}/sign/policy:unsigned"
    assert run_diskkit("build", NOREG, other_disk, "-t", unsigned).code == 0
    needs_a = write_policy(tmp_path / "a.json", f"{registry.host}/sign", keyed(trust, "a"))
    needs_b = write_policy(tmp_path / "b.json", f"{registry.host}/sign", keyed(trust, "b"))

    ok = run_diskkit("push", NOREG, "--signature-policy", needs_a, "--registries.d", trust["regd"], signed, f"oci:{tmp_path}/ok:v1")
    assert ok.code == 0, ok.err
    cases = [
        (needs_b, signed, "cryptographic signature verification failed"),
        (needs_a, unsigned, "A signature was required, but no signature exists"),
    ]
    for pol, ref, reason in cases:
        r = run_diskkit("push", NOREG, "--signature-policy", pol, "--registries.d", trust["regd"], ref, f"oci:{tmp_path}/no:v1")
        assert r.code != 0
        [line] = r.err.strip().splitlines()
        assert ref in line and str(pol) in line and f'transports.docker["{registry.host}/sign"]' in line and reason in line, line
        assert not (tmp_path / "no").exists()
    either = {"type": "sigstoreSigned", "keyPaths": [f"{trust['b']}.pub", f"{trust['a']}.pub"]}
    assert probe(signed, write_policy(tmp_path / "either.json", f"{registry.host}/sign", either), trust).code == 0
    # A signature replayed onto another image's attachment tag names the wrong digest.
    good = run_diskkit("inspect", NOREG, "--json", signed)
    bad = run_diskkit("inspect", NOREG, "--json", unsigned)
    good_digest, bad_digest = json.loads(good.out)["digest"], json.loads(bad.out)["digest"]
    repo = f"{registry.host}/sign/policy"
    assert run_diskkit("push", NOREG, f"docker://{repo}:sha256-{good_digest[7:]}.sig", f"docker://{repo}:sha256-{bad_digest[7:]}.sig").code == 0
    r = probe(unsigned, needs_a, trust)
    assert r.code != 0 and f"Signature for digest {good_digest} does not match" in r.err, r.err
    # Without use-sigstore-attachments the signature is not looked for, as containers/image does.
    empty = tmp_path / "regd"
    empty.mkdir()
    r = run_diskkit("inspect", NOREG, "--signature-policy", needs_a, "--registries.d", empty, signed)
    assert r.code != 0 and "no signature exists" in r.err
    # Scopes: another repository falls to the default (reject here).
    assert run_diskkit("push", NOREG, f"docker://{signed}", f"docker://{registry.host}/elsewhere/x:v1").code == 0
    r = probe(f"{registry.host}/elsewhere/x:v1", needs_a, trust)
    assert r.code != 0 and "rejected by policy" in r.err and "default" in r.err, r.err


def test_signed_identity_rules(registry, trust, disk, tmp_path):
    ref = f"{registry.host}/sign/ident:v1"
    digest = build_signed(disk, ref, trust)
    retagged = f"{registry.host}/sign/ident:v2"
    assert run_diskkit("push", NOREG, f"docker://{ref}", f"docker://{retagged}").code == 0
    by_digest = f"{registry.host}/sign/ident@{digest}"
    mirror = f"{registry.host}/mirror/ident:v1"
    assert run_diskkit("push", NOREG, f"docker://{ref}", f"docker://{mirror}").code == 0
    tag = f"sha256-{digest[7:]}.sig"
    assert run_diskkit("push", NOREG, f"docker://{registry.host}/sign/ident:{tag}", f"docker://{registry.host}/mirror/ident:{tag}").code == 0

    def allowed(image: str, identity: dict | None) -> bool:
        pol = write_policy(tmp_path / "p.json", "", keyed(trust, identity=identity))
        r = probe(image, pol, trust)
        assert r.code == 0 or "is not accepted" in r.err, r.err
        return r.code == 0

    assert allowed(ref, None)  # matchRepoDigestOrExact is sigstoreSigned's default
    assert not allowed(retagged, None)
    assert allowed(by_digest, None)
    assert allowed(retagged, {"type": "matchRepository"})
    assert not allowed(retagged, {"type": "matchExact"})
    assert not allowed(by_digest, {"type": "matchExact"})
    assert allowed(retagged, {"type": "exactReference", "dockerReference": ref})
    assert not allowed(mirror, None)
    remap = {"type": "remapIdentity", "prefix": f"{registry.host}/mirror", "signedPrefix": f"{registry.host}/sign"}
    assert allowed(mirror, remap)


def test_scope_precedence_and_namespaces(tmp_path):
    name = parse_docker_name("registry.example.com:5000/ns/sub/img:v1")
    assert policy_mod.identity_of(name) == "registry.example.com:5000/ns/sub/img:v1"
    assert policy_mod.namespaces_of(name) == [
        "registry.example.com:5000/ns/sub/img", "registry.example.com:5000/ns/sub", "registry.example.com:5000/ns",
        "registry.example.com:5000", "*.example.com", "*.com",
    ]
    scopes = ["", "*.com", "registry.example.com:5000", "registry.example.com:5000/ns/sub/img", "registry.example.com:5000/ns/sub/img:v1"]
    doc = {"default": [{"type": "insecureAcceptAnything"}], "transports": {"docker": {s: [{"type": "reject"}] for s in scopes}}}
    path = tmp_path / "p.json"
    for expected in reversed(scopes):  # the most specific scope left wins; dropping it exposes the next
        path.write_text(json.dumps(doc))
        loaded = policy_mod.load(path)
        entry, _ = policy_mod.requirements_for(loaded, "docker", policy_mod.identity_of(name), policy_mod.namespaces_of(name))
        assert entry == f'transports.docker["{expected}"]'
        del doc["transports"]["docker"][expected]
    path.write_text(json.dumps(doc))
    assert policy_mod.requirements_for(policy_mod.load(path), "docker", "x", [])[0] == "default"


@pytest.mark.parametrize("doc, words", [
    ({"default": []}, "must not be empty"),
    ({"transports": {}}, "Policy.Default is missing"),
    ({"default": [{"type": "signedBaseLayer", "baseLayerIdentity": {}}]}, "signedBaseLayer is not implemented"),
    ({"default": [{"type": "signedBy", "keyType": "GPGKeys"}]}, "Exactly one of keyPath, keyPaths and keyData must be specified"),
    ({"default": [{"type": "signedBy", "keyType": "X509Certificates", "keyData": ""}]}, "Unimplemented \"keyType\" value"),
    ({"default": [{"type": "sigstoreSigned", "fulcio": {}}]}, "fulcio"),
    ({"default": [{"type": "nonsense"}]}, 'Unknown policy requirement type "nonsense"'),
    ({"default": [{"type": "reject"}], "extra": 1}, 'unknown key "extra"'),
])
def test_bad_policies_are_refused_in_one_line(doc, words, tmp_path, registry):
    pol = tmp_path / "bad.json"
    pol.write_text(json.dumps(doc))
    r = run_diskkit("inspect", NOREG, "--signature-policy", pol, f"{registry.host}/sign/none:v1")
    assert r.code != 0 and len(r.err.strip().splitlines()) == 1 and words in r.err and str(pol) in r.err, r.err


# --- the launcher -------------------------------------------------------------------------------


def node_home(tmp_path: Path, trust: dict, requirement: dict, scope: str) -> dict:
    """A HOME whose ~/.config/containers holds the node's policy.json and registries.d (the standard places)."""
    conf = tmp_path / "home/.config/containers"
    (conf / "registries.d").mkdir(parents=True)
    (conf / "registries.d/default.yaml").write_text((trust["regd"] / "default.yaml").read_text())
    write_policy(conf / "policy.json", scope, requirement)
    return {"HOME": str(tmp_path / "home")}


def cache_files(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for area in ("disks", "refs", "tmp") for p in (cache / area).rglob("*") if p.is_file())


def test_launcher_pull_requires_the_signature(registry, trust, keypeer, disk, other_disk, tmp_path):
    ref = f"{registry.host}/node/disk:v1"
    build_signed(disk, ref, trust, "a")
    env = node_home(tmp_path, trust, keyed(trust, "a"), f"{registry.host}/node")
    ok = run_launcher("pull", NOREG, "--cache-dir", tmp_path / "ok-cache", ref, env=env)
    assert ok.code == 0, ok.err
    # The tag moves to an unsigned image, then to one signed by another key: both refused, cache empty.
    assert run_diskkit("build", NOREG, other_disk, "-t", ref).code == 0
    for step in ("unsigned", "other key"):
        if step == "other key":
            build_signed(other_disk, ref, trust, "b")
        cache = tmp_path / f"cache-{step.replace(' ', '-')}"
        r = run_launcher("pull", NOREG, "--cache-dir", cache, ref, env=env)
        assert r.code != 0, r.out
        [line] = r.err.strip().splitlines()
        assert ref in line and "policy.json" in line, line
        assert ("no signature exists" if step == "unsigned" else "cryptographic signature verification failed") in line, line
        assert not cache.exists() or cache_files(cache) == [], cache_files(cache)


def test_skopeo_here_has_no_sigstore(registry, trust, disk, tmp_path):
    """Why skopeo is not the peer here: if this starts failing, Debian's skopeo can sign and the
    interop tests should use it."""
    ref = f"{registry.host}/sign/skopeo:v1"
    build_signed(disk, ref, trust)
    pol = write_policy(tmp_path / "p.json", f"{registry.host}/sign", keyed(trust))
    proc = subprocess.run(["skopeo", "--policy", pol, "--registries.d", trust["regd"], "copy", "--src-tls-verify=false",
                           f"docker://{ref}", f"oci:{tmp_path}/out:v1"], capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "sigstore disabled" in proc.stderr, proc.stderr


def test_vm_boots_a_signed_image_and_run_refuses_an_unsigned_one(registry, trust, qemu_user):
    from tests.testguest import ensure_testguest, parse_console
    from tests.vmhost import assert_clean

    guest = ensure_testguest() / "testguest-poweroff.qcow2"
    signed = f"{registry.host}/vm/guest:v1"
    build_signed(guest, signed, trust)
    unsigned = f"{registry.host}/vmu/guest:v1"
    assert run_diskkit("build", NOREG, "--no-lazy", guest, "-t", unsigned).code == 0
    # The node's policy in the qemu user's standard places; keyData, as its HOME cannot read ours.
    conf = qemu_user.home / ".config/containers"
    (conf / "registries.d").mkdir(parents=True)
    (conf / "registries.d/default.yaml").write_text((trust["regd"] / "default.yaml").read_text())
    key_data = base64.b64encode(Path(f"{trust['a']}.pub").read_bytes()).decode()
    write_policy(conf / "policy.json", registry.host, {"type": "sigstoreSigned", "keyData": key_data})
    # The qemu user's libvirt session daemon keeps its own files under ~/.config: it must stay theirs.
    for path in [qemu_user.home / ".config", *(qemu_user.home / ".config").rglob("*")]:
        os.chown(path, QEMU_UID, QEMU_UID)

    refused = qemu_user.launcher("run", NOREG, "--console", "--timeout", "180", qemu_user.write_vmi("unsigned", unsigned))
    assert refused.code != 0, refused.out
    [line] = refused.err.strip().splitlines()
    assert unsigned in line and "A signature was required, but no signature exists" in line, refused.err
    assert cache_files(qemu_user.cache) == []
    assert_clean(qemu_user, "default_unsigned")

    booted = qemu_user.launcher("run", NOREG, "--console", "--timeout", "180", qemu_user.write_vmi("signed", signed))
    assert booted.code == 0, booted.err
    console = parse_console(booted.out)
    assert console["ready"] and console["done"], booted.out
    assert_clean(qemu_user, "default_signed")


def test_lazy_disk_server_checks_the_policy_before_serving(registry, trust, disk, other_disk, tmp_path):
    from tests.lazyhost import control, disk_server

    signed = f"{registry.host}/lazy/signed:v1"
    r = run_diskkit("build", NOREG, "--lazy", disk, "-t", signed, *signing_flags(trust))
    assert r.code == 0, r.err
    unsigned = f"{registry.host}/lazy/unsigned:v1"
    assert run_diskkit("build", NOREG, "--lazy", other_disk, "-t", unsigned).code == 0
    env = node_home(tmp_path, trust, keyed(trust), f"{registry.host}/lazy")
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, env=env):
        ask = {"op": "open", "path": None, "registry": {"tls_verify": False}}
        refused = control(cache, {**ask, "image": unsigned})
        assert refused["ok"] is False and "A signature was required, but no signature exists" in refused["error"], refused
        assert unsigned in refused["error"]
        lazy = cache / "lazy"
        assert [p for p in lazy.rglob("*") if p.is_file()] == [] if lazy.exists() else True, "the refused image left lazy files"
        opened = control(cache, {**ask, "image": signed})
        assert opened["ok"], opened


def test_registries_d_most_specific_entry_that_sets_the_key_wins(tmp_path):
    from diskkit.signing import registriesd

    (tmp_path / "a.yaml").write_text("default-docker:\n  use-sigstore-attachments: true\n")
    (tmp_path / "b.yaml").write_text(
        "docker:\n  reg.example/ns:\n    use-sigstore-attachments: false\n  reg.example/ns/img:\n    lookaside: file:///x\n"
    )
    config = registriesd.load(tmp_path)
    name = parse_docker_name("reg.example/ns/img:v1")
    # reg.example/ns/img sets nothing about attachments, so reg.example/ns decides.
    assert registriesd.uses_attachments(config, policy_mod.identity_of(name), policy_mod.namespaces_of(name)) is False
    other = parse_docker_name("reg.example/other/img:v1")
    assert registriesd.uses_attachments(config, policy_mod.identity_of(other), policy_mod.namespaces_of(other)) is True
    (tmp_path / "c.yaml").write_text("default-docker:\n  use-sigstore-attachments: false\n")
    with pytest.raises(Exception, match="default-docker is defined in more than one file"):
        registriesd.load(tmp_path)


def _on_a_terminal(args: list, answers: list[str]) -> tuple[int, str]:
    """Run diskkit with a pty as its controlling terminal, typing each answer after a prompt."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # the child: its terminal is the pty
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "diskkit", *map(str, args)])
    seen, sent = b"", 0
    while True:
        ready, _, _ = select.select([fd], [], [], 60)
        assert ready, f"no output from diskkit: {seen!r}"
        try:
            chunk = os.read(fd, 1024)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
        if sent < len(answers) and seen.lower().count(b"passphrase for the new key: ") > sent:
            os.write(fd, answers[sent].encode() + b"\n")
            sent += 1
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), seen.decode(errors="replace")


def test_generate_key_asks_on_the_terminal(keypeer, tmp_path):
    """Without --passphrase-file the passphrase is typed twice on the terminal, never echoed."""
    code, out = _on_a_terminal(["generate-sigstore-key", "--output-prefix", tmp_path / "tty"], ["typed secret", "typed secret"])
    assert code == 0 and "typed secret" not in out, out
    (tmp_path / "pass").write_text("typed secret\n")
    signed = subprocess.run([keypeer, "sign", tmp_path / "tty.private", tmp_path / "pass"], input=b"x", capture_output=True, check=False)
    assert signed.returncode == 0, signed.stderr
    code, out = _on_a_terminal(["generate-sigstore-key", "--output-prefix", tmp_path / "tty2"], ["one", "two"])
    assert code != 0 and "the two entries differ" in out, out
    assert not (tmp_path / "tty2.private").exists()


def test_a_signed_name_without_a_tag_is_not_name_latest():
    """reference.ParseNormalizedNamed keeps a signed "host/repo" untagged (policy_reference_match.go)."""
    intended = parse_docker_name("reg.example/ns/img:latest")
    rule = {"type": "matchRepoDigestOrExact"}
    assert policy_mod.identity_matches(rule, intended, "reg.example/ns/img:latest")
    assert not policy_mod.identity_matches(rule, intended, "reg.example/ns/img")
    assert policy_mod.identity_matches({"type": "matchRepository"}, intended, "reg.example/ns/img")
    assert not policy_mod.identity_matches({"type": "matchExact"}, intended, "reg.example/ns/img")
    by_digest = parse_docker_name("reg.example/ns/img@sha256:" + "a" * 64)
    assert policy_mod.identity_matches(rule, by_digest, "reg.example/ns/img")


def test_launcher_flags_name_the_policy_for_pulls_disk_servers_and_imports(registry, trust, disk, other_disk, tmp_path):
    """--signature-policy and --registries.d on launcher commands, as skopeo takes them (issue: signed
    images, "every launcher pull (run, pull, serve, DataVolume registry imports)"): the flag's policy,
    not the node's in HOME (which accepts anything here), decides."""
    from tests.lazyhost import control, disk_server
    from tests.test_dv_import import Claims, dv

    scope = f"{registry.host}/flags"
    signed, unsigned = f"{scope}/signed:v1", f"{scope}/unsigned:v1"
    assert run_diskkit("build", NOREG, disk, "-t", signed, *signing_flags(trust)).code == 0
    assert run_diskkit("build", NOREG, other_disk, "-t", unsigned).code == 0
    env = node_home(tmp_path, trust, {"type": "insecureAcceptAnything"}, scope)
    pol = write_policy(tmp_path / "required.json", scope, keyed(trust))
    flags = ["--signature-policy", pol, "--registries.d", trust["regd"]]

    def pull(ref: str, *extra):
        return run_launcher("pull", NOREG, *extra, "--cache-dir", tmp_path / f"cache-{len(extra)}-{ref.rsplit('/', 1)[1]}", ref, env=env)

    assert pull(unsigned).code == 0  # the node's own policy lets it through
    refused = pull(unsigned, *flags)
    [line] = refused.err.strip().splitlines()
    assert refused.code != 0 and unsigned in line and "no signature exists" in line, refused.err
    assert pull(signed, *flags).code == 0

    cache = tmp_path / "serve-cache"
    cache.mkdir()
    with disk_server(cache, *flags, env=env):
        ask = {"op": "open", "path": None, "registry": {"tls_verify": False}}
        answer = control(cache, {**ask, "image": unsigned})
        assert answer["ok"] is False and "no signature exists" in answer["error"], answer
        assert control(cache, {**ask, "image": signed})["ok"]

    (tmp_path / "claims").mkdir()
    claims = Claims(tmp_path / "claims")
    claims.add(dv("unsigned", {"registry": {"url": f"docker://{unsigned}"}}, "24Mi"),
               dv("signed", {"registry": {"url": f"docker://{signed}"}}, "24Mi"))
    refused = claims.run("import", NOREG, *flags, "unsigned")
    assert refused.code != 0 and unsigned in refused.err and "no signature exists" in refused.err, refused.err
    claims.assert_untouched("unsigned")
    imported = claims.run("import", NOREG, *flags, "signed")
    assert imported.code == 0, imported.err
    assert (claims.dirs["signed"] / "disk.img").stat().st_size == 24 << 20


# --- the policy on every use: cache hits too ------------------------------------------------------


def _cached_unsigned(registry, trust: dict, disk: Path, tmp_path: Path, repo: str) -> tuple[str, list, list]:
    """An unsigned lazy image; the flags of a policy that accepts anything, under which it is pulled
    into a cache, and of one that requires key a for the registry (files in `tmp_path`, the key inline)."""
    ref = f"{registry.host}/{repo}:v1"
    assert run_diskkit("build", NOREG, "--lazy", disk, "-t", ref).code == 0
    regd = tmp_path / "registries.d"
    regd.mkdir()
    (regd / "default.yaml").write_text((trust["regd"] / "default.yaml").read_text())
    accept = write_policy(tmp_path / "accept.json", registry.host, {"type": "insecureAcceptAnything"})
    key_data = base64.b64encode(Path(f"{trust['a']}.pub").read_bytes()).decode()
    required = write_policy(tmp_path / "required.json", registry.host, {"type": "sigstoreSigned", "keyData": key_data})
    return ref, ["--signature-policy", accept, "--registries.d", regd], ["--signature-policy", required, "--registries.d", regd]


def _vmi_file(path: Path, image: str) -> Path:
    path.write_text(json.dumps({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "cached"},
                                "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]}},
                                         "volumes": [{"name": "root", "containerDisk": {"image": image}}]}}))
    return path


def _refused_unsigned(result, ref: str) -> None:
    assert result.code == 8, (result.code, result.err)
    [line] = result.err.strip().splitlines()
    assert ref in line and "required.json" in line and "A signature was required, but no signature exists" in line, line


def test_a_cached_unsigned_image_is_refused_under_a_requiring_policy(registry, trust, disk, tmp_path):
    """Attack: the policy skipped for cached images. An image pulled under no policy (or another one) was
    used from the cache by `launcher pull`, `domain` (the lazy default and --no-lazy) under a policy.json
    that requires a signature, where skopeo refuses it. Every use passes the policy in force, as every
    copy in containers/image passes its one policy context (copy/single.go IsRunningImageAllowed)."""
    ref, accept, required = _cached_unsigned(registry, trust, disk, tmp_path, "cached/unsigned")
    cache = tmp_path / "cache"
    pulled = run_launcher("pull", NOREG, *accept, "--cache-dir", cache, ref)
    assert pulled.code == 0, pulled.err
    assert run_launcher("pull", NOREG, *accept, "--cache-dir", cache, ref).code == 0  # the hit, under the policy it was pulled by
    _refused_unsigned(run_launcher("pull", NOREG, *required, "--cache-dir", cache, ref), ref)
    vmi = _vmi_file(tmp_path / "vmi.yaml", ref)
    for lazy in ([], ["--no-lazy"]):
        _refused_unsigned(run_launcher("domain", NOREG, *required, *lazy, "--cache-dir", cache, vmi), ref)
    assert run_launcher("domain", NOREG, *accept, "--cache-dir", cache, vmi).code == 0
    if (cache / "serve" / "control.sock").exists():
        from tests.lazyhost import stop_spawned_server
        stop_spawned_server(cache)


def test_the_lazy_path_reads_no_blob_of_an_image_before_the_policy_admits_it(registry, trust, disk, fault_proxy, tmp_path):
    """`launcher domain`'s lazy default asked whether an image boots lazily from its manifest and its
    config: the config blob of an image the policy then refused was fetched first. containers/image
    checks the policy "BEFORE reading any other information about the image" than its manifest
    (copy/single.go, IsRunningImageAllowed); so does every read here now, the lazy question included."""
    ref = f"{registry.host}/lazy/before-policy:v1"
    assert run_diskkit("build", NOREG, "--lazy", disk, "-t", ref).code == 0
    proxy = fault_proxy(registry)
    shown = f"{proxy.host}/lazy/before-policy:v1"
    regd = tmp_path / "registries.d"
    regd.mkdir()
    (regd / "default.yaml").write_text((trust["regd"] / "default.yaml").read_text())
    key_data = base64.b64encode(Path(f"{trust['a']}.pub").read_bytes()).decode()
    required = write_policy(tmp_path / "required.json", proxy.host, {"type": "sigstoreSigned", "keyData": key_data})
    cache = tmp_path / "cache"
    try:
        refused = run_launcher("domain", NOREG, "--signature-policy", required, "--registries.d", regd, "--cache-dir", cache,
                               _vmi_file(tmp_path / "vmi.yaml", shown))
        _refused_unsigned(refused, shown)
        assert any("/manifests/" in path for _, path, _ in proxy.log), proxy.log
        assert [path for _, path, _ in proxy.log if "/blobs/" in path] == [], proxy.log
    finally:
        if (cache / "serve" / "control.sock").exists():
            from tests.lazyhost import stop_spawned_server
            stop_spawned_server(cache)


def test_run_refuses_a_cached_unsigned_image_before_any_boot(registry, trust, disk, qemu_user, tmp_path):
    """The same attack through `launcher run`: refused before a domain is defined, nothing left."""
    from tests.vmhost import assert_clean

    scratch = qemu_user.root / "cached-unsigned"
    scratch.mkdir()
    ref, accept, required = _cached_unsigned(registry, trust, disk, scratch, "cached/run-unsigned")
    cache = scratch / "cache"
    cache.mkdir()
    os.chown(cache, QEMU_UID, QEMU_UID)
    assert qemu_user.launcher("pull", NOREG, *accept, "--cache-dir", cache, ref).code == 0
    vmi = _vmi_file(scratch / "vmi.yaml", ref)
    refused = qemu_user.launcher("run", NOREG, *required, "--cache-dir", cache, "--timeout", "30", vmi)
    _refused_unsigned(refused, ref)
    assert not (cache / "vms").exists() or list((cache / "vms").iterdir()) == []
    assert_clean(qemu_user, "default_cached")


def test_a_cached_signed_image_is_accepted_offline_from_its_kept_signatures(trust, disk, tmp_path):
    """The signatures an image was accepted with are kept beside it: with its registry stopped, the
    cache hit is accepted from them (`pull` and `domain`), no network asked. A policy that now wants
    another key re-evaluates: the kept ones fail it and, the registry away, the hit is refused (exit 8);
    with the registry back, its signatures are read and refused the same."""
    from tests.distribution import start_registry

    own = start_registry(tmp_path / "registry")  # this test stops it
    try:
        ref = f"{own.host}/kept/signed:v1"
        build_signed(disk, ref, trust, "a")
        flags = lambda key: ["--signature-policy", write_policy(tmp_path / f"{key}.json", own.host, keyed(trust, key)), "--registries.d", trust["regd"]]
        cache = tmp_path / "cache"
        assert run_launcher("pull", NOREG, *flags("a"), "--cache-dir", cache, ref).code == 0
        assert [p.name for p in (cache / "signatures").iterdir()], "no signatures kept"
        own.stop()
        offline = run_launcher("pull", NOREG, *flags("a"), "--cache-dir", cache, ref)
        assert offline.code == 0, offline.err
        vmi = _vmi_file(tmp_path / "vmi.yaml", ref)
        shown = run_launcher("domain", NOREG, *flags("a"), "--cache-dir", cache, vmi)
        assert shown.code == 0 and "<domain" in shown.out, shown.err
        other_key = run_launcher("pull", NOREG, *flags("b"), "--cache-dir", cache, ref)
        assert other_key.code == 8, other_key.err
        [line] = other_key.err.strip().splitlines()
        assert "b.json" in line and "the signatures kept with it" in line and "could not be read" in line, line
        own.start()
        online = run_launcher("pull", NOREG, *flags("b"), "--cache-dir", cache, ref)
        assert online.code == 8 and "cryptographic signature verification failed" in online.err, online.err
    finally:
        own.stop()
