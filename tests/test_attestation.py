"""Boot-test attestations: `launcher test --attest-*` attaches an in-toto Statement v1 in a DSSE
envelope as an OCI 1.1 referrer of the image; `diskkit verify-attestation` checks it.

No cosign or in-toto tool is installed here, so besides diskkit's own verifier each envelope's
signature is checked independently over DSSE's pre-authentication encoding (PAE, the DSSE spec's
protocol.md): `openssl dgst -sha256 -verify` for the cosign-format key, `gpg --verify` for a GPG
key. The layout is cosign's specs/BUNDLE_SPEC.md; the registry (distribution 2.8) has no referrers
API, so the referrers tag schema of distribution-spec's spec.md is what is exercised. One VM boot.
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import re
import subprocess
from pathlib import Path

import pytest
import requests

from diskkit.oci.image import Descriptor
from diskkit.oci.reference import parse_docker_name
from diskkit.ops.attest import Attester
from diskkit.registry.options import RegistryOptions
from diskkit.signing import attestation as at
from diskkit.signing.options import SignOptions
from tests.conftest import make_qcow2, run_diskkit, run_launcher, sigstore_keys
from tests.gnupg import gnupg_home, gpg, new_key
from tests.vmhost import NOREG, QEMU_UID

INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
PLAIN = RegistryOptions(tls_verify=False)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict:
    """Cosign-format keys a and b, and a GNUPGHOME with GPG keys g and h."""
    d = tmp_path_factory.mktemp("attest")
    sigstore_keys(d, "open sesame")
    home = d / "gnupg"
    home.mkdir(mode=0o700)
    out = {"dir": d, "pass": d / "pass", "home": home}
    for name in ("g", "h"):
        out[name] = new_key(home, f"{name} <{name}@diskkit.test>")
        (d / f"{name}.gpg").write_bytes(gpg(home, "--export", out[name]))
    with gnupg_home(home):
        yield out


def for_qemu(qemu_user, path: Path) -> Path:
    """A copy the qemu user (who runs `launcher test`) can read."""
    copy = qemu_user.root / path.name
    copy.write_bytes(path.read_bytes())
    os.chown(copy, QEMU_UID, pwd.getpwuid(QEMU_UID).pw_gid)
    copy.chmod(0o600)
    return copy


def build(registry, tmp_path: Path, repo: str, pattern: int) -> tuple[str, str]:
    disk = make_qcow2(tmp_path / f"{repo.replace('/', '-')}.qcow2", size="8M", pattern=pattern)
    ref = f"{registry.host}/{repo}:v1"
    r = run_diskkit("build", NOREG, "--no-lazy", disk, "-t", ref)
    assert r.code == 0, r.err
    return ref, r.last_line


def verify(ref: str, *flags) -> object:
    return run_diskkit("verify-attestation", NOREG, *map(str, flags), ref)


def referrers_index(registry, repo: str, digest: str) -> dict:
    """The fallback tag's index, read as any OCI 1.1 client would after the referrers API's 404."""
    assert requests.get(registry.url(f"/v2/{repo}/referrers/{digest}")).status_code == 404  # no referrers API here
    r = requests.get(registry.url(f"/v2/{repo}/manifests/sha256-{digest[7:]}"), headers={"Accept": INDEX})
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"] == INDEX
    return r.json()


def envelope_of(registry, repo: str, entry: dict) -> tuple[dict, dict]:
    """(the referrer manifest, its DSSE envelope), read with plain HTTP."""
    manifest = requests.get(registry.url(f"/v2/{repo}/manifests/{entry['digest']}"), headers={"Accept": MANIFEST}).json()
    layer = requests.get(registry.url(f"/v2/{repo}/blobs/{manifest['layers'][0]['digest']}")).json()
    return manifest, layer["dsseEnvelope"] if manifest["artifactType"] == at.BUNDLE_MEDIA_TYPE else layer


def pae_bytes(env: dict) -> bytes:
    """The PAE written out here from the DSSE spec, not by diskkit's code."""
    payload = base64.b64decode(env["payload"])
    kind = env["payloadType"].encode()
    return b"DSSEv1 " + str(len(kind)).encode() + b" " + kind + b" " + str(len(payload)).encode() + b" " + payload


