"""`diskkit promote SRC@DIGEST DEST --tags ...` (issue 32 item 4): the tested digest, copied whole (an
index never narrowed) to another repository or registry, under every tag, each tag read back."""

from __future__ import annotations

import json
import uuid

from tests.conftest import make_qcow2, run
from tests.faultproxy import Fault

INSECURE = "--tls-verify=false"


def new_repo(registry, what: str = "promote") -> str:
    return f"{registry.host}/{what}-{uuid.uuid4().hex[:8]}"


def skopeo_digest(ref: str, *flags: str) -> str:
    return json.loads(run("skopeo", "inspect", "--tls-verify=false", *flags, f"docker://{ref}").stdout)["Digest"]


def build_index(diskkit, tmp_path, ref: str) -> str:
    x86, arm = make_qcow2(tmp_path / "x86.qcow2"), make_qcow2(tmp_path / "arm.qcow2", pattern=2)
    built = diskkit("build", "--platform", f"linux/amd64={x86}", "--platform", f"linux/arm64={arm}", "-t", ref, INSECURE)
    assert built.code == 0, built.err
    return built.last_line


def test_promote_copies_an_index_whole_under_every_tag(diskkit, registry, tmp_path):
    ci, release = new_repo(registry, "ci"), new_repo(registry, "release")
    digest = build_index(diskkit, tmp_path, f"{ci}:build-1")
    result = diskkit("promote", INSECURE, "--json", f"{ci}@{digest}", release, "--tags", "40-2611251200,40", "--tags", "latest")
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert out["digest"] == digest and out["tags"] == ["40-2611251200", "40", "latest"] and out["repository"] == release
    # the same registry: every blob is mounted from the CI repository, none uploaded again
    assert out["blobs"] and set(out["blobs"].values()) <= {"mounted", "skipped"}, out["blobs"]
    for tag in ("40-2611251200", "40", "latest"):
        assert skopeo_digest(f"{release}:{tag}") == digest  # skopeo, reading on its own
    raw = json.loads(run("skopeo", "inspect", "--raw", INSECURE, f"docker://{release}:40").stdout)
    assert sorted(m["platform"]["architecture"] for m in raw["manifests"]) == ["amd64", "arm64"]
    for child in raw["manifests"]:  # each platform's image came along, by digest
        assert skopeo_digest(f"{release}@{child['digest']}") == child["digest"]


def test_promote_to_another_registry_with_its_own_credentials(diskkit, registry, auth_registry, qcow2):
    ci = new_repo(registry, "ci")
    built = diskkit("build", qcow2, "-t", f"{ci}:build-2", INSECURE)
    assert built.code == 0, built.err
    digest = built.last_line
    release = new_repo(auth_registry, "release")
    denied = diskkit("promote", INSECURE, f"{ci}@{digest}", release, "--tags", "v1")
    assert denied.code == 6 and "denied" in denied.err, denied.err  # Exit.AUTH: no credentials for the destination
    creds = f"{auth_registry.username}:{auth_registry.password}"
    result = diskkit("promote", INSECURE, "--dest-creds", creds, f"{ci}@{digest}", release, "--tags", "v1,stable")
    assert result.code == 0 and result.last_line == digest, result.err
    for tag in ("v1", "stable"):
        assert skopeo_digest(f"{release}:{tag}", "--creds", creds) == digest


def test_promote_refuses_a_tag_source_and_bad_tags(diskkit, registry, qcow2):
    ci = new_repo(registry, "ci")
    assert diskkit("build", qcow2, "-t", f"{ci}:build-3", INSECURE).code == 0
    by_tag = diskkit("promote", INSECURE, f"{ci}:build-3", f"{ci}-release", "--tags", "v1")
    assert by_tag.code == 1 and "give the source as REPOSITORY@sha256:" in by_tag.err and len(by_tag.err.strip().splitlines()) == 1
    digest = skopeo_digest(f"{ci}:build-3")
    for tags, rule in (("a,a", "--tags a: named twice"), ("ok,no/slash", "--tags no/slash: not a valid tag"), (",", "--tags: not a valid tag")):
        bad = diskkit("promote", INSECURE, f"{ci}@{digest}", f"{ci}-release", "--tags", tags)
        assert bad.code == 1 and rule in bad.err, bad.err
    with_tag = diskkit("promote", INSECURE, f"{ci}@{digest}", f"{ci}-release:v1", "--tags", "v2")
    assert with_tag.code == 1 and "without a tag or digest" in with_tag.err, with_tag.err


def test_promote_reads_every_tag_back_and_fails_when_one_points_elsewhere(diskkit, registry, fault_proxy, qcow2, tmp_path):
    ci, release = new_repo(registry, "ci"), new_repo(registry, "release")
    digest = diskkit("build", qcow2, "-t", f"{ci}:build-4", INSECURE).last_line
    other = diskkit("build", make_qcow2(tmp_path / "other.qcow2", pattern=3), "-t", f"{release}:decoy", INSECURE).last_line
    assert other != digest
    proxy = fault_proxy(registry)
    # A registry that answers for tag 40 with another image's manifest: the push "worked", the tag lies.
    proxy.add(Fault("HEAD", r"/manifests/40$", "rewrite", times=100, to="/manifests/decoy"))
    result = diskkit("promote", INSECURE, f"{ci}@{digest}", release.replace(registry.host, proxy.host), "--tags", "40")
    assert result.code == 1, result.err
    assert f":40: points at {other}, not the promoted {digest}" in result.err and len(result.err.strip().splitlines()) == 1, result.err
