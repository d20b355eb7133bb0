"""An image's root filesystem as metadata, built by streaming its layers in order, never unpacked.

Whiteouts are applied as the OCI spec says; member names that would escape the root are findings,
not paths to follow; symlinks resolve inside the image root, as they would inside the container.
Regular files a caller wants are spooled out (sparse) while their layer streams past, so the
common case reads each layer once.
"""

from __future__ import annotations

import errno
import io
import os
import posixpath
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

from diskkit.errors import DiskkitError, NoSpace
from diskkit.oci import artifact
from diskkit.oci.image import Image
from diskkit.oci.mediatypes import layer_compression
from diskkit.streams.compression import decompressing_reader
from diskkit.streams.cursor import Cursor
from diskkit.streams.digestio import HashingReader
from diskkit.streams.readahead import ReadAhead
from diskkit.streams.sparse import SparseDirectWriter, SparseWriter
from diskkit.transports.base import Source

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_SYMLINKS = 40
COPY_CHUNK = 1 << 20


@dataclass
class Node:
    path: str  # normalised, relative to the root; "" is the root itself
    kind: str  # file, dir, symlink, hardlink, device, fifo
    mode: int
    uid: int
    gid: int
    size: int
    link: str
    layer: int


@dataclass
class Tree:
    nodes: dict[str, Node] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)

    def children(self, directory: str) -> list[Node]:
        prefix = directory + "/" if directory else ""
        return sorted(
            (n for p, n in self.nodes.items() if p.startswith(prefix) and p != directory and "/" not in p[len(prefix) :]),
            key=lambda n: n.path,
        )

    def remove(self, path: str) -> None:
        prefix = path + "/"
        for p in [p for p in self.nodes if p == path or p.startswith(prefix)]:
            del self.nodes[p]

    def resolve(self, path: str) -> tuple[Node | None, str, bool]:
        """Follow symlinks with the root as '/', never above it.

        Returns the node, its real path, and whether a link tried to climb above the root
        (clamped there, as in the container, but worth reporting).
        """
        parts = [p for p in path.split("/") if p]
        resolved: list[str] = []
        hops = 0
        climbed = False
        while parts:
            part = parts.pop(0)
            if part == ".":
                continue
            if part == "..":
                if resolved:
                    resolved.pop()
                else:
                    climbed = climbed or hops > 0
                continue
            candidate = "/".join([*resolved, part])
            node = self.nodes.get(candidate)
            if node is not None and node.kind == "symlink":
                hops += 1
                if hops > MAX_SYMLINKS:
                    return None, candidate, climbed
                target = [p for p in node.link.split("/") if p]
                parts = target + parts
                if node.link.startswith("/"):
                    resolved = []
                continue
            resolved.append(part)
        real = "/".join(resolved)
        node = self.nodes.get(real)
        if node is not None and node.kind == "hardlink":
            node = self.nodes.get(node.link)
            return node, node.path if node else real, climbed
        return node, real, climbed


def clean_member_name(name: str) -> str | None:
    """The root-relative path of a tar member, or None when it would land outside the root."""
    while name.startswith("./"):
        name = name[2:]
    if name.startswith("/") or not name:
        return None
    norm = posixpath.normpath(name)
    if norm == ".":
        return ""
    if norm == ".." or norm.startswith("../"):
        return None
    return norm


_KINDS = {
    tarfile.REGTYPE: "file",
    tarfile.AREGTYPE: "file",
    tarfile.CONTTYPE: "file",
    tarfile.GNUTYPE_SPARSE: "file",  # GNU tar --sparse; the map comes with the header
    tarfile.DIRTYPE: "dir",
    tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hardlink",
    tarfile.CHRTYPE: "device",
    tarfile.BLKTYPE: "device",
    tarfile.FIFOTYPE: "fifo",
}


@dataclass
class Spooled:
    path: Path
    node: Node
    complete: bool


def _spool(pieces: Iterable, dest: Path) -> None:
    """Write a member's data to dest, leaving zero runs as holes. A pulled disk is read once by
    qemu-img's checks and then by its VMs, through their own caches: it is written past the page
    cache, which on this kind of VM cost more CPU than the tar parsing, and the device's time."""
    with open(dest, "wb") as out:
        writer = SparseDirectWriter(dest, out.fileno())
        try:
            for piece in pieces:
                writer.write(piece)
        except BaseException:
            writer.abort()
            raise
        writer.close()


class _Passing(io.RawIOBase):
    """ReadAhead's face (read, drain, close) on a stream read where it is: no thread of its own."""

    def __init__(self, source: BinaryIO):
        self._source = source

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return self._source.read(size)

    def readinto(self, buf) -> int:
        data = self._source.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def drain(self) -> None:
        while self._source.read(1 << 20):
            pass