def openssl_verifies(tmp_path: Path, public: Path, env: dict) -> bool:
    (tmp_path / "pae").write_bytes(pae_bytes(env))
    (tmp_path / "sig").write_bytes(base64.b64decode(env["signatures"][0]["sig"]))
    r = subprocess.run(["openssl", "dgst", "-sha256", "-verify", str(public), "-signature", str(tmp_path / "sig"), str(tmp_path / "pae")],
                       capture_output=True, text=True, check=False)
    return r.returncode == 0 and r.stdout.strip() == "Verified OK"


def gpg_verifies(tmp_path: Path, keyring: Path, env: dict) -> bool:
    home = tmp_path / f"verify-{keyring.stem}"  # only this keyring in it
    home.mkdir(mode=0o700)
    try:
        subprocess.run(["gpg", "--homedir", str(home), "--batch", "--import", str(keyring)], capture_output=True, check=True)
        (tmp_path / "pae").write_bytes(pae_bytes(env))
        (tmp_path / "sig").write_bytes(base64.b64decode(env["signatures"][0]["sig"]))
        r = subprocess.run(["gpg", "--homedir", str(home), "--batch", "--status-fd", "1", "--verify", str(tmp_path / "sig"), str(tmp_path / "pae")],
                           capture_output=True, text=True, check=False)
    finally:
        subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "all"], capture_output=True, check=False)  # the import's agent
    return r.returncode == 0 and "[GNUPG:] GOODSIG" in r.stdout


def refusal(r) -> str:
    lines = r.err.strip().splitlines()
    assert r.code == 8 and len(lines) == 1, (r.code, r.err)
    return lines[0]


def predicate(ref: str, digest: str, passed: bool = True) -> dict:
    return at.boot_test_predicate(ref, digest, "echo hello", 4.2 if passed else None, passed, 0 if passed else None,
                                  "" if passed else "no ssh login within --timeout", "launcher test-suite", "2026-01-01T00:00:00Z")


def test_launcher_test_attaches_a_signed_statement_that_verifies(registry, keys, qemu_user, guest_image, tmp_path):
    """The one boot: the result, signed with a cosign-format key, as a referrer of the tested digest."""
    result = qemu_user.launcher("test", NOREG, "--json", "--timeout", "240", "--memory", "128Mi",
                                "--attest-sigstore-private-key", for_qemu(qemu_user, keys["dir"] / "a.private"),
                                "--attest-passphrase-file", for_qemu(qemu_user, keys["pass"]), guest_image)
    assert result.code == 0, result.err
    out = json.loads(result.out)
    digest = out["images"][guest_image]
    repo = parse_docker_name(guest_image, "ref").repository
    [pushed] = out["attestations"]
    assert pushed["listedBy"] == f"tag sha256-{digest[7:]}" and pushed["artifactType"] == at.BUNDLE_MEDIA_TYPE, pushed
    [entry] = [m for m in referrers_index(registry, repo, digest)["manifests"] if m["digest"] == pushed["referrer"].split("@")[1]]
    assert entry["artifactType"] == at.BUNDLE_MEDIA_TYPE
    assert entry["annotations"][at.PREDICATE_ANNOTATION] == at.PREDICATE_TYPE
    manifest, env = envelope_of(registry, repo, entry)
    assert manifest["subject"]["digest"] == digest and manifest["config"]["mediaType"] == "application/vnd.oci.empty.v1+json"
    statement = json.loads(base64.b64decode(env["payload"]))
    assert statement["_type"] == "https://in-toto.io/Statement/v1" and env["payloadType"] == "application/vnd.in-toto+json"
    assert statement["subject"] == [{"name": f"{registry.host}/{repo}", "digest": {"sha256": digest[7:]}}]
    p = statement["predicate"]
    assert p["imageDigest"] == digest and p["command"] == "echo hello" and p["result"] == "pass"
    assert p["bootToSshSeconds"] == out["bootToSshSeconds"] and p["launcher"].startswith("launcher ")
    # independent check of the signature, then diskkit's
    assert openssl_verifies(tmp_path, keys["dir"] / "a.pub", env)
    assert not openssl_verifies(tmp_path, keys["dir"] / "b.pub", env)
    ok = verify(guest_image, "--json", "--key", keys["dir"] / "a.pub")
    assert ok.code == 0, ok.err
    assert json.loads(ok.out)["digest"] == digest and json.loads(ok.out)["predicate"] == p
    line = refusal(verify(guest_image, "--key", keys["dir"] / "b.pub"))
    assert line.startswith(f"diskkit: {guest_image}: no attestation of {digest} accepted: ") and "does not verify" in line, line


