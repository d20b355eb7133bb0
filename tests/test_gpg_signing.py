"""GPG simple signing in a lookaside store, both ways with the real peers: Debian's skopeo 1.9 and
podman 4.3 (built with gpgme), gpg with a private GNUPGHOME made here, a distribution registry and
a file:// lookaside named by a registries.d directory.

Refusal words are containers/image's: signature/policy_eval_signedby.go, simple.go,
mechanism_gpgme.go and internal/signature/signature.go (FromBlob), docker/registries_d.go.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from diskkit.signing import openpgp
from diskkit.signing.payload import ATOMIC_TYPE, make_payload
from tests.conftest import make_qcow2, run_diskkit, run_launcher
from tests.gnupg import gnupg_home, gpg, new_key

NOREG = "--tls-verify=false"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """A GNUPGHOME with keys a, b and a passphrase-protected p; their public keyrings (binary and
    armoured); a registries.d whose default-docker lookaside is a file:// directory."""
    if shutil.which("gpg") is None:
        pytest.fail("gpg is not installed (scripts/setup.sh installs gnupg)")
    d = tmp_path_factory.mktemp("gpg")
    home = d / "home"
    home.mkdir(mode=0o700)
    out = {"home": home, "dir": d}
    for name, phrase in (("a", ""), ("b", ""), ("p", "sesame")):
        fpr = new_key(home, f"{name} <{name}@diskkit.test>", phrase)
        out[name] = fpr
        (d / f"{name}.gpg").write_bytes(gpg(home, "--export", fpr))
        (d / f"{name}.asc").write_bytes(gpg(home, "--armor", "--export", fpr))
    (d / "pass").write_text("sesame\n")
    (d / "wrong").write_text("not it\n")
    out["lookaside"] = d / "lookaside"
    regd = d / "registries.d"
    regd.mkdir()
    (regd / "default.yaml").write_text(f"default-docker:\n  lookaside: file://{out['lookaside']}\n")
    out["regd"] = regd
    with gnupg_home(home):  # every diskkit, skopeo and podman run here signs from it
        yield out


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Path:
    return make_qcow2(tmp_path_factory.mktemp("disk") / "gpg.qcow2", size="16M", pattern=0x5A)


def policy(path: Path, scope: str, requirement: dict) -> Path:
    path.write_text(json.dumps({"default": [{"type": "reject"}], "transports": {"docker": {scope: [requirement]}}}))
    return path


def signed_by(keys: dict, *names: str, armoured: bool = False, **extra) -> dict:
    files = [str(keys["dir"] / f"{n}.{'asc' if armoured else 'gpg'}") for n in names]
    return {"type": "signedBy", "keyType": "GPGKeys", **({"keyPath": files[0]} if len(files) == 1 else {"keyPaths": files}), **extra}


def build(disk: Path, ref: str, *flags) -> str:
    r = run_diskkit("build", NOREG, "--no-lazy", disk, "-t", ref, *map(str, flags))
    assert r.code == 0, r.err
    return r.last_line


def sig_dir(keys: dict, ref: str, digest: str) -> Path:
    repo = ref.split("/", 1)[1].rsplit(":", 1)[0]
    return keys["lookaside"] / f"{repo}@sha256={digest.split(':')[1]}"


def skopeo_copy(keys: dict, pol: Path, ref: str, dest: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["skopeo", "--policy", str(pol), "--registries.d", str(keys["regd"]), "copy", "--src-tls-verify=false",
                           *extra, f"docker://{ref}", dest], capture_output=True, text=True, check=False)


def inspect(keys: dict, pol: Path, ref: str):
    return run_diskkit("inspect", NOREG, "--signature-policy", pol, "--registries.d", keys["regd"], ref)


def one_line(r) -> str:
    """The refusal: one line, after at most the build's notes (a layer an earlier test's build left in
    the registry is reported as not sent)."""
    lines = [line for line in r.err.strip().splitlines() if not line.startswith("note: ")]
    assert r.code != 0 and len(lines) == 1, r.err
    return lines[0]


