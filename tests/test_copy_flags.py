"""skopeo copy/inspect's flags on `diskkit push`/`diskkit copy` and `diskkit inspect`, each run side
by side with skopeo 1.9 on the same inputs (loopback registries from tests/distribution.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_qcow2, run_diskkit


def skopeo(home: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "REGISTRY_AUTH_FILE": str(home / "none.json"), "XDG_RUNTIME_DIR": str(home)}
    return subprocess.run(["skopeo", *map(str, args)], capture_output=True, env=env, timeout=120)


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("flags")
    disk = make_qcow2(root / "d.qcow2", "16M", 0x19)
    single, multi = root / "single", root / "multi"
    assert run_diskkit("build", disk, "-t", f"oci:{single}:v1").code == 0
    assert run_diskkit("build", "--platform", f"linux/amd64={disk}", "--platform", f"linux/arm64={disk}", "-t", f"oci:{multi}:v1").code == 0
    home = root / "home"
    home.mkdir()
    return {"single": f"oci:{single}:v1", "multi": f"oci:{multi}:v1", "home": home}


def test_copy_is_push_with_per_side_flags(built, tls_registry, auth_registry, registry, tmp_path):
    """TLS source with its CA, authenticated destination over plain HTTP, then on to a third
    registry: each side's flags apply to that side only, for skopeo and for us."""
    home = built["home"]
    tls_src = f"docker://{tls_registry.host}/flags/x:v1"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    assert run_diskkit("copy", "--dest-cert-dir", tls_registry.ca_dir, built["single"], tls_src, env={"TMPDIR": str(tmp)}).code == 0
    assert not list(tmp.iterdir())  # the CA bundle made for --cert-dir is gone with the process
    creds = f"{auth_registry.username}:{auth_registry.password}"
    for who, dest in (("ours", "ours"), ("skopeo", "theirs")):
        target = f"docker://{auth_registry.host}/flags/{dest}:v1"
        flags = ["--src-cert-dir", tls_registry.ca_dir, "--dest-tls-verify=false", "--dest-creds", creds]
        if who == "ours":
            result = run_diskkit("copy", *flags, tls_src, target)
            assert result.code == 0, result.err
        else:
            proc = skopeo(home, "copy", *flags, tls_src, target)
            assert proc.returncode == 0, proc.stderr
    raw = {}
    for dest in ("ours", "theirs"):
        proc = skopeo(home, "inspect", "--raw", "--tls-verify=false", "--creds", creds, f"docker://{auth_registry.host}/flags/{dest}:v1")
        assert proc.returncode == 0, proc.stderr
        raw[dest] = proc.stdout
    assert raw["ours"] == raw["theirs"]
    # The source's flags do not leak to the destination: without --dest-creds the push is refused.
    denied = run_diskkit("copy", "--src-cert-dir", tls_registry.ca_dir, "--dest-tls-verify=false", tls_src, f"docker://{auth_registry.host}/flags/no:v1")
    assert denied.code != 0
    # Nor the other way round: --dest-tls-verify=false does not relax the TLS source.
    strict = run_diskkit("copy", "--dest-tls-verify=false", tls_src, f"docker://{registry.host}/flags/no:v1")
    assert strict.code != 0