def test_gpg_attestation_verifies_with_gpg_over_the_pae(registry, keys, tmp_path):
    ref, digest = build(registry, tmp_path, "attest/gpg", 0x21)
    pushed = Attester(SignOptions(None, sign_by=keys["g"])).attach(ref, digest, predicate(ref, digest), PLAIN)
    assert pushed["artifactType"] == at.DSSE_MEDIA_TYPE
    [entry] = referrers_index(registry, "attest/gpg", digest)["manifests"]
    _, env = envelope_of(registry, "attest/gpg", entry)
    assert env["signatures"][0]["keyid"] == keys["g"]
    assert gpg_verifies(tmp_path, keys["dir"] / "g.gpg", env)
    assert not gpg_verifies(tmp_path, keys["dir"] / "h.gpg", env)
    ok = verify(ref, "--gpg-key", keys["dir"] / "g.gpg")
    assert ok.code == 0, ok.err
    assert ok.out.startswith(f"OK {ref}: {digest} boot-tested (pass, 'echo hello', ssh 4.2 s after boot)") and keys["g"] in ok.out, ok.out
    line = refusal(verify(ref, "--gpg-key", keys["dir"] / "h.gpg"))
    assert "Invalid GPG signature: No public key" in line, line
    # a cosign-format key does not accept a GPG signature
    refusal(verify(ref, "--key", keys["dir"] / "a.pub"))


def test_a_second_attestation_is_added_to_the_referrers_index(registry, keys, tmp_path):
    ref, digest = build(registry, tmp_path, "attest/two", 0x22)
    first = Attester(SignOptions(keys["dir"] / "b.private", keys["pass"])).attach(ref, digest, predicate(ref, digest, passed=False), PLAIN)
    # a failed test is recorded, but is not a passed one
    line = refusal(verify(ref, "--key", keys["dir"] / "b.pub"))
    assert line.endswith("the boot test failed (no ssh login within --timeout)"), line
    assert verify(ref, "--key", keys["dir"] / "b.pub", "--allow-failed").code == 0
    second = Attester(SignOptions(None, sign_by=keys["h"])).attach(ref, digest, predicate(ref, digest), PLAIN)
    index = referrers_index(registry, "attest/two", digest)
    assert [m["digest"] for m in index["manifests"]] == [first["referrer"].split("@")[1], second["referrer"].split("@")[1]]
    assert verify(ref, "--gpg-key", keys["dir"] / "h.gpg").code == 0