def test_diskkit_signs_and_skopeo_accepts_only_that_key(registry, keys, disk, tmp_path):
    ref = f"{registry.host}/gpg/mine:v1"
    digest = build(disk, ref, "--registries.d", keys["regd"], "--sign-by", keys["a"])
    assert sorted(p.name for p in sig_dir(keys, ref, digest).iterdir()) == ["signature-1"]
    good = policy(tmp_path / "a.json", f"{registry.host}/gpg", signed_by(keys, "a"))
    ok = skopeo_copy(keys, good, ref, f"dir:{tmp_path}/out")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "out/signature-1").read_bytes() == (sig_dir(keys, ref, digest) / "signature-1").read_bytes()  # dir: keeps it
    bad = policy(tmp_path / "b.json", f"{registry.host}/gpg", signed_by(keys, "b"))
    refused = skopeo_copy(keys, bad, ref, f"dir:{tmp_path}/out2")
    assert refused.returncode != 0 and "Source image rejected" in refused.stderr, refused.stderr
    assert not (tmp_path / "out2/manifest.json").exists()  # skopeo makes the directory, but copies nothing
    # diskkit itself, with the key as binary keyring, armoured keyring and keyData, and both keys.
    for req in (signed_by(keys, "a"), signed_by(keys, "a", armoured=True), signed_by(keys, "b", "a"),
                {"type": "signedBy", "keyType": "GPGKeys", "keyData": base64.b64encode((keys["dir"] / "a.gpg").read_bytes()).decode()}):
        r = inspect(keys, policy(tmp_path / "p.json", f"{registry.host}/gpg", req), ref)
        assert r.code == 0, (req, r.err)
    line = one_line(inspect(keys, bad, ref))
    assert ref in line and "Invalid GPG signature: No public key" in line, line


def test_a_second_signature_is_appended_and_any_one_suffices(registry, keys, disk, tmp_path):
    ref = f"{registry.host}/gpg/twice:v1"
    digest = build(disk, ref, "--registries.d", keys["regd"], "--sign-by", keys["b"])
    again = run_diskkit("copy", NOREG, "--registries.d", keys["regd"], "--sign-by", keys["a"], f"docker://{ref}", f"docker://{ref}")
    assert again.code == 0, again.err
    assert sorted(p.name for p in sig_dir(keys, ref, digest).iterdir()) == ["signature-1", "signature-2"]
    assert inspect(keys, policy(tmp_path / "a.json", f"{registry.host}/gpg", signed_by(keys, "a")), ref).code == 0
    assert inspect(keys, policy(tmp_path / "b.json", f"{registry.host}/gpg", signed_by(keys, "b")), ref).code == 0
    # Two requirements: both must hold; p signed neither.
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"default": [{"type": "reject"}], "transports": {"docker": {
        f"{registry.host}/gpg": [signed_by(keys, "a"), signed_by(keys, "p")]}}}))
    line = one_line(inspect(keys, both, ref))
    assert "None of the signatures were accepted, reasons:" in line, line


