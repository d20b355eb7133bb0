"""The pure parts: reference parsing, qcow2 headers, KubeVirt's path rules, in-image path resolution."""

from __future__ import annotations

import subprocess

import pytest

from diskkit.disk import diskheader
from diskkit.disk.containerdisk import path_problem
from diskkit.errors import DiskkitError
from diskkit.layers.imagefs import Node, Tree, clean_member_name
from diskkit.oci.reference import parse_ref


@pytest.mark.parametrize(
    "text,expected",
    [
        ("oci:/tmp/layout:v1", ("oci", "/tmp/layout", "v1")),
        ("oci:./layout", ("oci", "./layout", None)),
        ("oci-archive:img.tar:latest", ("oci-archive", "img.tar", "latest")),
    ],
)
def test_local_refs(text, expected):
    ref = parse_ref(text)
    assert (ref.transport, ref.path, ref.tag) == expected


def test_docker_refs_are_normalised_like_distribution():
    assert str(parse_ref("docker://fedora").name) == "docker.io/library/fedora:latest"
    assert str(parse_ref("quay.io/containerdisks/fedora:40").name) == "quay.io/containerdisks/fedora:40"
    assert parse_ref("localhost:5000/x/y@sha256:" + "a" * 64).name.reference == "sha256:" + "a" * 64
    archive = parse_ref("docker-archive:d.tar:quay.io/me/x:2")
    assert archive.name.familiar() == "quay.io/me/x:2"
    assert parse_ref("docker-archive:d.tar:fedora").name.familiar() == "fedora:latest"


def test_engine_refs_as_containers_image_reads_them():
    # docker/daemon/daemon_transport.go and storage/storage_transport.go in containers/image.
    assert str(parse_ref("docker-daemon:fedora:40")) == "docker-daemon:fedora:40"
    assert str(parse_ref("docker-daemon:quay.io/me/x@sha256:" + "b" * 64)) == "docker-daemon:quay.io/me/x@sha256:" + "b" * 64
    assert parse_ref("docker-daemon:sha256:" + "c" * 64).tag == "sha256:" + "c" * 64
    assert str(parse_ref("containers-storage:fedora")) == "containers-storage:docker.io/library/fedora:latest"
    assert str(parse_ref("containers-storage:localhost/x:1")) == "containers-storage:localhost/x:1"
    assert parse_ref("containers-storage:" + "d" * 64).tag == "d" * 64


@pytest.mark.parametrize("text", [
    "nonsense", "docker://UPPER/case", "ostree:x", "oci:", "docker://h/r@sha256:short", "docker-daemon:fedora",
    "docker-daemon:sha512:" + "a" * 128, "containers-storage:[vfs@/a+/b]x", "containers-storage:Upper",
])
def test_bad_refs(text):
    with pytest.raises(DiskkitError):
        parse_ref(text)


def test_qcow2_header_finds_backing_and_data_file(tmp_path):
    plain, backed, external = tmp_path / "p.qcow2", tmp_path / "b.qcow2", tmp_path / "e.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(plain), "10M"], check=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", "/etc/passwd", "-F", "raw", str(backed)], check=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", f"data_file={tmp_path / 'x.raw'}", str(external), "10M"], check=True)
    p = diskheader.parse(plain.read_bytes()[:65536])
    assert p.virtual_size == 10 << 20 and diskheader.safety_violations(p) == []
    b = diskheader.parse(backed.read_bytes()[:65536])
    assert diskheader.safety_violations(b) == ["expected no backing file, but found /etc/passwd"]
    e = diskheader.parse(external.read_bytes()[:65536])
    assert diskheader.safety_violations(e) == [f"expected no external data file, but found {tmp_path / 'x.raw'}"]
    assert diskheader.parse(b"\0" * 512) is None
    assert diskheader.probe_format(b"KDMV" + b"\0" * 100) == "vmdk"
    assert diskheader.probe_format(b"\0" * 512) == "raw"


@pytest.mark.parametrize(
    "path,problem",
    [
        ("/disk/x.qcow2", None),
        ("/", "must not point to root"),
        ("/a/../b", "must be an absolute path to a file without relative components"),
        ("a/b", "must be an absolute path to a file without relative components"),
        ("/a/./b", "must be an absolute path to a file without relative components"),
        # pkg/storage/admitters/disks.go ValidatePath: one trailing slash is trimmed before comparing
        ("/disk/x.qcow2/", None),
        ("/disk/x.qcow2//", "must be an absolute path to a file without relative components"),
        ("//disk/x.qcow2", "must be an absolute path to a file without relative components"),
        ("/a//b", "must be an absolute path to a file without relative components"),
    ],
)
def test_kubevirt_path_validation(path, problem):
    assert path_problem(path) == problem


def test_member_names():
    assert clean_member_name("./disk/x") == "disk/x"
    assert clean_member_name("disk/") == "disk"
    assert clean_member_name("a/../b") == "b"
    assert clean_member_name("../x") is None
    assert clean_member_name("a/../../x") is None
    assert clean_member_name("/etc/passwd") is None


def _node(path, kind="file", link=""):
    return Node(path, kind, 0o444, 107, 107, 1, link, 0)


def test_symlinks_resolve_inside_the_root():
    tree = Tree({p: n for n in [_node("disk", "dir"), _node("real", "dir"), _node("real/d"), _node("disk/l", "symlink", "../../../real/d"), _node("disk/loop", "symlink", "loop")] for p in [n.path]})
    node, real, climbed = tree.resolve("disk/l")
    assert (node.path, real, climbed) == ("real/d", "real/d", True)
    node, _, _ = tree.resolve("disk/loop")
    assert node is None