def test_tampered_moved_and_missing_attestations_are_refused(registry, keys, tmp_path):
    ref, digest = build(registry, tmp_path, "attest/bad", 0x23)
    other_ref, other = build(registry, tmp_path, "attest/bad2", 0x24)
    line = refusal(verify(ref, "--key", keys["dir"] / "b.pub"))
    assert line == f"diskkit: {ref}: no attestation refers to {digest}"
    signer = Attester(SignOptions(keys["dir"] / "b.private", keys["pass"]))
    # a statement about another image's digest, hung on this one
    env = at.envelope(at.statement(f"{registry.host}/attest/bad2", other, predicate(other_ref, other)), "", b"")
    payload = base64.b64decode(env["payload"])
    env["signatures"][0]["sig"] = base64.b64encode(signer.sign(at.pae(at.PAYLOAD_TYPE, payload))).decode()
    from diskkit.signing import referrers
    subject = Descriptor(MANIFEST, digest, len(requests.get(registry.url(f"/v2/attest/bad/manifests/{digest}"), headers={"Accept": MANIFEST}).content))
    referrers.push_referrer(parse_docker_name(ref, "ref"), subject, at.BUNDLE_MEDIA_TYPE, at.stored(at.BUNDLE_MEDIA_TYPE, env, "x"), {}, PLAIN)
    line = refusal(verify(ref, "--key", keys["dir"] / "b.pub"))
    assert line.endswith(f"the statement's subject is not {digest}"), line
    # a signed statement about this digest whose payload is changed after signing
    good = at.statement(f"{registry.host}/attest/bad", digest, predicate(ref, digest))
    env = at.envelope(good, "", signer.sign(at.pae(at.PAYLOAD_TYPE, good)))
    env["payload"] = base64.b64encode(good.replace(b'"result":"pass"', b'"result":"pasS"')).decode()
    referrers.push_referrer(parse_docker_name(ref, "ref"), subject, at.BUNDLE_MEDIA_TYPE, at.stored(at.BUNDLE_MEDIA_TYPE, env, "x"), {}, PLAIN)
    line = refusal(verify(ref, "--key", keys["dir"] / "b.pub"))
    assert "the signature does not verify with the given keys" in line, line
    # the same envelope untampered is accepted (any one attestation suffices)
    env["payload"] = base64.b64encode(good).decode()
    referrers.push_referrer(parse_docker_name(ref, "ref"), subject, at.BUNDLE_MEDIA_TYPE, at.stored(at.BUNDLE_MEDIA_TYPE, env, "x"), {}, PLAIN)
    assert verify(ref, "--key", keys["dir"] / "b.pub").code == 0


def test_attesting_refuses_before_the_boot(keys, qemu_user, tmp_path):
    # not a registry image: refused before any pull or boot
    private, passphrase = for_qemu(qemu_user, keys["dir"] / "a.private"), for_qemu(qemu_user, keys["pass"])
    r = qemu_user.launcher("test", NOREG, "--attest-sigstore-private-key", private, "--attest-passphrase-file", passphrase,
                           f"oci:{tmp_path}/nowhere:v1")
    assert r.code == 3 and r.err.strip().splitlines()[-1].endswith("attestations are stored in a registry as referrers: attest a docker:// image"), r.err
    # a wrong passphrase: refused before anything
    (tmp_path / "wrong").write_text("nope\n")
    r = qemu_user.launcher("test", NOREG, "--attest-sigstore-private-key", private, "--attest-passphrase-file",
                           for_qemu(qemu_user, tmp_path / "wrong"), "localhost:1/never:v1")
    assert r.code != 0 and r.err.strip().splitlines() == [f"launcher: {private}: decrypt: wrong passphrase (or a damaged key file)"], r.err
    r = qemu_user.launcher("test", "--attest-passphrase-file", passphrase, "localhost:1/never:v1")
    assert r.code == 2 and "--attest-passphrase-file needs --attest-sign-by or --attest-sigstore-private-key" in r.err