def test_skopeo_signs_and_diskkit_and_the_launcher_accept(registry, keys, disk, tmp_path):
    plain = f"{registry.host}/gpg/plain:v1"
    build(disk, plain)
    ref = f"{registry.host}/gpg/byskopeo:v1"
    anything = tmp_path / "any.json"
    anything.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
    proc = subprocess.run(["skopeo", "--policy", str(anything), "--registries.d", str(keys["regd"]), "copy", "--src-tls-verify=false",
                           "--dest-tls-verify=false", "--sign-by", keys["a"], f"docker://{plain}", f"docker://{ref}"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    pol = policy(tmp_path / "a.json", f"{registry.host}/gpg", signed_by(keys, "a"))
    assert inspect(keys, pol, ref).code == 0
    cache = tmp_path / "cache"
    home = tmp_path / "home"
    (home / ".config/containers").mkdir(parents=True)
    shutil.copytree(keys["regd"], home / ".config/containers/registries.d")
    shutil.copy(pol, home / ".config/containers/policy.json")
    pulled = run_launcher("pull", NOREG, "--cache-dir", cache, ref, env={"HOME": str(home)})
    assert pulled.code == 0, pulled.err
    refused = run_launcher("pull", NOREG, "--cache-dir", tmp_path / "cache2", plain, env={"HOME": str(home)})
    assert "A signature was required, but no signature exists" in one_line(refused)


def _sign_as(keys, key: str, reference: str, digest: str) -> bytes:
    return openpgp.sign(make_payload(reference, digest, kind=ATOMIC_TYPE), keys[key])


def test_the_negative_matrix_is_refused_in_one_line_with_nothing_cached(registry, keys, disk, tmp_path):
    ref = f"{registry.host}/gpg/matrix:v1"
    digest = build(disk, ref)
    other = build(make_qcow2(tmp_path / "o.qcow2", size="16M", pattern=0x11), f"{registry.host}/gpg/other:v1")
    where = sig_dir(keys, ref, digest)
    good = _sign_as(keys, "a", ref, digest)
    # Uncompressed, so one byte of the signed payload itself can be changed.
    plain = gpg(keys["home"], "--compress-algo", "none", "--local-user", keys["a"], "--sign", data=make_payload(ref, digest, kind=ATOMIC_TYPE))
    tampered = plain.replace(b"matrix", b"mAtrix", 1)
    assert tampered != plain
    flipped = bytearray(plain)
    flipped[-3] ^= 0x01  # in the signature value itself (the last packet), not in a packet header
    armour = gpg(keys["home"], "--armor", "--local-user", keys["a"], "--sign", data=make_payload(ref, digest, kind=ATOMIC_TYPE))
    cases = {
        "unsigned": (None, "A signature was required, but no signature exists"),
        "another key": (_sign_as(keys, "b", ref, digest), "Invalid GPG signature: No public key"),
        "tampered payload": (tampered, "Invalid GPG signature: Bad signature"),
        "bit-flipped": (bytes(flipped), "Invalid GPG signature: Bad signature"),
        "another digest": (_sign_as(keys, "a", ref, other), f"Signature for digest {other} does not match"),
        "another repository": (_sign_as(keys, "a", f"{registry.host}/gpg/other:v1", digest), f'Signature for identity "{registry.host}/gpg/other:v1" is not accepted'),
        "garbage": (b"\x99garbage", "unrecognized signature format, starting with binary 0x99"),
        "ascii armour": (armour, "unrecognized signature format, starting with binary 0x2d"),
        # Some KiB of compressed packets that expand to 8 MiB: read no further than the limit.
        "payload bomb": (gpg(keys["home"], "--compress-level", "9", "--local-user", keys["a"], "--sign", data=bytes(8 << 20)), "signed payload larger than 4 MiB"),
    }
    pol = policy(tmp_path / "a.json", f"{registry.host}/gpg", signed_by(keys, "a"))
    home = tmp_path / "home"
    (home / ".config/containers").mkdir(parents=True)
    shutil.copytree(keys["regd"], home / ".config/containers/registries.d")
    shutil.copy(pol, home / ".config/containers/policy.json")
    for case, (blob, words) in cases.items():
        shutil.rmtree(where, ignore_errors=True)
        if blob is not None:
            where.mkdir(parents=True)
            (where / "signature-1").write_bytes(blob)
        line = one_line(inspect(keys, pol, ref))
        assert words in line, (case, line)
        cache = tmp_path / f"cache-{case.replace(' ', '-')}"
        pulled = run_launcher("pull", NOREG, "--cache-dir", cache, ref, env={"HOME": str(home)})
        assert words in one_line(pulled), (case, pulled.err)
        assert [p for p in cache.rglob("*") if p.is_file()] == [] if cache.exists() else True, case
        skopeo = skopeo_copy(keys, pol, ref, f"dir:{tmp_path}/sk")
        assert skopeo.returncode != 0, (case, skopeo.stderr)  # the peer refuses each one too
    shutil.rmtree(where)


def test_a_passphrase_key_signs_and_a_wrong_passphrase_moves_nothing(registry, keys, disk, tmp_path):
    ref = f"{registry.host}/gpg/phrase:v1"
    base = ["--registries.d", keys["regd"], "--sign-by", keys["p"]]
    # First the wrong one, while gpg-agent has not cached the right one.
    subprocess.run(["gpgconf", "--homedir", str(keys["home"]), "--kill", "gpg-agent"], check=False)
    r = run_diskkit("build", NOREG, "--no-lazy", disk, "-t", ref, *base, "--sign-passphrase-file", keys["dir"] / "wrong")
    line = one_line(r)
    assert keys["p"] in line and "Bad passphrase" in line, line
    missing = run_diskkit("inspect", NOREG, f"docker://{ref}")
    assert missing.code != 0, "the tag appeared although signing failed"
    digest = build(disk, ref, *base, "--sign-passphrase-file", keys["dir"] / "pass")
    pol = policy(tmp_path / "p.json", f"{registry.host}/gpg", signed_by(keys, "p"))
    assert inspect(keys, pol, ref).code == 0
    assert (sig_dir(keys, ref, digest) / "signature-1").is_file()


def test_standalone_signatures_verify_both_ways_with_skopeo(registry, keys, disk, tmp_path):
    ref = f"{registry.host}/gpg/alone:v1"
    build(disk, ref)
    manifest = tmp_path / "manifest.json"
    manifest.write_bytes(subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}"], capture_output=True, check=True).stdout)
    mine, theirs = tmp_path / "by-diskkit", tmp_path / "by-skopeo"
    r = run_diskkit("standalone-sign", manifest, ref, keys["p"], "-o", mine, "--passphrase-file", keys["dir"] / "pass")
    assert r.code == 0, r.err
    proc = subprocess.run(["skopeo", "standalone-sign", str(manifest), ref, keys["a"], "-o", str(theirs)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    digest = "sha256:" + __import__("hashlib").sha256(manifest.read_bytes()).hexdigest()
    for sig, key in ((mine, "p"), (theirs, "a")):
        # skopeo 1.9 has no --public-key-file: it verifies with the keyring of $GNUPGHOME.
        proc = subprocess.run(["skopeo", "standalone-verify", str(manifest), ref, keys[key], str(sig)], capture_output=True, text=True, check=False)
        r = run_diskkit("standalone-verify", "--public-key-file", keys["dir"] / f"{key}.gpg", manifest, ref, keys[key], sig)
        assert proc.stdout.startswith("Signature verified") and f"digest {digest}" in proc.stdout, (sig, proc.stderr)  # 1.9's words
        assert f"Signature verified using fingerprint {keys[key]}, digest {digest}" in r.out, (sig, r.err)  # today's skopeo's
        # "any" key of the file; and the user's own keyring without a file.
        assert run_diskkit("standalone-verify", "--public-key-file", keys["dir"] / f"{key}.asc", manifest, ref, "any", sig).code == 0
        assert run_diskkit("standalone-verify", manifest, ref, keys[key], sig).code == 0
    refusals = [
        (["--public-key-file", keys["dir"] / "b.gpg", manifest, ref, "any", mine], "Invalid GPG signature: No public key"),
        (["--public-key-file", keys["dir"] / "a.gpg", manifest, ref, keys["b"], theirs], f"Signature by key {keys['a']} is not accepted"),
        (["--public-key-file", keys["dir"] / "a.gpg", manifest, f"{registry.host}/gpg/else:v1", "any", theirs], "does not match"),
        ([manifest, ref, "any", theirs], "Cannot use any fingerprint without a public key file"),
    ]
    other = tmp_path / "other.json"
    other.write_bytes(manifest.read_bytes() + b"\n")
    refusals.append((["--public-key-file", keys["dir"] / "a.gpg", other, ref, "any", theirs], f'Signature for docker digest "{digest}" does not match'))
    for args, words in refusals:
        assert words in one_line(run_diskkit("standalone-verify", *args)), (args, words)


def test_podman_pulls_under_the_policy_and_signs_what_diskkit_accepts(registry, keys, disk, tmp_path):
    from tests.engines import podman_env

    ref = f"{registry.host}/gpg/forpodman:v1"
    build(disk, ref, "--registries.d", keys["regd"], "--sign-by", keys["a"])
    root = tmp_path / "podman"
    root.mkdir()
    # podman takes no --registries.d: it reads $HOME/.config/containers/registries.d when that exists.
    home = tmp_path / "home"
    (home / ".config/containers").mkdir(parents=True)
    shutil.copytree(keys["regd"], home / ".config/containers/registries.d")
    env = {**os.environ, **podman_env(root), "HOME": str(home)}

    def podman(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["podman", *args], capture_output=True, text=True, env=env, check=False)

    good = policy(tmp_path / "a.json", f"{registry.host}/gpg", signed_by(keys, "a"))
    bad = policy(tmp_path / "b.json", f"{registry.host}/gpg", signed_by(keys, "b"))
    refused = podman("pull", "--tls-verify=false", "--signature-policy", str(bad), f"docker://{ref}")
    assert refused.returncode != 0 and "Source image rejected" in refused.stderr, refused.stderr
    pulled = podman("pull", "--tls-verify=false", "--signature-policy", str(good), f"docker://{ref}")
    assert pulled.returncode == 0, pulled.stderr
    # podman signs on push; diskkit and the launcher's policy accept it.
    pushed_ref = f"{registry.host}/gpg/bypodman:v1"
    # --remove-signatures: the pulled copy carries a's signature, which the recompressed push would invalidate.
    pushed = podman("push", "--tls-verify=false", "--remove-signatures", "--sign-by", keys["b"], ref, f"docker://{pushed_ref}")
    assert pushed.returncode == 0, pushed.stderr
    assert inspect(keys, policy(tmp_path / "pb.json", f"{registry.host}/gpg", signed_by(keys, "b")), pushed_ref).code == 0
    line = one_line(inspect(keys, good, pushed_ref))
    assert "Invalid GPG signature: No public key" in line, line


def test_vm_boots_a_gpg_signed_image_and_an_unsigned_one_is_refused_before_caching(registry, keys, qemu_user, tmp_path):
    """The node reads the lookaside over http:// (tests/fileserver.py), as a site's signature server."""
    from tests.fileserver import FileServer
    from tests.testguest import ensure_testguest, parse_console
    from tests.vmhost import QEMU_UID, assert_clean

    guest = ensure_testguest() / "testguest-poweroff.qcow2"
    signed = f"{registry.host}/gpgvm/guest:v1"
    build(guest, signed, "--registries.d", keys["regd"], "--sign-by", keys["a"])
    unsigned = f"{registry.host}/gpgvmu/guest:v1"
    build(guest, unsigned)
    served = FileServer(keys["lookaside"])
    try:
        conf = qemu_user.home / ".config/containers"
        (conf / "registries.d").mkdir(parents=True)
        (conf / "registries.d/site.yaml").write_text(f"default-docker:\n  lookaside: {served.base}\n")
        key_data = base64.b64encode((keys["dir"] / "a.gpg").read_bytes()).decode()  # the qemu user cannot read our files
        (conf / "policy.json").write_text(json.dumps({"default": [{"type": "reject"}], "transports": {"docker": {
            registry.host: [{"type": "signedBy", "keyType": "GPGKeys", "keyData": key_data}]}}}))
        for path in [qemu_user.home / ".config", *(qemu_user.home / ".config").rglob("*")]:
            os.chown(path, QEMU_UID, QEMU_UID)

        refused = qemu_user.launcher("run", NOREG, "--console", "--timeout", "180", qemu_user.write_vmi("unsigned", unsigned))
        line = one_line(refused)
        assert unsigned in line and "A signature was required, but no signature exists" in line, line
        cache = qemu_user.cache
        assert not cache.exists() or [p for a in ("disks", "refs", "tmp") for p in (cache / a).rglob("*") if p.is_file()] == []
        assert_clean(qemu_user, "default_unsigned")

        booted = qemu_user.launcher("run", NOREG, "--console", "--timeout", "180", qemu_user.write_vmi("signed", signed))
        assert booted.code == 0, booted.err
        console = parse_console(booted.out)
        assert console["ready"] and console["done"], booted.out
        assert_clean(qemu_user, "default_signed")
    finally:
        served.close()


def test_a_signature_that_cannot_be_stored_leaves_no_tag(registry, keys, disk, tmp_path):
    """The signature is stored before the manifest is PUT (skopeo PUTs first): when the store fails
    after the key worked, the tag never appears. Also: lookaside-staging is where signatures are
    written, lookaside where they are read."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the staging directory would be\n")
    regd = tmp_path / "registries.d"
    regd.mkdir()
    (regd / "gpg.yaml").write_text(f"docker:\n  {registry.host}/gpg:\n    lookaside: file://{keys['lookaside']}\n"
                                   f"    lookaside-staging: file://{blocker}\n")
    ref = f"{registry.host}/gpg/unstored:v1"
    line = one_line(run_diskkit("build", NOREG, "--no-lazy", disk, "-t", ref, "--registries.d", regd, "--sign-by", keys["a"]))
    assert str(blocker) in line and "cannot store the signature" in line, line
    assert run_diskkit("inspect", NOREG, f"docker://{ref}").code != 0, "the tag appeared although its signature was not stored"
    staging = tmp_path / "staging"
    (regd / "gpg.yaml").write_text(f"docker:\n  {registry.host}/gpg:\n    sigstore: file://{keys['lookaside']}\n"
                                   f"    sigstore-staging: file://{staging}\n")  # the older names
    digest = build(disk, ref, "--registries.d", regd, "--sign-by", keys["a"])
    assert (staging / f"gpg/unstored@sha256={digest.split(':')[1]}/signature-1").is_file()
    pol = policy(tmp_path / "a.json", f"{registry.host}/gpg", signed_by(keys, "a"))
    assert "no signature exists" in one_line(run_diskkit("inspect", NOREG, "--signature-policy", pol, "--registries.d", regd, ref))
    shutil.copytree(staging / "gpg", keys["lookaside"] / "gpg", dirs_exist_ok=True)  # what a site's publishing step does
    assert run_diskkit("inspect", NOREG, "--signature-policy", pol, "--registries.d", regd, ref).code == 0


def test_registries_d_lookaside_longest_prefix_and_layout(tmp_path):
    from diskkit.oci.reference import parse_docker_name
    from diskkit.signing import lookaside, registriesd
    from diskkit.signing.policy import identity_of, namespaces_of

    (tmp_path / "a.yaml").write_text("default-docker:\n  lookaside: https://sigs.example/default\n"
                                     "docker:\n  reg.example/ns:\n    lookaside: https://sigs.example/ns\n"
                                     "  reg.example/ns/img:\n    use-sigstore-attachments: true\n"
                                     "  reg.example/ns/img:v2:\n    sigstore: file:///exact\n")
    config = registriesd.load(tmp_path)

    def base(text: str, write: bool = False) -> str:
        name = parse_docker_name(text)
        return registriesd.lookaside_base(config, identity_of(name), namespaces_of(name), name.repository, write)

    assert base("reg.example/ns/img:v1") == "https://sigs.example/ns/ns/img"  # img sets no lookaside: ns does
    assert base("reg.example/ns/img:v2") == "file:///exact/ns/img"
    assert base("other.example/x/y:1") == "https://sigs.example/default/x/y"
    digest = "sha256:" + "ab" * 32
    assert lookaside.signature_url(base("reg.example/ns/img:v1"), digest, 0) == f"https://sigs.example/ns/ns/img@sha256={'ab' * 32}/signature-1"
    with pytest.raises(Exception, match="Writing directly to a https lookaside is not supported"):
        lookaside.writable_dir(base("reg.example/ns/img:v1", write=True), digest)


def test_copy_carries_signatures_as_skopeo_and_remove_signatures_drops_them(registry, keys, disk, tmp_path):
    ref = f"{registry.host}/gpg/carried:v1"
    digest = build(disk, ref, "--registries.d", keys["regd"], "--sign-by", keys["a"])
    regd = ["--registries.d", keys["regd"]]
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert run_diskkit("copy", NOREG, *regd, f"docker://{ref}", f"dir:{ours}").code == 0
    anything = tmp_path / "any.json"
    anything.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
    assert skopeo_copy(keys, anything, ref, f"dir:{theirs}").returncode == 0
    assert (ours / "signature-1").read_bytes() == (theirs / "signature-1").read_bytes()
    assert not (ours / "signature-2").exists() and not (theirs / "signature-2").exists()
    # From dir: to another repository: the signature follows the digest into that repository's lookaside.
    moved = f"{registry.host}/gpg/moved:v1"
    pushed = run_diskkit("copy", NOREG, *regd, f"dir:{ours}", f"docker://{moved}")
    assert pushed.code == 0, pushed.err
    assert (sig_dir(keys, moved, digest) / "signature-1").read_bytes() == (ours / "signature-1").read_bytes()
    pinned = policy(tmp_path / "pinned.json", f"{registry.host}/gpg/moved",
                    signed_by(keys, "a", signedIdentity={"type": "exactRepository", "dockerRepository": f"{registry.host}/gpg/carried"}))
    assert skopeo_copy(keys, pinned, moved, f"dir:{tmp_path}/peer").returncode == 0
    assert inspect(keys, pinned, moved).code == 0
    # A copy onto itself adds nothing; a destination that keeps no signatures is refused, unless asked.
    assert run_diskkit("copy", NOREG, *regd, f"docker://{ref}", f"docker://{ref}").code == 0
    assert sorted(p.name for p in sig_dir(keys, ref, digest).iterdir()) == ["signature-1"]
    refused = one_line(run_diskkit("copy", NOREG, *regd, f"docker://{ref}", f"oci:{tmp_path}/layout:v1"))
    assert "Can not copy signatures" in refused and "--remove-signatures" in refused, refused
    assert not (tmp_path / "layout").exists()
    assert run_diskkit("copy", NOREG, *regd, "--remove-signatures", f"docker://{ref}", f"oci:{tmp_path}/layout:v1").code == 0
    # A copy that would rewrite the signed manifest is refused, as skopeo refuses it.
    rewrite = one_line(run_diskkit("copy", NOREG, *regd, "--format", "v2s2", f"docker://{ref}", f"dir:{tmp_path}/v2s2"))
    assert "Would invalidate signatures" in rewrite, rewrite
    bare = tmp_path / "bare"
    assert run_diskkit("copy", NOREG, *regd, "--remove-signatures", f"docker://{ref}", f"dir:{bare}").code == 0
    assert not (bare / "signature-1").exists()


def test_the_lazy_disk_server_checks_gpg_signatures_before_serving(registry, keys, disk, tmp_path):
    from tests.lazyhost import control, disk_server

    signed = f"{registry.host}/gpglazy/signed:v1"
    r = run_diskkit("build", NOREG, "--lazy", disk, "-t", signed, "--registries.d", keys["regd"], "--sign-by", keys["a"])
    assert r.code == 0, r.err
    unsigned = f"{registry.host}/gpglazy/unsigned:v1"
    assert run_diskkit("build", NOREG, "--lazy", make_qcow2(tmp_path / "u.qcow2", size="16M", pattern=0x22), "-t", unsigned).code == 0
    home = tmp_path / "home"
    (home / ".config/containers").mkdir(parents=True)
    shutil.copytree(keys["regd"], home / ".config/containers/registries.d")
    policy(home / ".config/containers/policy.json", f"{registry.host}/gpglazy", signed_by(keys, "a"))
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, env={"HOME": str(home)}):
        ask = {"op": "open", "path": None, "registry": {"tls_verify": False}}
        refused = control(cache, {**ask, "image": unsigned})
        assert refused["ok"] is False and "A signature was required, but no signature exists" in refused["error"], refused
        lazy = cache / "lazy"
        assert not lazy.exists() or [p for p in lazy.rglob("*") if p.is_file()] == [], "the refused image left lazy files"
        opened = control(cache, {**ask, "image": signed})
        assert opened["ok"], opened


def test_a_datavolume_registry_import_needs_the_gpg_signature(registry, keys, disk, tmp_path):
    import yaml

    signed = f"{registry.host}/gpgdv/signed:v1"
    build(disk, signed, "--registries.d", keys["regd"], "--sign-by", keys["a"])
    unsigned = f"{registry.host}/gpgdv/unsigned:v1"
    build(disk, unsigned)
    home = tmp_path / "home"
    (home / ".config/containers").mkdir(parents=True)
    shutil.copytree(keys["regd"], home / ".config/containers/registries.d")
    policy(home / ".config/containers/policy.json", f"{registry.host}/gpgdv", signed_by(keys, "a"))
    manifests = tmp_path / "k8s"
    manifests.mkdir()
    args = ["--manifests", str(manifests)]
    for name, ref in (("signed", signed), ("unsigned", unsigned)):
        doc = {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume", "metadata": {"name": name},
               "spec": {"source": {"registry": {"url": f"docker://{ref}"}}, "storage": {"resources": {"requests": {"storage": "24Mi"}}}}}
        (manifests / f"datavolume-{name}.yaml").write_text(yaml.safe_dump(doc))
        (tmp_path / f"claim-{name}").mkdir()
        args += ["--pvc", f"{name}={tmp_path / f'claim-{name}'}"]
    refused = run_launcher("dv", "import", NOREG, "unsigned", *args, env={"HOME": str(home)})
    assert refused.code != 0 and "A signature was required, but no signature exists" in refused.err, refused.err
    assert not (tmp_path / "claim-unsigned/disk.img").exists()
    imported = run_launcher("dv", "import", NOREG, "signed", *args, env={"HOME": str(home)})
    assert imported.code == 0, imported.err
    assert (tmp_path / "claim-signed/disk.img").is_file()


def test_an_index_and_each_of_its_images_are_signed(registry, keys, disk, tmp_path):
    ref = f"{registry.host}/gpg/multi:v1"
    r = run_diskkit("build", NOREG, "--no-lazy", "--platform", f"linux/amd64={disk}", "--platform", f"linux/arm64={disk}", "-t", ref,
                    "--registries.d", keys["regd"], "--sign-by", keys["a"], "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert len(out["signed"]) == 3 and out["signed"][-1] == out["digest"], out["signed"]
    for digest in out["signed"]:
        assert (sig_dir(keys, ref, digest) / "signature-1").is_file()
    pol = policy(tmp_path / "a.json", f"{registry.host}/gpg", signed_by(keys, "a"))
    proc = skopeo_copy(keys, pol, ref, f"dir:{tmp_path}/all", "--all")
    assert proc.returncode == 0, proc.stderr
    assert run_diskkit("copy", NOREG, "--registries.d", keys["regd"], "--signature-policy", pol, "--all", f"docker://{ref}", f"dir:{tmp_path}/ours").code == 0


def test_the_atomic_payload_is_read_as_strictly_as_containers_image(keys, tmp_path):
    from diskkit.signing.payload import InvalidPayload, parse_payload

    digest = "sha256:" + "1" * 64
    made = make_payload("reg.example/a/b:1", digest, timestamp=5, kind=ATOMIC_TYPE)
    assert parse_payload(made, ATOMIC_TYPE) == ("reg.example/a/b:1", digest)
    doc = json.loads(made)
    for broken, words in (({**doc, "optional": {"timestamp": 1.5}}, "Field optional.timestamp is not an integer"),
                          ({**doc, "extra": 1}, "unexpected field extra"),
                          ({**doc, "critical": {**doc["critical"], "type": "cosign container image signature"}}, "Unrecognized signature type")):
        with pytest.raises(InvalidPayload, match=words):
            parse_payload(json.dumps(broken).encode(), ATOMIC_TYPE)
    # A keyring with no public key in it accepts nothing (policy_eval_signedby.go).
    with pytest.raises(openpgp.InvalidSignature, match="No public keys imported"):
        openpgp.verify(_sign_as(keys, "a", "reg.example/a/b:1", digest), [b"not a keyring"])


def test_every_tag_of_a_build_is_signed_as_itself(registry, keys, disk, tmp_path):
    """Three -t of one build, two in one repository: each tag gets a signature naming it, stored before
    its manifest is put, and skopeo pulls each tag under a signedBy policy (matchRepoDigestOrExact needs
    the exact tag in the signature's identity)."""
    first, second, other = (f"{registry.host}/gpg/tags:a", f"{registry.host}/gpg/tags:b", f"{registry.host}/gpg/elsewhere:c")
    result = run_diskkit("build", NOREG, "--no-lazy", "--registries.d", keys["regd"], "--sign-by", keys["a"], disk,
                         "-t", first, "-t", second, "-t", other)
    assert result.code == 0, result.err
    digest = result.last_line
    assert sorted(p.name for p in sig_dir(keys, first, digest).iterdir()) == ["signature-1", "signature-2"]
    assert sorted(p.name for p in sig_dir(keys, other, digest).iterdir()) == ["signature-1"]
    good = policy(tmp_path / "a.json", f"{registry.host}/gpg", signed_by(keys, "a"))
    for n, ref in enumerate((first, second, other)):
        ok = skopeo_copy(keys, good, ref, f"dir:{tmp_path}/out{n}")
        assert ok.returncode == 0, (ref, ok.stderr)


def test_a_dir_image_is_checked_on_its_signature_files_as_skopeo_does(registry, keys, disk, tmp_path):
    """dir: keeps simple signatures as signature-N files (containers/image directory/directory_src.go);
    a dir: image has no Docker reference, so only exactReference and exactRepository identities can
    match it (signature/policy_reference_match.go parseImageAndDockerReference): skopeo and diskkit agree."""
    ref = f"{registry.host}/gpg/indir:v1"
    build(disk, ref, "--registries.d", keys["regd"], "--sign-by", keys["a"])
    carried = skopeo_copy(keys, policy(tmp_path / "any.json", "", {"type": "insecureAcceptAnything"}), ref, f"dir:{tmp_path}/img")
    assert carried.returncode == 0 and (tmp_path / "img/signature-1").is_file(), carried.stderr

    def dir_policy(name: str, requirement: dict) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"default": [{"type": "reject"}], "transports": {"dir": {"": [requirement]}}}))
        return path

    def both(pol: Path) -> tuple[bool, object]:
        peer = subprocess.run(["skopeo", "--policy", str(pol), "copy", f"dir:{tmp_path}/img", f"dir:{tmp_path}/peer-{pol.stem}"],
                              capture_output=True, text=True, check=False)
        return peer.returncode == 0, run_diskkit("inspect", "--signature-policy", pol, f"dir:{tmp_path}/img")

    exact = dir_policy("exact.json", signed_by(keys, "a", signedIdentity={"type": "exactReference", "dockerReference": ref}))
    peer, ours = both(exact)
    assert peer and ours.code == 0, ours.err
    repo = dir_policy("repo.json", signed_by(keys, "a", signedIdentity={"type": "exactRepository", "dockerRepository": ref.rsplit(":", 1)[0]}))
    peer, ours = both(repo)
    assert peer and ours.code == 0, ours.err
    default = dir_policy("default.json", signed_by(keys, "a"))  # matchRepoDigestOrExact: no name to match
    peer, ours = both(default)
    assert not peer and f'Signature for identity "{ref}" is not accepted' in one_line(ours)
    other = dir_policy("other.json", signed_by(keys, "b", signedIdentity={"type": "exactReference", "dockerReference": ref}))
    peer, ours = both(other)
    assert not peer and "Invalid GPG signature: No public key" in one_line(ours)
    (tmp_path / "img/signature-1").unlink()
    peer, ours = both(exact)
    assert not peer and "A signature was required, but no signature exists" in one_line(ours)


def test_an_https_lookaside_is_read_with_the_registrys_tls_settings(tls_registry, keys, disk, tmp_path):
    """containers/image reads an http(s) lookaside with the registry's own client (docker/
    docker_image_src.go getOneSignature uses s.c.client): --cert-dir / certs.d of the registry hold
    for its lookaside too. skopeo and diskkit both accept it with the CA given, and refuse a
    lookaside whose certificate that CA did not sign."""
    from tests.distribution import make_tls_files
    from tests.fileserver import FileServer

    ref = f"{tls_registry.host}/gpg/https:v1"
    r = run_diskkit("build", "--cert-dir", tls_registry.ca_dir, "--no-lazy", disk, "-t", ref, "--registries.d", keys["regd"], "--sign-by", keys["a"])
    assert r.code == 0, r.err
    pol = policy(tmp_path / "a.json", f"{tls_registry.host}/gpg", signed_by(keys, "a"))
    ca_dir = Path(tls_registry.ca_dir)
    served = {"same-ca": (ca_dir.parent / "server.crt", ca_dir.parent / "server.key")}
    _, cert, key = make_tls_files(tmp_path / "other-ca" / "ca")
    served["other-ca"] = (cert, key)
    for name, tls in served.items():
        with FileServer(keys["lookaside"], tls=tls) as server:
            regd = tmp_path / f"regd-{name}"
            regd.mkdir()
            (regd / "default.yaml").write_text(f"default-docker:\n  lookaside: {server.base}\n")
            ours = run_diskkit("inspect", "--cert-dir", ca_dir, "--signature-policy", pol, "--registries.d", regd, ref)
            peer = subprocess.run(["skopeo", "--policy", str(pol), "--registries.d", str(regd), "copy", "--src-cert-dir", str(ca_dir),
                                   f"docker://{ref}", f"dir:{tmp_path}/peer-{name}"], capture_output=True, text=True, check=False)
            if name == "same-ca":
                assert ours.code == 0, ours.err
                assert peer.returncode == 0, peer.stderr
                # a copy carries the signature it read there
                out = tmp_path / "copied"
                copied = run_diskkit("copy", "--src-cert-dir", ca_dir, "--registries.d", regd, f"docker://{ref}", f"dir:{out}")
                assert copied.code == 0, copied.err
                assert (out / "signature-1").read_bytes() == (peer_dir := tmp_path / f"peer-{name}" / "signature-1").read_bytes(), peer_dir
            else:
                assert peer.returncode != 0 and "certificate" in peer.stderr, peer.stderr
                line = one_line(ours)
                assert server.base in line and "SSLError" in line, line