def test_multi_arch_all_and_system_as_skopeo(built, tmp_path):
    home = built["home"]
    for mode in ("all", "system"):
        ours, theirs = tmp_path / f"ours-{mode}", tmp_path / f"theirs-{mode}"
        result = run_diskkit("copy", "--multi-arch", mode, built["multi"], f"dir:{ours}")
        assert result.code == 0, result.err
        proc = skopeo(home, "copy", "--multi-arch", mode, built["multi"], f"dir:{theirs}")
        assert proc.returncode == 0, proc.stderr
        assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
        assert (ours / "manifest.json").read_bytes() == (theirs / "manifest.json").read_bytes()


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", ["multi", "single"])
def test_multi_arch_index_only_as_skopeo(built, kind, tmp_path, registry):
    """containers/image copy/multiple.go: CopySpecificImages with no instances writes the index,
    descriptors unchanged, and copies none of its images; a single image is copied as always."""
    home = built["home"]
    for transport in ("dir", "oci"):
        ours, theirs = tmp_path / f"ours-{transport}", tmp_path / f"theirs-{transport}"
        dest = (lambda p: f"dir:{p}") if transport == "dir" else (lambda p: f"oci:{p}:v1")
        result = run_diskkit("copy", "--multi-arch", "index-only", built[kind], dest(ours))
        assert result.code == 0, result.err
        proc = skopeo(home, "copy", "--multi-arch", "index-only", built[kind], dest(theirs))
        assert proc.returncode == 0, proc.stderr
        mine, skopeos = tree(ours), tree(theirs)
        if transport == "oci":  # index.json and oci-layout are written by each tool in its own spelling
            assert json.loads(mine.pop("index.json"))["manifests"] == json.loads(skopeos.pop("index.json"))["manifests"]
            assert json.loads(mine.pop("oci-layout")) == json.loads(skopeos.pop("oci-layout"))
        assert mine == skopeos
        source = built[kind].removeprefix("oci:").rsplit(":", 1)[0]
        top = json.loads(Path(source, "index.json").read_text())["manifests"][0]["digest"]
        assert result.out.strip() == top
        if kind == "multi":  # the index alone: no config, no layer, no instance manifest came along
            blobs = [name for name in mine if name.startswith("blobs/")] if transport == "oci" else [n for n in mine if n != "version"]
            assert len(blobs) == 1, sorted(mine)
    if kind == "multi":
        # A Docker list into an OCI layout becomes an OCI index; the descriptors keep their
        # instances' Docker types, since the instances are not copied (so not converted).
        listed = tmp_path / "v2s2"
        assert run_diskkit("copy", "--format", "v2s2", "--multi-arch", "all", built[kind], f"dir:{listed}").code == 0
        ours, theirs = tmp_path / "ours-list", tmp_path / "theirs-list"
        result = run_diskkit("copy", "--multi-arch", "index-only", f"dir:{listed}", f"oci:{ours}:v1")
        assert result.code == 0, result.err
        proc = skopeo(home, "copy", "--multi-arch", "index-only", f"dir:{listed}", f"oci:{theirs}:v1")
        assert proc.returncode == 0, proc.stderr
        (index,) = json.loads((ours / "index.json").read_text())["manifests"]
        mine = json.loads((ours / "blobs" / "sha256" / index["digest"][7:]).read_bytes())
        (index,) = json.loads((theirs / "index.json").read_text())["manifests"]
        skopeos = json.loads((theirs / "blobs" / "sha256" / index["digest"][7:]).read_bytes())
        assert mine["mediaType"] == skopeos["mediaType"] == "application/vnd.oci.image.index.v1+json"
        assert mine["manifests"] == skopeos["manifests"]
        assert {m["mediaType"] for m in mine["manifests"]} == {"application/vnd.docker.distribution.manifest.v2+json"}
        refused = run_diskkit("copy", "--preserve-digests", "--multi-arch", "index-only", f"dir:{listed}", f"oci:{tmp_path / 'kept'}:v1")
        assert refused.code != 0 and "--preserve-digests" in refused.err
        # A registry takes the index only when its images are in the repository already (the
        # distribution registry checks the descriptors): refused for both, then accepted.
        for who in ("ours", "theirs"):
            target = f"docker://{registry.host}/indexonly/{who}"
            if who == "ours":
                assert run_diskkit("copy", "--dest-tls-verify=false", "--multi-arch", "index-only", built[kind], f"{target}:v1").code != 0
            else:
                assert skopeo(home, "copy", "--dest-tls-verify=false", "--multi-arch", "index-only", built[kind], f"{target}:v1").returncode != 0
            assert run_diskkit("copy", "--dest-tls-verify=false", "--multi-arch", "all", built[kind], f"{target}:all").code == 0
        result = run_diskkit("copy", "--dest-tls-verify=false", "--multi-arch", "index-only", built[kind], f"docker://{registry.host}/indexonly/ours:v1")
        assert result.code == 0, result.err
        proc = skopeo(home, "copy", "--dest-tls-verify=false", "--multi-arch", "index-only", built[kind], f"docker://{registry.host}/indexonly/theirs:v1")
        assert proc.returncode == 0, proc.stderr
        raw = [skopeo(home, "inspect", "--raw", "--tls-verify=false", f"docker://{registry.host}/indexonly/{who}:v1").stdout for who in ("ours", "theirs")]
        assert raw[0] == raw[1] and sha(raw[0]) == result.out.strip()
    both = run_diskkit("copy", "--all", "--multi-arch", "all", built[kind], f"dir:{tmp_path / 'both'}")
    assert both.code != 0 and "Cannot use --all and --multi-arch flags together" in both.err
    assert skopeo(home, "copy", "--all", "--multi-arch", "all", built[kind], f"dir:{tmp_path / 'both2'}").returncode != 0
    # docker-archive holds one image: refused by both, nothing left behind.
    archive = tmp_path / "one.tar"
    refused = run_diskkit("copy", "--multi-arch", "index-only", built[kind], f"docker-archive:{archive}:x:v1")
    theirs = skopeo(home, "copy", "--multi-arch", "index-only", built[kind], f"docker-archive:{tmp_path / 'theirs.tar'}:x:v1")
    if kind == "multi":
        assert refused.code != 0 and "--multi-arch index-only" in refused.err and not archive.exists()
        assert theirs.returncode != 0 and b"does not support copying multiple images" in theirs.stderr
    else:
        assert refused.code == 0 and theirs.returncode == 0, (refused.err, theirs.stderr)