def test_pae_is_the_dsse_specs():
    # the DSSE spec's own example (secure-systems-lab/dsse protocol.md)
    assert at.pae("http://example.com/HelloWorld", b"hello world") == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    env = at.envelope(b"{}", "k", b"sig")
    assert pae_bytes(env) == at.pae(at.PAYLOAD_TYPE, b"{}")
    # a bundle and a bare envelope read back to the same envelope; anything else is not accepted
    assert at.read_envelope(at.BUNDLE_MEDIA_TYPE, at.stored(at.BUNDLE_MEDIA_TYPE, env, "h")) == env
    assert at.read_envelope(at.DSSE_MEDIA_TYPE, at.stored(at.DSSE_MEDIA_TYPE, env, "h")) == env
    for kind, data, words in ((at.BUNDLE_MEDIA_TYPE, b"[]", "holds no DSSE envelope"), (at.DSSE_MEDIA_TYPE, b"nope", "not JSON"),
                              (at.DSSE_MEDIA_TYPE, json.dumps({**env, "payloadType": "text/plain"}).encode(), "is not application/vnd.in-toto+json")):
        with pytest.raises(at.NotAccepted, match=re.escape(words)):
            at.read_envelope(kind, data)


def attested(registry, keys, tmp_path: Path, repo: str, pattern: int, signer: str | None, passed: bool = True, lazy: bool = False) -> tuple[str, str]:
    """An image with a boot-test attestation attached without a boot (by cosign-format key `signer`,
    or GPG key g when "g"; None: no attestation)."""
    if lazy:
        disk = make_qcow2(tmp_path / f"{repo.replace('/', '-')}-{pattern}.qcow2", size="8M", pattern=pattern)
        ref = f"{registry.host}/{repo}:v1"
        r = run_diskkit("build", NOREG, "--lazy", disk, "-t", ref)
        assert r.code == 0, r.err
        ref, digest = ref, r.last_line
    else:
        ref, digest = build(registry, tmp_path, repo, pattern)
    if signer is not None:
        opts = SignOptions(None, sign_by=keys["g"]) if signer == "g" else SignOptions(keys["dir"] / f"{signer}.private", keys["pass"])
        Attester(opts).attach(ref, digest, predicate(ref, digest, passed), PLAIN)
    return ref, digest


def cached(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for area in ("disks", "refs", "tmp", "lazy") for p in (cache / area).rglob("*") if p.is_file())


def test_a_required_boot_test_is_enforced_before_a_pull_reads_a_layer(registry, keys, tmp_path):
    """--require-boot-test-key / --require-boot-test-gpg-key: "a policy can require 'signed and
    boot-tested'" (issue 25 item 5) without a policy.json requirement type containers/image would
    refuse (signature/policy_config.go: "Unknown policy requirement type")."""
    good, _ = attested(registry, keys, tmp_path, "require/good", 0x31, "a")
    bare, bare_digest = attested(registry, keys, tmp_path, "require/bare", 0x32, None)
    failed, failed_digest = attested(registry, keys, tmp_path, "require/failed", 0x33, "a", passed=False)
    by_b, b_digest = attested(registry, keys, tmp_path, "require/byb", 0x34, "b")
    moved, old_digest = attested(registry, keys, tmp_path, "require/moved", 0x35, "a")
    (tmp_path / "rebuilt").mkdir()
    moved, new_digest = build(registry, tmp_path / "rebuilt", "require/moved", 0x36)  # the tag moves past the attested digest
    gpg_signed, _ = attested(registry, keys, tmp_path, "require/gpg", 0x37, "g")
    a_pub, b_pub = keys["dir"] / "a.pub", keys["dir"] / "b.pub"

    def pull(ref: str, *flags):
        cache = tmp_path / f"cache-{ref.rsplit('/', 1)[1].replace(':', '-')}-{len(flags)}"
        return run_launcher("pull", NOREG, *map(str, flags), "--cache-dir", cache, ref), cache

    ok, cache = pull(good, "--require-boot-test-key", a_pub)
    assert ok.code == 0, ok.err
    assert cached(cache), "the accepted image was not pulled"
    ok, _ = pull(gpg_signed, "--require-boot-test-gpg-key", keys["dir"] / "g.gpg")
    assert ok.code == 0, ok.err
    ok, _ = pull(by_b, "--require-boot-test-key", a_pub, "--require-boot-test-key", b_pub)  # any one of the keys
    assert ok.code == 0, ok.err
    for ref, digest, why in ((bare, bare_digest, f"no attestation refers to {bare_digest}"),
                             (failed, failed_digest, "the boot test failed"),
                             (by_b, b_digest, "the signature does not verify with the given keys"),
                             (moved, new_digest, f"no attestation refers to {new_digest}")):
        r, cache = pull(ref, "--require-boot-test-key", a_pub)
        line = refusal(r)
        assert line.startswith(f"launcher: docker://{ref}: no passed boot-test attestation of {digest} signed by {a_pub} (launcher test --attest-*): "), line
        assert why in line, line
        assert cached(cache) == [] if cache.exists() else True, f"{ref} refused but cached"
    assert old_digest != new_digest
    # without the requirement the same images pull as before
    assert pull(bare)[0].code == 0


