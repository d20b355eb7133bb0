"""Where KubeVirt finds the disk in a containerDisk image, and whether it can use it (pure rules).

Messages are KubeVirt's own where it has one (pkg/container-disk, the VMI validating webhook).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the rules only read a tree: the VMI's parser, which checks paths, needs no tar reader
    from diskkit.layers.imagefs import Node, Tree

DISK_DIR = "disk"
QEMU_UID = QEMU_GID = 107


def path_problem(path: str) -> str | None:
    """KubeVirt's validation of containerDisk.path (and kernelBoot paths); None when the path is fine."""
    if path == "/":
        return "must not point to root"
    # pkg/storage/admitters/disks.go ValidatePath: filepath.Join("/", path) must equal the path less
    # one trailing slash, so "/disk/x/" passes and "disk/x", "/disk/../x" and "//x" do not.
    cleaned = "/" + posixpath.normpath("/" + path).lstrip("/")
    if cleaned != path.removesuffix("/"):
        return "must be an absolute path to a file without relative components"
    return None


@dataclass
class Located:
    node: Node | None
    shown: str  # the path users asked for or KubeVirt would pick, with a leading slash
    problems: list[str]
    access: list[str] = field(default_factory=list)  # the subset of problems about UID 107's permissions


def locate(tree: Tree, path: str | None, allow_root_file: bool = False) -> Located:
    """The disk KubeVirt would boot: `path` resolved inside the root, or the single entry of /disk.

    With `allow_root_file` (Kubernetes ImageVolume mode) the root's only entry is the disk when it is
    not a directory, as for ORAS-style artifacts; a root holding more falls back to /disk
    (kubevirt pkg/virt-launcher/virtwrap/manager.go, findDiskFileInImageVolume).
    """
    if path is not None:
        problem = path_problem(path)
        if problem:
            return Located(None, path, [f"path {path}: {problem}"])
        return _resolved(tree, path.strip("/"), path)
    if allow_root_file:
        entries = tree.children("")
        if len(entries) == 1 and entries[0].kind != "dir":
            return _resolved(tree, entries[0].path, "/" + entries[0].path)
    folder = tree.nodes.get(DISK_DIR)
    if folder is None or folder.kind != "dir":
        return Located(None, "/disk", ["failed to check /disk for disks: no such file or directory"])
    entries = tree.children(DISK_DIR)
    if not entries:
        return Located(None, "/disk", ["no file found in folder /disk, no disk present"])
    if len(entries) > 1:
        return Located(None, "/disk", ["more than one file found in folder /disk, only one disk is allowed"])
    return _resolved(tree, entries[0].path, "/" + entries[0].path)


def _resolved(tree: Tree, rel: str, shown: str) -> Located:
    node, real, climbed = tree.resolve(rel)
    problems = []
    if climbed:
        problems.append(f"{shown}: a symlink points outside the image root; it is resolved inside the root, as in the container")
    if node is None:
        problems.append(f"no image on path {shown}")
        return Located(None, shown, problems)
    if node.kind != "file":
        problems.append(f"{shown} is a {node.kind}, not a regular file")
        return Located(None, shown, problems)
    access = access_problems(tree, node, shown)
    return Located(node, shown, problems + access, access)


def _allows(node: Node, bit_owner: int, bit_group: int, bit_other: int) -> bool:
    if node.uid == QEMU_UID:
        return bool(node.mode & bit_owner)
    if node.gid == QEMU_GID:
        return bool(node.mode & bit_group)
    return bool(node.mode & bit_other)


def access_problems(tree: Tree, node: Node, shown: str) -> list[str]:
    """UID 107 (qemu in virt-launcher) must be able to reach and read the file; KubeVirt never chowns it."""
    problems = []
    if not _allows(node, 0o400, 0o040, 0o004):
        problems.append(
            f"{shown} is not readable by UID 107 (owner {node.uid}:{node.gid}, mode {node.mode & 0o7777:04o});"
            " qemu in virt-launcher would fail with Permission denied"
        )
    parent = posixpath.dirname(node.path)
    while parent:
        directory = tree.nodes.get(parent)
        if directory is not None and not _allows(directory, 0o100, 0o010, 0o001):
            problems.append(
                f"/{parent} cannot be searched by UID 107 (owner {directory.uid}:{directory.gid},"
                f" mode {directory.mode & 0o7777:04o}), so {shown} cannot be opened"
            )
        parent = posixpath.dirname(parent)
    return problems


ANNOTATION_PATH = "io.diskkit.disk.path"
ANNOTATION_FORMAT = "io.diskkit.disk.format"
ANNOTATION_VIRTUAL_SIZE = "io.diskkit.disk.virtual-size"


def wanted(path: str | None, allow_root_file: bool = False):
    """Which tar members may turn out to be the disk, so they are spooled as their layer streams past."""
    if path is not None:
        target = path.lstrip("/")
        return lambda p: p == target
    if allow_root_file:
        return lambda p: posixpath.dirname(p) in (DISK_DIR, "")
    return lambda p: posixpath.dirname(p) == DISK_DIR