def _member_data(tar: tarfile.TarFile, cursor: Cursor, member: tarfile.TarInfo, limit: int) -> Iterable:
    if member.sparse is not None:  # GNU sparse: tarfile expands the map into holes
        data = tar.extractfile(member)
        remaining = limit
        while remaining > 0 and (chunk := data.read(min(COPY_CHUNK, remaining))):
            remaining -= len(chunk)
            yield chunk
        return
    if cursor.tell() != member.offset_data:
        raise tarfile.ReadError(f"{member.name}: data expected at {member.offset_data}, stream at {cursor.tell()}")
    yield from cursor.views(limit)


def walk(
    source: Source,
    image: Image,
    want: Callable[[str], bool] = lambda path: False,
    spool_dir: Path | None = None,
    head_limit: int | None = None,
    only_layer: int | None = None,
    taps: dict[int, Callable[[BinaryIO], BinaryIO]] | None = None,
    inflaters: dict[int, Callable[[BinaryIO], BinaryIO]] | None = None,
) -> tuple[Tree, dict[str, Spooled]]:
    """Stream every layer (digest and diffID checked), building the tree and spooling wanted files;
    `taps[index]` wraps layer `index`'s blob stream before it is decompressed (lazy member checks),
    `inflaters[index]` decompresses it instead of one serial decompressor (lazy layers, every core)."""
    tree = Tree()
    spooled: dict[str, Spooled] = {}
    diff_ids = image.diff_ids
    manifest = image.manifest
    if len(diff_ids) != len(image.layers) and not artifact.is_artifact(manifest, image.config_descriptor.media_type):
        tree.findings.append(f"config lists {len(diff_ids)} diff_ids for {len(image.layers)} layers")

    def forget(path: str) -> None:
        prefix = path + "/"
        for key in [k for k in spooled if k == path or k.startswith(prefix)]:
            spooled.pop(key).path.unlink(missing_ok=True)

    for index, desc in enumerate(image.layers):
        if only_layer is not None and index != only_layer:
            continue
        as_file = artifact.file_layer(manifest, image.config_descriptor.media_type, desc.media_type, desc.annotations)
        if as_file is not None:
            _file_layer(source, image, index, as_file, tree, want, spool_dir, head_limit, spooled, forget, (taps or {}).get(index))
            continue
        kind = layer_compression(desc.media_type)
        if kind is None:
            raise DiskkitError(image.where, f"layer {index} has media type {desc.media_type}, which is not an image layer")
        with source.blob(desc) as verified:
            # Four stages, each on its own thread: fetch+blob digest | decompress | diffID | tar+write.
            # An inflater reads the blob on a thread of its own already: no stage before it.
            tap = (taps or {}).get(index)
            inflater = (inflaters or {}).get(index)
            fetched = (ReadAhead if inflater is None or tap is not None else _Passing)(tap(verified) if tap else verified)
            decompressed = inflater(fetched) if inflater else ReadAhead(decompressing_reader(fetched, kind, f"{image.where}: layer {index} ({desc.digest[:19]})"))
            hashed = HashingReader(decompressed)
            unpacked = ReadAhead(hashed)
            cursor = Cursor(unpacked)
            try:
                with tarfile.open(fileobj=cursor, mode="r:", errorlevel=2) as tar:
                    for member in tar:
                        _apply(tree, index, member, lambda m, n: _member_data(tar, cursor, m, n), want, spool_dir, head_limit, spooled, forget)
                unpacked.drain()
                fetched.drain()  # trailing bytes after the compressed stream still count for the digest
            except tarfile.TarError as exc:
                raise DiskkitError(image.where, f"layer {index} ({desc.digest[:19]}) is not a valid tar: {exc}") from None
            except (OSError, EOFError, ValueError) as exc:
                if isinstance(exc, DiskkitError):
                    raise
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    # Not the layer's fault: said as what it is, so the fix (space) is the one tried.
                    raise NoSpace(image.where, f"layer {index} ({desc.digest[:19]}): {os.strerror(exc.errno)} writing its files") from None
                raise DiskkitError(image.where, f"layer {index} ({desc.digest[:19]}) cannot be decompressed: {exc}") from None
            finally:
                for stage in (unpacked, decompressed, fetched):
                    stage.close()
        if index < len(diff_ids) and hashed.digest != diff_ids[index]:
            raise DiskkitError(image.where, f"layer {index} does not match its diffID {diff_ids[index]} (content hashes to {hashed.digest})")
    return tree, spooled