def test_the_disk_server_requires_the_boot_test_it_was_started_with(registry, keys, tmp_path):
    """`launcher domain --lazy` (as `launcher run --lazy`) passes the requirement to the disk server it
    spawns; that server then refuses an unattested image even to a request that names no keys."""
    from tests.lazyhost import control, stop_spawned_server
    from tests.test_lazy_dryrun import write_vmi

    good, _ = attested(registry, keys, tmp_path, "require/lazygood", 0x41, "a", lazy=True)
    bare, bare_digest = attested(registry, keys, tmp_path, "require/lazybare", 0x42, None, lazy=True)
    flags = ("--require-boot-test-key", keys["dir"] / "a.pub")
    cache = tmp_path / "cache"
    try:
        out = run_launcher("domain", "--accel", "qemu", "--cache-dir", cache, NOREG, "--lazy", *flags, write_vmi(tmp_path / "good.json", good))
        assert out.code == 0, out.err
        refused = run_launcher("domain", "--accel", "qemu", "--cache-dir", cache, NOREG, "--lazy", *flags, write_vmi(tmp_path / "bare.json", bare))
        assert "no passed boot-test attestation of" in refusal(refused)
        answer = control(cache, {"op": "open", "path": None, "image": bare, "registry": {"tls_verify": False}})
        assert answer["ok"] is False, answer
        assert f"{bare}: no passed boot-test attestation of {bare_digest}" in answer["error"], answer
        assert [p for p in (cache / "lazy").rglob("*") if p.is_file() and "lazybare" in str(p)] == [] if (cache / "lazy").exists() else True
    finally:
        stop_spawned_server(cache)


def test_diskkit_copy_and_inspect_require_the_boot_test_too(registry, keys, tmp_path):
    good, _ = attested(registry, keys, tmp_path, "require/dkgood", 0x51, "a")
    bare, bare_digest = attested(registry, keys, tmp_path, "require/dkbare", 0x52, None)
    flags = ("--require-boot-test-key", keys["dir"] / "a.pub")
    assert run_diskkit("inspect", NOREG, *map(str, flags), good).code == 0
    copied = run_diskkit("copy", NOREG, *map(str, flags), f"docker://{good}", f"oci:{tmp_path / 'good-layout'}:v1")
    assert copied.code == 0, copied.err
    line = refusal(run_diskkit("inspect", NOREG, *map(str, flags), bare))
    assert f"no passed boot-test attestation of {bare_digest}" in line, line
    line = refusal(run_diskkit("copy", NOREG, *map(str, flags), f"docker://{bare}", f"oci:{tmp_path / 'bare-layout'}:v1"))
    assert f"no passed boot-test attestation of {bare_digest}" in line, line
    assert not (tmp_path / "bare-layout").exists(), "a refused copy wrote its destination"