def test_preserve_digests_refuses_a_rewrite_and_allows_a_plain_copy(built, tmp_path):
    archive = tmp_path / "d.tar"
    # An archive stores plain layers: the manifest must change, which --preserve-digests forbids.
    refused = run_diskkit("copy", "--preserve-digests", built["single"], f"docker-archive:{archive}:x:v1")
    assert refused.code != 0 and "--preserve-digests" in refused.err and not archive.exists()
    assert skopeo(built["home"], "copy", "--preserve-digests", built["single"], f"docker-archive:{tmp_path / 's.tar'}:x:v1").returncode != 0
    kept = run_diskkit("copy", "--preserve-digests", built["single"], f"dir:{tmp_path / 'd'}")
    assert kept.code == 0, kept.err
    assert kept.out.strip() == sha((tmp_path / "d" / "manifest.json").read_bytes())


@pytest.mark.parametrize("kind", ["single", "multi"])
def test_inspect_raw_and_config_as_skopeo(built, kind):
    home = built["home"]
    ref = built[kind]
    for flags in (["--raw"], ["--config", "--raw"], ["--config"]):
        result = subprocess.run([sys.executable, "-m", "diskkit", "inspect", *flags, ref], capture_output=True)
        assert result.returncode == 0, result.stderr
        theirs = skopeo(home, "inspect", *flags, ref)
        assert theirs.returncode == 0, theirs.stderr
        if flags == ["--config"]:
            assert json.loads(result.stdout) == json.loads(theirs.stdout)
        else:
            assert result.stdout == theirs.stdout, flags


def test_archive_layers_are_gzipped_for_a_registry_as_skopeo_does(built, registry, tmp_path):
    import gzip

    archive = tmp_path / "d.tar"
    assert run_diskkit("push", built["single"], f"docker-archive:{archive}:x:v1").code == 0
    home = built["home"]
    manifests = {}
    for who in ("ours", "theirs"):
        target = f"docker://{registry.host}/gz/{who}:v1"
        if who == "ours":
            result = run_diskkit("copy", "--dest-tls-verify=false", f"docker-archive:{archive}", target)
            assert result.code == 0, result.err
        else:
            proc = skopeo(home, "copy", "--dest-tls-verify=false", f"docker-archive:{archive}", target)
            assert proc.returncode == 0, proc.stderr
        proc = skopeo(home, "inspect", "--raw", "--tls-verify=false", target)
        manifests[who] = json.loads(proc.stdout)
    ours, theirs = manifests["ours"], manifests["theirs"]
    assert [l["mediaType"] for l in ours["layers"]] == [l["mediaType"] for l in theirs["layers"]] == ["application/vnd.docker.image.rootfs.diff.tar.gzip"]
    assert ours["config"]["digest"] == theirs["config"]["digest"]
    # Same content under both compressions: the layer un-gzips to the diffID.
    proc = skopeo(home, "copy", "--src-tls-verify=false", f"docker://{registry.host}/gz/ours:v1", f"dir:{tmp_path / 'back'}")
    assert proc.returncode == 0, proc.stderr
    layer = (tmp_path / "back" / ours["layers"][0]["digest"].split(":")[1]).read_bytes()
    config = json.loads((tmp_path / "back" / ours["config"]["digest"].split(":")[1]).read_bytes())
    assert sha(gzip.decompress(layer)) == config["rootfs"]["diff_ids"][0]


@pytest.mark.parametrize("kind, flags", [("single", []), ("multi", ["--all"])])
def test_format_v2s2_and_back_to_oci_as_skopeo(built, tmp_path, kind, flags):
    home = built["home"]
    for fmt, src in (("v2s2", built[kind]), ("oci", None)):
        src = src or f"dir:{tmp_path / 'theirs-v2s2'}"
        ours_src = src.replace("theirs-", "ours-")
        ours, theirs = tmp_path / f"ours-{fmt}", tmp_path / f"theirs-{fmt}"
        result = run_diskkit("copy", *flags, "--format", fmt, ours_src, f"dir:{ours}")
        assert result.code == 0, result.err
        proc = skopeo(home, "copy", *flags, "--format", fmt, src, f"dir:{theirs}")
        assert proc.returncode == 0, proc.stderr
        our_top, their_top = json.loads((ours / "manifest.json").read_bytes()), json.loads((theirs / "manifest.json").read_bytes())
        assert our_top["mediaType"] == their_top["mediaType"]
        for key in ("layers", "manifests"):
            if key in their_top:
                assert [(d["mediaType"], d.get("platform")) for d in our_top[key]] == [(d["mediaType"], d.get("platform")) for d in their_top[key]]
        if fmt == "v2s2":
            # schema2 keeps the config's bytes: the same blobs, and manifests that differ only in
            # key order (Go's struct order against our sorted keys).
            assert contents(ours) == contents(theirs)


