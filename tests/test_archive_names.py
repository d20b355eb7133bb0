"""docker-archive:FILE:NAME and :@N on archives written by docker, buildah and skopeo (podman-style names),
read side by side with skopeo (containers/image docker/archive compares normalised names)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

from tests.conftest import make_qcow2, run_diskkit
from tests.engines import podman_env


def skopeo_raw(ref: str) -> tuple[int, bytes]:
    proc = subprocess.run(["skopeo", "inspect", "--raw", ref], capture_output=True)
    return proc.returncode, proc.stdout


def ours_raw(ref: str) -> tuple[int, bytes]:
    proc = subprocess.run([sys.executable, "-m", "diskkit", "inspect", "--raw", ref], capture_output=True)
    return proc.returncode, proc.stdout


def blobs(manifest: bytes) -> list:
    obj = json.loads(manifest)
    return [(d["digest"], d["size"]) for d in [obj["config"], *obj["layers"]]]


def repo_tags(path) -> list:
    with tarfile.open(path) as tar:
        return [t for e in json.load(tar.extractfile("manifest.json")) for t in e.get("RepoTags") or []]


@pytest.fixture(scope="module")
def archives(tmp_path_factory, dockerd) -> dict:
    root = tmp_path_factory.mktemp("names")
    disk = make_qcow2(root / "d.qcow2", "16M", 0x44)
    layout = f"oci:{root / 'l'}:v1"
    assert run_diskkit("build", disk, "-t", layout).code == 0
    out = {}
    for kind, name in (("skopeo", "x:1"), ("podman-style", "localhost/x:1")):
        subprocess.run(["skopeo", "copy", layout, f"docker-archive:{root / kind}.tar:{name}"], check=True, capture_output=True)
        out[kind] = root / f"{kind}.tar"
    # docker save writes the short form.
    assert run_diskkit("push", layout, "docker-daemon:x:1", env=dockerd.env).code == 0
    with open(root / "docker.tar", "wb") as f:
        for chunk in dockerd.client().api.get_image("x:1"):
            f.write(chunk)
    out["docker"] = root / "docker.tar"
    # buildah names its local images localhost/NAME and pushes both forms when given a name.
    store = root / "buildah"
    store.mkdir()
    env = {**os.environ, **podman_env(store)}
    subprocess.run(["buildah", "pull", "-q", layout], check=True, capture_output=True, env=env)
    image_id = subprocess.run(["buildah", "images", "-q"], check=True, capture_output=True, text=True, env=env).stdout.split()[0]
    subprocess.run(["buildah", "tag", image_id, "x:1"], check=True, capture_output=True, env=env)
    subprocess.run(["buildah", "push", "-q", "x:1", f"docker-archive:{root / 'buildah.tar'}"], check=True, capture_output=True, env=env)
    subprocess.run(["buildah", "push", "-q", "x:1", f"docker-archive:{root / 'buildah-named.tar'}:x:1"], check=True, capture_output=True, env=env)
    out["buildah"], out["buildah-named"] = root / "buildah.tar", root / "buildah-named.tar"
    return out


@pytest.mark.parametrize("kind, tags, names", [
    ("skopeo", ["docker.io/library/x:1"], ["x:1", "docker.io/library/x:1"]),
    ("docker", ["x:1"], ["x:1", "docker.io/library/x:1"]),
    ("podman-style", ["localhost/x:1"], ["localhost/x:1"]),
    ("buildah", ["localhost/x:1"], ["localhost/x:1"]),
    ("buildah-named", ["docker.io/library/x:1", "localhost/x:1"], ["x:1", "localhost/x:1"]),
])
def test_names_match_as_skopeo_matches_them(archives, kind, tags, names):
    path = archives[kind]
    assert repo_tags(path) == tags
    for name in [*names, "@0"]:
        ref = f"docker-archive:{path}:{name}"
        theirs, ours = skopeo_raw(ref), ours_raw(ref)
        # An archive stores no manifest: both synthesise one naming the same blobs. (skopeo 1.9 labels
        # the plain layer ...diff.tar.gzip; ours says what it is, ...diff.tar.)
        assert theirs[0] == ours[0] == 0, ref
        assert blobs(ours[1]) == blobs(theirs[1]), ref
    for name in ("other:1", "@1"):
        ref = f"docker-archive:{path}:{name}"
        assert skopeo_raw(ref)[0] != 0 and ours_raw(ref)[0] != 0


def test_missing_index_and_tag_say_what_skopeo_says(archives):
    path = archives["skopeo"]
    result = run_diskkit("inspect", "--raw", f"docker-archive:{path}:@3")
    assert "Invalid source index @3, only 1 manifest items available" in result.err
    result = run_diskkit("inspect", "--raw", f"docker-archive:{path}:y:2")
    assert 'Tag "docker.io/library/y:2" not found' in result.err


def test_index_is_refused_as_a_destination(archives, tmp_path):
    result = run_diskkit("push", f"docker-archive:{archives['docker']}:@0", f"docker-archive:{tmp_path / 'o.tar'}:@0")
    assert result.code != 0 and "@N only selects a source image" in result.err and not (tmp_path / "o.tar").exists()