def _file_layer(source: Source, image: Image, index: int, as_file: artifact.FileLayer, tree: Tree, want, spool_dir, head_limit,
                spooled: dict[str, Spooled], forget, tap) -> None:
    """An artifact's file layer: the blob (decompressed per its media type's suffix) is one regular
    file at its title, root's and 0644 as CRI-O writes it; digest checked as it streams."""
    desc = image.layers[index]
    where = f"{image.where}: layer {index} ({desc.digest[:19]})"
    path = clean_member_name(as_file.title) if as_file.title else None
    if as_file.title and not path:
        tree.findings.append(f"layer {index}'s title {as_file.title!r} escapes the image root")
    dest = spool_dir / f"{index}-{len(spooled)}" if path and spool_dir is not None and want(path) else None
    size = 0
    with source.blob(desc) as verified:
        fetched = ReadAhead(tap(verified) if tap else verified)
        try:
            data = decompressing_reader(fetched, as_file.compression, where)
            out = open(dest, "wb") if dest is not None else None
            try:
                writer = SparseWriter(out) if out is not None else None
                limit = head_limit if head_limit is not None else -1
                while piece := data.read(COPY_CHUNK):
                    if writer is not None and (limit < 0 or size < limit):
                        writer.write(piece if limit < 0 else piece[: limit - size])
                    size += len(piece)
                if out is not None:
                    out.truncate()
            finally:
                if out is not None:
                    out.close()
            fetched.drain()
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpace(image.where, f"layer {index} ({desc.digest[:19]}): {os.strerror(exc.errno)} writing its file") from None
            raise DiskkitError(where, f"cannot be read: {exc}") from None
        finally:
            fetched.close()
    if not path:
        return  # CRI-O leaves a layer without a title out of the volume: "not mountable"
    forget(path)
    node = add_file(tree, index, path, size)
    if dest is not None:
        spooled[path] = Spooled(dest, node, head_limit is None or size <= head_limit)


def add_file(tree: Tree, index: int, path: str, size: int) -> Node:
    """An artifact's file layer applied to the tree: a regular file, root's and 0644, in directories
    0755, as CRI-O writes them into the image volume (os.WriteFile, os.MkdirAll)."""
    parent = posixpath.dirname(path)
    while parent and parent not in tree.nodes:
        tree.nodes[parent] = Node(parent, "dir", 0o755, 0, 0, 0, "", index)
        parent = posixpath.dirname(parent)
    tree.remove(path)
    tree.nodes[path] = Node(path, "file", 0o644, 0, 0, size, "", index)
    return tree.nodes[path]


def _apply(tree, index, member, member_data, want, spool_dir, head_limit, spooled, forget) -> None:
    path = clean_member_name(member.name)
    if path is None:
        tree.findings.append(f"tar entry {member.name!r} in layer {index} escapes the image root")
        return
    base = posixpath.basename(path)
    parent = posixpath.dirname(path)
    if base == OPAQUE:
        for child in tree.children(parent):
            if child.layer < index:
                tree.remove(child.path)
                forget(child.path)
        return
    if base.startswith(WHITEOUT):
        victim = posixpath.join(parent, base[len(WHITEOUT) :])
        tree.remove(victim)
        forget(victim)
        return
    kind = _KINDS.get(member.type, "other")
    link = member.linkname
    if kind == "hardlink":
        target = clean_member_name(link)
        if target is None or target not in tree.nodes:
            tree.findings.append(f"hardlink {path!r} in layer {index} points outside the image or to a missing file ({link!r})")
            return
        link = target
    existing = tree.nodes.get(path)
    if existing is not None and not (existing.kind == "dir" and kind == "dir"):
        tree.remove(path)
        forget(path)
    tree.nodes[path] = Node(path, kind, member.mode, member.uid, member.gid, member.size, link, index)
    if kind == "file" and spool_dir is not None and want(path):
        limit = member.size if head_limit is None else min(member.size, head_limit)
        dest = spool_dir / f"{index}-{len(spooled)}"
        _spool(member_data(member, limit), dest)
        spooled[path] = Spooled(dest, tree.nodes[path], limit == member.size)


def add_member(tree: Tree, index: int, member: tarfile.TarInfo) -> None:
    """Apply one tar header to the tree, as walk() does, for readers that fetch headers themselves."""
    _apply(tree, index, member, None, lambda path: False, None, None, {}, lambda path: None)


def extract_one(source: Source, image: Image, node: Node, dest: Path) -> None:
    """Spool one file out of its layer: for a disk reached only through a symlink or hardlink."""
    spool_dir = dest.parent / f".{dest.name}.spool"
    spool_dir.mkdir(exist_ok=True)
    try:
        _, spooled = walk(source, image, lambda p: p == node.path, spool_dir, None, only_layer=node.layer)
        found = spooled.get(node.path)
        if found is None:
            raise DiskkitError(image.where, f"/{node.path} vanished from layer {node.layer} on a second read")
        found.path.replace(dest)
    finally:
        shutil.rmtree(spool_dir, ignore_errors=True)