def contents(root: Path) -> tuple[set[str], list[str]]:
    """(blob files, every manifest re-serialised with sorted keys, digests of children left out)."""
    blobs = {p.name for p in root.iterdir() if not p.name.endswith("manifest.json")}
    manifests = []
    for path in root.glob("*manifest.json"):
        obj = json.loads(path.read_bytes())
        for child in obj.get("manifests") or []:
            child.pop("digest"), child.pop("size")
        manifests.append(json.dumps(obj, sort_keys=True))
    return blobs, sorted(manifests)


def test_format_v2s2_refuses_zstd_as_skopeo_does(built, tmp_path):
    disk = make_qcow2(tmp_path / "d.qcow2", "8M")
    layout = f"oci:{tmp_path / 'z'}:v1"
    assert run_diskkit("build", disk, "--compression", "zstd", "-t", layout).code == 0
    result = run_diskkit("copy", "--format", "v2s2", layout, f"dir:{tmp_path / 'o'}")
    assert result.code != 0 and "zstd compression is not supported for docker images" in result.err
    assert skopeo(built["home"], "copy", "--format", "v2s2", layout, f"dir:{tmp_path / 's'}").returncode != 0
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt", ["zstd", "gzip"])
def test_dest_compress_format_as_skopeo(built, tmp_path, fmt):
    """gzip layers re-encoded as zstd, zstd ones as gzip: same media type and content as skopeo's."""
    home = built["home"]
    src = built["single"]
    if fmt == "gzip":
        src = f"oci:{tmp_path / 'zstd'}:v1"
        assert run_diskkit("build", make_qcow2(tmp_path / "d.qcow2", "8M"), "--compression", "zstd", "-t", src).code == 0
    for flags in ([], ["--dest-compress"]):
        ours, theirs = tmp_path / f"ours{len(flags)}", tmp_path / f"theirs{len(flags)}"
        result = run_diskkit("copy", *flags, "--dest-compress-format", fmt, "--dest-compress-level", "3", src, f"dir:{ours}")
        assert result.code == 0, result.err
        proc = skopeo(home, "copy", *flags, "--dest-compress-format", fmt, src, f"dir:{theirs}")
        assert proc.returncode == 0, proc.stderr
        assert layer_facts(ours) == layer_facts(theirs)
        media, plain, diff_id = layer_facts(ours)
        # dir: keeps layers as they are unless told --dest-compress, for skopeo as for us.
        assert plain == diff_id and media.endswith(fmt) == bool(flags)
    layout = tmp_path / "layout"
    assert run_diskkit("copy", "--dest-compress-format", fmt, src, f"oci:{layout}:v1").code == 0
    assert skopeo(home, "copy", "--dest-compress-format", fmt, src, f"oci:{tmp_path / 'sk-layout'}:v1").returncode == 0
    assert run_diskkit("inspect", "--raw", f"oci:{layout}:v1").out.count(f"tar+{fmt}") == 1
    assert skopeo(home, "inspect", "--raw", f"oci:{tmp_path / 'sk-layout'}:v1").stdout.decode().count(f"tar+{fmt}") == 1


def layer_facts(root: Path) -> tuple[str, str, str]:
    """(layer media type, digest of its uncompressed bytes, the config's diffID)."""
    import gzip

    import zstandard

    manifest = json.loads((root / "manifest.json").read_bytes())
    config = json.loads((root / manifest["config"]["digest"].split(":")[1]).read_bytes())
    data = (root / manifest["layers"][0]["digest"].split(":")[1]).read_bytes()
    plain = zstandard.ZstdDecompressor().decompressobj().decompress(data) if data[:4] == b"\x28\xb5\x2f\xfd" else gzip.decompress(data)
    return manifest["layers"][0]["mediaType"], sha(plain), config["rootfs"]["diff_ids"][0]


def test_authfile_applies_to_its_side_only(built, auth_registry, tmp_path):
    home = built["home"]
    authfile = auth_registry.auth_file(tmp_path / "auth.json")
    target = f"docker://{auth_registry.host}/flags/authfile:v1"
    for side, expect in (("--dest-authfile", True), ("--src-authfile", False)):
        ours = run_diskkit("copy", "--dest-tls-verify=false", side, authfile, built["single"], target)
        theirs = skopeo(home, "copy", "--dest-tls-verify=false", side, authfile, built["single"], target)
        assert (ours.code == 0) == (theirs.returncode == 0) == expect, (side, ours.err, theirs.stderr)
